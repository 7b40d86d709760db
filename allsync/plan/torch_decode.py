"""The torch engine's decode step as measured, eager, on DeepSeek-V3's real layers (issue 46).

`benchmarks/engine_decode.py` timed the engine's decode step (allsync.engines.slots.decode_forward, sampling, the
host read of the finish flags) on two real-width layers, one dense and one MoE with all 256 routed experts, at R
live rows and C cached positions per row, each layer and the rest of the step apart. Those times fit

    layer(R, C)     = fixed(R) + kv x R C                      every decoder layer (attention, the dense MLP or
                                                                 the shared expert, LoRA, norms)
    MoE extra(R)    = touched(R) x per_expert(format, R)        a MoE layer's time above the dense layer's: the
                                                                 routed experts, touched(R) = E (1 - (1 - k/E)^R)
    rest(R)                                                     embedding, final norm, lm_head, sampling, host read

with fixed, per_expert and rest measured at two row counts and interpolated linearly in R between them (the
nearest beyond), kv one number (the mean over the cases). A plan's decode step of B rows on a GPU of an
expert-parallel group of EP, holding E / EP experts per MoE layer, over C cached tokens in all, is then

    t = L fixed(B) + L kv C + MoE layers x (E / EP) (1 - (1 - k/E)^(B EP)) x per_expert(format, B EP) + rest(B)

(the held experts see the whole group's B EP tokens). The step is host-bound (hundreds of kernel launches and their
Python per layer, a few per routed expert; BENCHMARKS.md has the profile), so the H200's numbers are used for the
H100 too, and for every model width: a narrower model launches as many kernels. bf16 and int8 experts were not
measured and take FP8's and NF4's rates.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path


def expected_touched(experts: int, top_k: int, tokens: float) -> float:
    """E (1 - (1 - k/E)^T): distinct experts T tokens each routed to k of E uniformly at random reach."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through `points` (sorted by x), the nearest point's value beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


@dataclass(frozen=True)
class TorchDecodeRates:
    """The fitted rates (module docstring), seconds."""

    fixed: tuple[tuple[float, float], ...]  # (rows, a layer's time without its cache)
    kv: float  # per cached position, row and layer
    per_expert: dict[str, tuple[tuple[float, float], ...]]  # format -> (rows, per touched routed expert)
    rest: tuple[tuple[float, float], ...]  # (rows, the step outside the decoder layers)

    def step_seconds(self, config: dict, rows: float, context: float, expert_parallel: int, fmt: str) -> float:
        """One decode step of `rows` rows on a GPU holding n_routed_experts / expert_parallel experts per MoE layer,
        `context` cached positions in all (module docstring)."""
        ep = max(expert_parallel, 1)
        experts, k = config["n_routed_experts"], config["num_experts_per_tok"]
        layers, moe = config["num_hidden_layers"], config["num_hidden_layers"] - config["first_k_dense_replace"]
        group_rows = rows * ep
        routed = moe * expected_touched(experts, k, group_rows) / ep * interpolate(self.per_expert[fmt], group_rows)
        return (
            layers * interpolate(self.fixed, rows) + layers * self.kv * context + routed + interpolate(self.rest, rows)
        )


def fit_torch_decode(measured: dict) -> TorchDecodeRates:
    """The rates from benchmarks/engine_decode.py's JSON (two layers: [dense, MoE]; at least two contexts and two
    row counts per plan; shape["experts"] and shape["experts_per_token"] as run), of its eager (live-slot) steps."""
    experts, k = measured["shape"]["experts"], measured["shape"]["experts_per_token"]
    cases = [
        (p["plan"], c)
        for p in measured["plans"]
        for c in p["cases"]
        # the live-slot step of the torch path (runs before --modes: eager, and --attention: torch)
        if "oom" not in c and c.get("mode", "eager") == "eager" and c.get("attention", "torch") == "torch"
    ]
    by = {}
    for plan, c in cases:
        by.setdefault((plan, c["rows"]), []).append(c)
    kv_slopes = []
    for group in by.values():
        short, long = min(group, key=lambda c: c["context"]), max(group, key=lambda c: c["context"])
        if short["context"] == long["context"]:  # one context measured (the others ran out of memory)
            continue
        kv_slopes.append(
            (long["layer_ms"][0] - short["layer_ms"][0]) / (short["rows"] * (long["context"] - short["context"]))
        )
    if not kv_slopes:
        raise ValueError("fit_torch_decode: no plan and row count was measured at two contexts")
    kv = statistics.mean(kv_slopes) / 1000
    rows = sorted({r for _, r in by})
    fixed, rest, per_expert = [], [], {}
    for r in rows:
        here = [c for (_, rr), group in by.items() if rr == r for c in group]
        fixed.append((r, statistics.mean(c["layer_ms"][0] / 1000 - kv * r * c["context"] for c in here)))
        rest.append((r, statistics.mean(c["rest_ms"] / 1000 for c in here)))
    for plan in sorted({p for p, _ in by}):
        per_expert[plan] = tuple(
            (
                r,
                statistics.mean((c["layer_ms"][1] - c["layer_ms"][0]) / 1000 for c in by[(plan, r)])
                / expected_touched(experts, k, r),
            )
            for r in rows
            if (plan, r) in by
        )
    return TorchDecodeRates(tuple(fixed), kv, per_expert, tuple(rest))


