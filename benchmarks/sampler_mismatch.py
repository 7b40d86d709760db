"""A sampler that is not the trainer, on the default job: bf16 experts in the engine against the trainer's NF4 ones,
uncorrected and with truncated importance sampling, beside the matched engine.

    python -m benchmarks.sampler_mismatch [--steps 200] [--eval-every 50] [--base runs/tiny-base] [--out DIR]
                                          [--moe-layers N]

Each variant is `python recipes/dapo.py` on recipes/configs/tiny_cpu.yaml (two Ray workers, the same base, seed and
data) with:
    matched         the engine is the trainer's model (the default)
    mismatched      rollout.engine_formats {routed_experts: bf16}: the checkpoint's own expert weights in the engine
    tis-token       mismatched + algorithm.tis {level: token, cap: 2}
    tis-sequence    mismatched + algorithm.tis {level: sequence, cap: 2}
    r3              mismatched + algorithm.routing_replay (the trainer uses the experts the engine chose)
    r3-tis-token    r3 + algorithm.tis {level: token, cap: 2}
    kv-fp8          rollout.kv_cache_dtype fp8: the engine is the trainer's model, its KV cache in FP8
    kv-fp8-tis      kv-fp8 + algorithm.tis {level: token, cap: 2}
    fp8-linears     model.quant attention, shared_experts and dense_mlp fp8 (as V3 stores them), rollout.merge_lora
                    false: the engine is the trainer's model, its FP8 linears dequantized (the reference of the two below)
    fp8-gemm        fp8-linears + rollout.fp8_linear_kernel scaled_mm: the engine multiplies them as FP8 GEMMs
    fp8-gemm-tis    fp8-gemm + algorithm.tis {level: token, cap: 2}
    fp8-copy        rollout.engine_formats every group fp8: the engine holds the base as DeepSeek-V3's checkpoint stores
                    it (vLLM's FP8 copy, issue 71), the trainer its NF4 experts and bf16 rest
    fp8-copy-tis    fp8-copy + algorithm.tis {level: token, cap: 2}
    fp8-copy-r3-tis fp8-copy-tis + algorithm.routing_replay
`--variants a,b` runs some of them; `--previous FILE` adds the variants of an earlier run's JSON that were not run.
`--moe-layers N`: the default model with N MoE layers after its dense one (the default base has 1, whose router reads
the dense layer's output, the same in both formats: no token can change experts there), warm-started like the
default base (the run's task and seed) into runs/tiny-base-moeN when missing.
Writes OUT/sampler_mismatch.json (per variant: held-out accuracy at each evaluation, logprob_gap, tis_mean and
routing_mismatch per step) and OUT/sampler_mismatch.png (held-out accuracy and logprob gap over steps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import yaml

from benchmarks.dapo_runs import run_dapo

ROOT = Path(__file__).resolve().parents[1]
MISMATCH = {"routed_experts": "bf16"}
TOKEN_TIS = {"level": "token", "cap": 2.0}
FP8_LINEARS = {
    "attention": "fp8",
    "shared_experts": "fp8",
    "dense_mlp": "fp8",
}  # as DeepSeek-V3's checkpoint stores them
FP8_COPY = {"routed_experts": "fp8", **FP8_LINEARS}  # vLLM's copy of V3: every quantizable weight as stored (FP8)


class Variant(NamedTuple):
    engine_formats: dict  # rollout.engine_formats ({}: none)
    tis: dict | None  # algorithm.tis
    replay: bool = False  # algorithm.routing_replay
    kv_cache_dtype: str = "auto"  # rollout.kv_cache_dtype
    quant: dict | None = None  # model.quant's keys set (the trainer's and the engine's formats)
    fp8_linear_kernel: str = "dequantize"  # rollout.fp8_linear_kernel


VARIANTS = {
    "matched": Variant({}, None),
    "mismatched": Variant(MISMATCH, None),
    "tis-token": Variant(MISMATCH, TOKEN_TIS),
    "tis-sequence": Variant(MISMATCH, {"level": "sequence", "cap": 2.0}),
    "r3": Variant(MISMATCH, None, True),
    "r3-tis-token": Variant(MISMATCH, TOKEN_TIS, True),
    "kv-fp8": Variant({}, None, kv_cache_dtype="fp8"),
    "kv-fp8-tis": Variant({}, TOKEN_TIS, kv_cache_dtype="fp8"),
    "fp8-linears": Variant({}, None, quant=FP8_LINEARS),
    "fp8-gemm": Variant({}, None, quant=FP8_LINEARS, fp8_linear_kernel="scaled_mm"),
    "fp8-gemm-tis": Variant({}, TOKEN_TIS, quant=FP8_LINEARS, fp8_linear_kernel="scaled_mm"),
    "fp8-copy": Variant(FP8_COPY, None),
    "fp8-copy-tis": Variant(FP8_COPY, TOKEN_TIS),
    "fp8-copy-r3-tis": Variant(FP8_COPY, TOKEN_TIS, True),
}


def variant_config(base: str, variant: Variant, steps: int, eval_every: int) -> dict:
    config = yaml.safe_load((ROOT / "recipes" / "configs" / "tiny_cpu.yaml").read_text())
    config["model"].update(base=base, warm_start=False)
    config["rollout"]["engine_formats"] = variant.engine_formats or None
    config["rollout"]["kv_cache_dtype"] = variant.kv_cache_dtype
    config["algorithm"]["tis"] = variant.tis
    config["algorithm"]["routing_replay"] = variant.replay
    if variant.quant:
        config["model"]["quant"].update(variant.quant)
        config["rollout"]["merge_lora"] = False  # a merged weight is not FP8: the FP8 variants compare unmerged
    config["rollout"]["fp8_linear_kernel"] = variant.fp8_linear_kernel
    config["run"].update(steps=steps, eval_every=eval_every, checkpoint_every=steps, time_limit_minutes=None)
    return config


def build_moe_base(moe_layers: int) -> str:
    """runs/tiny-base-moeN: the default job's warm start (its task, split seed and steps) on the default tiny model
    with `moe_layers` MoE layers after the dense one; reused when it is there with these settings."""
    from dataclasses import replace

    from allsync.config import parse_config
    from allsync.warm_start import settings_for_run, warm_start

    config = parse_config(yaml.safe_load((ROOT / "recipes" / "configs" / "tiny_cpu.yaml").read_text()))
    settings = settings_for_run(config)
    model = replace(settings.model, layers=settings.model.dense_layers + moe_layers)
    return str(warm_start(ROOT / "runs" / f"tiny-base-moe{moe_layers}", replace(settings, model=model)))


def run_variant(name: str, config: dict, out: Path) -> dict:
    rows, last_line = run_dapo(name, config, out / name)
    return {
        "heldout": {r["step"]: r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r},
        "logprob_gap": {r["step"]: r["logprob_gap"] for r in rows if "logprob_gap" in r},
        "tis_mean": {r["step"]: r["tis_mean"] for r in rows if "tis_mean" in r},
        "routing_mismatch": {r["step"]: r["routing_mismatch"] for r in rows if "routing_mismatch" in r},
        "last_line": last_line,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (accuracy, gap) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        # steps are ints in a fresh run and strings in one read back from JSON (--previous)
        accuracy.plot([int(k) for k in r["heldout"]], list(r["heldout"].values()), marker="o", label=name)
        gap.plot([int(k) for k in r["logprob_gap"]], list(r["logprob_gap"].values()), label=name)
    accuracy.set(xlabel="RL step", ylabel="held-out accuracy (avg@4)", title="held-out accuracy")
    gap.set(xlabel="RL step", ylabel="nats", yscale="log", title="engine - trainer logprob gap")
    accuracy.legend()
    fig.suptitle("sampler against trainer, default job: " + ", ".join(results))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--base", default=str(ROOT / "runs" / "tiny-base"), help="the default job's warm-started base")
    parser.add_argument("--out", default=str(ROOT / "runs" / "sampler-mismatch"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    parser.add_argument("--previous", help="an earlier run's sampler_mismatch.json: its other variants join the report")
    parser.add_argument("--moe-layers", type=int, help="build (or reuse) a base with this many MoE layers")
    args = parser.parse_args(argv)
    if args.moe_layers is not None:
        if args.moe_layers < 1:
            parser.error(f"--moe-layers {args.moe_layers}: must be >= 1")
        args.base = build_moe_base(args.moe_layers)
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if not (Path(args.base) / "config.json").exists():
        parser.error(f"--base {args.base}: no checkpoint (run the default job once: it builds runs/tiny-base)")
    out = Path(args.out)
    previous = json.loads(Path(args.previous).read_text()) if args.previous else {}
    results = {name: r for name, r in previous.items() if name not in chosen}
    for name in chosen:
        results[name] = run_variant(name, variant_config(args.base, VARIANTS[name], args.steps, args.eval_every), out)
        r = results[name]
        gaps = list(r["logprob_gap"].values())
        mismatch = sorted(r["routing_mismatch"].values()) or [float("nan")]
        print(
            f"{name:<13} held-out {r['heldout']}  logprob gap median {sorted(gaps)[len(gaps) // 2]:.2e}  "
            f"routing mismatch median {mismatch[len(mismatch) // 2]:.4f}",
            flush=True,
        )
    (out / "sampler_mismatch.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "sampler_mismatch.png")
    print(f"wrote {out / 'sampler_mismatch.json'} and {out / 'sampler_mismatch.png'}")
    return results


if __name__ == "__main__":
    main()