def rounded(rates: TorchDecodeRates, digits: int = 3) -> TorchDecodeRates:
    """The rates to `digits` significant digits (what the constant below holds)."""

    def r(x: float) -> float:
        return float(f"{x:.{digits}g}")

    def points(ps):
        return tuple((x, r(y)) for x, y in ps)

    return TorchDecodeRates(
        points(rates.fixed), r(rates.kv), {f: points(p) for f, p in rates.per_expert.items()}, points(rates.rest)
    )


def load_measured(path: str | Path) -> TorchDecodeRates:
    return rounded(fit_torch_decode(json.loads(Path(path).read_text())))


# benchmarks/measured/engine_decode_h200.json (the lent H200, torch 2.11.0+cu130, 2026-11-27), fit_torch_decode rounded
# to 3 digits (tests/allsync/test_plan_step.py refits it); bf16 takes FP8's rates and int8 NF4's (not measured)
_FP8_EXPERT = ((32, 0.000386), (256, 0.000398))
_NF4_EXPERT = ((32, 0.00017), (256, 0.000292))
EAGER_H200 = TorchDecodeRates(
    fixed=((32, 0.00719), (256, 0.00722)),
    kv=3.42e-09,
    per_expert={"fp8": _FP8_EXPERT, "nf4": _NF4_EXPERT, "bf16": _FP8_EXPERT, "int8": _NF4_EXPERT},
    rest=((32, 0.0028), (256, 0.00629)),
)


# The fixed-shape step as CUDA graphs (rollout.decode_graphs), measured on the H200 (benchmarks/measured/
# engine_decode_h200_graphed_nf4_2.json and engine_decode_h200_blocks.json, the second lent GPU session of 2026-11-28;
# engine_decode_h200_graphed_fp8.json, the first): its time over the plan's own roofline of it.
FITTED_BLOCKS = "64x32x8"  # the latent kernel's cuts the engine runs (moe_lora.latent_attention.BLOCKS), priced
PRE_SWEEP_BLOCKS = "16x32x8"  # the cuts of runs recorded before benchmarks/engine_decode.py wrote them
GRAPHED_STAND_IN = {"bf16": "fp8", "int8": "nf4"}  # formats not measured: FP8's and NF4's factors, as the eager rates


@dataclass(frozen=True)
class GraphedDecodeFactors:
    """A graphed decode step's measured time over the plan's roofline of its two parts (step_time.DecodeCost):

        t = w(format, expert kernel, B) x weights bytes / bandwidth + kv(attention kernel) x cache bytes / bandwidth

    weights bytes: every held weight as stored plus the compute-dtype copy each quantized one is dequantized into,
    written and read back (none for NF4 experts that rollout.frozen_expert_kernel triton reads as stored); cache bytes:
    what the step's attention moves (allsync.plan.fit.kv_step_bytes_per_token); bandwidth: the Hardware's HBM x
    decode_bandwidth_efficiency. w is measured at two row counts and interpolated in B (the nearest beyond); kv is one
    number per attention kernel. The factors hold what the roofline leaves out (kernel launches inside the graph, the
    float32 scores of the torch path, the latent kernel's head blocks re-reading each position, the dequantize
    temporaries) and are taken to hold at every width and depth and on the H100 (scaled by its bandwidth)."""

    weights: dict[tuple[str, str], tuple[tuple[float, float], ...]]  # (format, expert kernel) -> ((rows, w), ...)
    kv: dict[str, float]  # attention kernel (torch, triton) -> factor

    def factors(self, fmt: str, expert_kernel: str, attention: str, rows: float) -> tuple[float, float]:
        """(w, kv) of a step of `rows` slots."""
        key = (GRAPHED_STAND_IN.get(fmt, fmt), expert_kernel)
        return interpolate(self.weights[key], rows), self.kv[attention]


def fit_graphed(measured: dict, weights_seconds: dict, kv_seconds: dict) -> GraphedDecodeFactors:
    """The factors (GraphedDecodeFactors) from benchmarks/engine_decode.py's JSON of graphed steps over FP8 latent
    slots, given the plan's roofline of the measured model: weights_seconds[(plan, expert kernel)] (the weights part
    of one step) and kv_seconds[attention] (the cache part per row and cached position). kv: per attention and
    latent-kernel cuts, the slope between two contexts over the roofline's, averaged over (plan, expert kernel,
    rows); the latent kernel's is that of FITTED_BLOCKS. w: per (plan, expert kernel, rows), each case's time less
    its cache part (at the cuts it ran with) over the weights part, averaged over its cases."""

    def cut(c: dict) -> tuple[str, str | None]:
        return c["attention"], c.get("blocks", PRE_SWEEP_BLOCKS) if c["attention"] == "triton" else None

    cases = [
        (p["plan"], c)
        for p in measured["plans"]
        for c in p["cases"]
        if "oom" not in c
        and c["mode"] == "graphed"
        and c.get("kv_cache", "fp8") == "fp8"
        and c.get("fp8_linear_kernel", "dequantize") == "dequantize"
    ]
    by = {}
    for plan, c in cases:
        by.setdefault((plan, c["expert_kernel"], cut(c), c["rows"]), []).append(c)
    slopes = {}
    for (_, _, (attention, blocks), rows), group in by.items():
        short, long = min(group, key=lambda c: c["context"]), max(group, key=lambda c: c["context"])
        if long["context"] > short["context"]:
            slope = (long["step_ms"] - short["step_ms"]) / 1000 / (rows * (long["context"] - short["context"]))
            slopes.setdefault((attention, blocks), []).append(slope / kv_seconds[attention])
    if not slopes:
        raise ValueError("fit_graphed: no graphed case was measured at two contexts")
    kv_by_cut = {key: statistics.mean(s) for key, s in slopes.items()}
    kv = {
        a: kv_by_cut[key]
        for a, key in (("torch", ("torch", None)), ("triton", ("triton", FITTED_BLOCKS)))
        if key in kv_by_cut
    }
    kv.update({a: max(kv.values()) for a in ("torch", "triton") if a not in kv})  # not measured: the slower one's
    weights: dict = {}
    for plan, c in cases:
        cache = kv_by_cut.get(cut(c), kv[c["attention"]]) * kv_seconds[c["attention"]] * c["rows"] * c["context"]
        w = (c["step_ms"] / 1000 - cache) / weights_seconds[(plan, c["expert_kernel"])]
        weights.setdefault((plan, c["expert_kernel"]), {}).setdefault(c["rows"], []).append(w)
    return GraphedDecodeFactors(
        {key: tuple((r, statistics.mean(ws)) for r, ws in sorted(by_rows.items())) for key, by_rows in weights.items()},
        kv,
    )


def rounded_graphed(factors: GraphedDecodeFactors, digits: int = 3) -> GraphedDecodeFactors:
    """The factors to `digits` significant digits (what the constant below holds)."""

    def r(x: float) -> float:
        return float(f"{x:.{digits}g}")

    return GraphedDecodeFactors(
        {key: tuple((x, r(y)) for x, y in points) for key, points in factors.weights.items()},
        {a: r(f) for a, f in factors.kv.items()},
    )


# fit_graphed of the H200's graphed steps (the three JSONs above, in that order) on the H200 preset, rounded to 3
# digits (tests/allsync/test_plan_step.py refits it)
GRAPHED_H200 = GraphedDecodeFactors(
    weights={
        ("nf4", "dequantize"): ((32, 1.63), (256, 2.02)),
        ("nf4", "triton"): ((32, 11.3), (256, 17.5)),
        ("fp8", "dequantize"): ((32, 6.22), (256, 6.62)),
    },
    kv={"torch": 2.84, "triton": 10.9},
)
