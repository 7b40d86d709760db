"""One DeepSeek-V3 MoE layer (sigmoid router, top-8, routed experts; no shared experts in any variant):
forward + backward time and peak memory of

    base  FrozenExperts alone, backward to the input activations
    ours  LoRAExperts (per-expert LoRA on gate/up/down), backward to the input and to A, B, with the
          routed-expert kernel a user gets (`auto`); `--kernels loop,grouped_mm` adds a row per named kernel
          (ours:loop = one step per expert, ours:grouped_mm = torch grouped GEMMs for the adapter matmuls);
          `--layouts per_expert,shared_outer` adds the shared-outer layout's rows (ours[shared_outer]: A of gate/up
          and B of down shared by the layer's experts)
    peft  PEFT `target_parameters` LoRA on transformers' DeepseekV3Experts (fused gate_up_proj [E,2I,H],
          down_proj [E,H,I]); bf16 only, since PEFT wraps plain tensors, not quantized weights

    python -m benchmarks.moe_lora [--experts 8,32,64,128,256] [--formats bf16,nf4,fp8] [--json out.json]
    python -m benchmarks.moe_lora --real-v3                    # GPU: hidden 7168, moe_intermediate 2048, E 256, 16k
                                                               # tokens, ours with the loop and with grouped_mm

Time: best of --repeats steps after a warm-up step, the variants interleaved step by step so that
load from other processes hits them alike (a variant whose warm-up step takes over 3 s is timed once).
On CPU the default is one torch thread, timed by process CPU time (robust on a shared machine);
`--threads 2` times wall clock instead.
Peak memory: bytes resident before the step (frozen weights, adapters, router, input, output gradient)
plus the largest excess of bytes torch allocated during one step over what it freed (CPU: every
allocator event recorded by torch.profiler with profile_memory; CUDA: max_memory_allocated). So the
ratio is about total memory, not just activations.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import nn

from moe_lora.lora_layers import LoRAExperts
from quant.formats import quantize_weight
from quant.modules import EXPERT_PROJECTIONS, FrozenExperts

DEFAULT_EXPERTS = (8, 32, 64, 128, 256)
QUICK = dict(hidden=128, intermediate=64, tokens=64, experts=(8, 16), formats=("bf16", "nf4"), repeats=1)
REAL_V3 = dict(
    hidden=7168, intermediate=2048, tokens=16384, experts=(256,), device="cuda", kernels=("loop", "grouped_mm")
)


@dataclass(frozen=True)
class BenchSpec:
    hidden: int = 1024
    intermediate: int = 256
    tokens: int = 2048
    top_k: int = 8
    rank: int = 8
    experts: tuple[int, ...] = DEFAULT_EXPERTS
    formats: tuple[str, ...] = ("bf16", "nf4", "fp8")
    kernels: tuple[str, ...] = ("auto",)  # LoRAExperts kernels: auto (row "ours"), loop, grouped_mm ("ours:<kernel>")
    layouts: tuple[str, ...] = ("per_expert",)  # LoRAExperts layouts; shared_outer rows are "ours[shared_outer]..."
    device: str = "cpu"
    repeats: int = 3
    threads: int = 1  # torch intra-op threads on CPU; 1 makes the step's CPU time a fair clock (see cpu_clock)
    time_budget_s: float = 3.0  # a variant whose warm-up step took longer is not repeated
    seed: int = 0


@dataclass
class Row:
    experts: int
    format: str
    variant: str
    time_ms: float | None = None
    peak_mib: float | None = None
    time_vs_base: float | None = None
    mem_vs_base: float | None = None
    tokens_per_s: float | None = None  # tokens through forward + backward per second
    note: str = ""


@dataclass
class Variant:
    name: str
    experts: nn.Module
    trainable: list[torch.Tensor] = field(default_factory=list)
    resident_bytes: int = 0  # frozen weights + adapters


# ------------------------------------------------------------------------------------------ the layer
def hf_config(spec: BenchSpec, num_experts: int):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        hidden_size=spec.hidden,
        moe_intermediate_size=spec.intermediate,
        n_routed_experts=num_experts,
        num_experts_per_tok=spec.top_k,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
    )
    cfg._experts_implementation = "eager"  # the per-expert loop, like ours (not a fused grouped GEMM)
    return cfg


def make_router(spec: BenchSpec, num_experts: int, gen: torch.Generator) -> nn.Module:
    """DeepSeek-V3's router: sigmoid scores, top-k on scores + correction bias, normalised, x2.5; frozen.

    The correction bias stays zero: a random one would skew the load (training tunes it to balance it)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    router = DeepseekV3TopkRouter(hf_config(spec, num_experts))
    router.weight.data = torch.randn(num_experts, spec.hidden, generator=gen) / spec.hidden**0.5
    return router.requires_grad_(False).to(spec.device)


def dense_weights(spec: BenchSpec, num_experts: int) -> dict[str, torch.Tensor]:
    """bf16 [E, out, in] per projection, std 1/sqrt(in), drawn on the device (real-V3 sizes are 22 GB)."""
    gen = torch.Generator(device=spec.device).manual_seed(spec.seed + num_experts)
    h, i = spec.hidden, spec.intermediate
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    return {
        p: torch.randn(num_experts, o, n, generator=gen, device=spec.device, dtype=torch.bfloat16).div_(n**0.5)
        for p, (o, n) in shapes.items()
    }


def frozen_experts(spec: BenchSpec, dense: dict[str, torch.Tensor], fmt: str) -> FrozenExperts:
    n = dense["gate"].shape[0]
    experts = FrozenExperts(n, spec.hidden, spec.intermediate)
    for p in EXPERT_PROJECTIONS:
        for e in range(n):
            experts.set_weight(e, p, quantize_weight(dense[p][e], fmt))
    return experts


def frozen_bytes(experts: FrozenExperts) -> int:
    return sum(w.nbytes for ws in experts.weights.values() for w in ws)


def ours_variant(
    spec: BenchSpec, frozen: FrozenExperts, gen: torch.Generator, kernel: str = "auto", layout: str = "per_expert"
) -> Variant:
    """LoRAExperts around the same frozen stack the base row runs."""
    # float32 adapters, as LoRAConfig defaults to
    experts = LoRAExperts(frozen, spec.rank, scale=2.0, kernel=kernel, layout=layout)
    for b in experts.lora_B.values():  # nonzero B: the same work as in training, not a shortcut
        b.data.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    params = list(experts.parameters())
    name = ("ours" if layout == "per_expert" else f"ours[{layout}]") + ("" if kernel == "auto" else f":{kernel}")
    return Variant(name, experts, params, frozen_bytes(frozen) + sum(p.nbytes for p in params))


def peft_variant(spec, dense) -> Variant:
    """PEFT's LoRA for 3-D expert parameters on transformers' DeepseekV3Experts, bf16."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    n = dense["gate"].shape[0]
    holder = nn.Module()
    with torch.device("meta"):  # no full-size float32 init; the bf16 stacks are assigned below
        holder.experts = DeepseekV3Experts(hf_config(spec, n))
    holder.experts.gate_up_proj = nn.Parameter(torch.cat([dense["gate"], dense["up"]], dim=1), requires_grad=False)
    holder.experts.down_proj = nn.Parameter(dense["down"], requires_grad=False)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=2 * spec.rank,
        target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    inject_adapter_in_model(config, holder)
    for name, p in holder.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.01)
    trainable = [p for p in holder.parameters() if p.requires_grad]
    return Variant("peft", holder.experts, trainable, sum(p.nbytes for p in holder.parameters()))


# ------------------------------------------------------------------------------------------ measuring
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def clear_grads(variant: Variant, x: torch.Tensor) -> None:
    for t in (x, *variant.trainable):
        t.grad = None


def step(router, variant: Variant, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    clear_grads(variant, x)
    _, top_k_weights, top_k_index = router(x)
    variant.experts(x, top_k_index, top_k_weights).backward(grad_out)


def cpu_step_peak_bytes(run) -> int:
    """Largest (allocated - freed) bytes torch's CPU allocator reached during run(), from the profiler's
    allocation events (each carries its signed size)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def cuda_step_peak_bytes(run) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def cpu_clock(spec: BenchSpec) -> bool:
    """On a CPU with one intra-op thread, time the step by the CPU time this process spent on it: the
    2-core machines these run on are shared, and wall time there measures the neighbours (with two
    threads, every OpenMP barrier waits for whichever thread was descheduled)."""
    return spec.device == "cpu" and spec.threads == 1


def timed_ms(run, spec: BenchSpec) -> float:
    clock = time.process_time if cpu_clock(spec) else time.perf_counter
    sync(spec.device)
    t0 = clock()
    run()
    sync(spec.device)
    return (clock() - t0) * 1e3


def best_times(spec: BenchSpec, runs: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Best of `repeats` steps per variant after a warm-up step, the variants interleaved round by round
    so that load from other processes hits them alike. A variant whose warm-up step alone exceeds the
    time budget keeps that single time (PEFT at large E takes tens of seconds a step on CPU)."""
    times = {name: [timed_ms(run, spec)] for name, run in runs.items()}
    fast = [name for name in runs if times[name][0] < spec.time_budget_s * 1e3]
    for name in fast:
        times[name] = []
    for _ in range(spec.repeats):
        for name in fast:
            times[name].append(timed_ms(runs[name], spec))
    return {name: min(t) for name, t in times.items()}


def peak_mib(spec: BenchSpec, run, resident_bytes: int) -> float:
    step_peak = cuda_step_peak_bytes(run) if spec.device == "cuda" else cpu_step_peak_bytes(run)
    return (resident_bytes + step_peak) / 2**20


# ------------------------------------------------------------------------------------------ running
def measure_variants(spec, num_experts, fmt, variants: list[Variant], router, x, grad_out) -> list[Row]:
    shared = x.nbytes + grad_out.nbytes + sum(t.nbytes for t in router.state_dict().values())
    runs = {v.name: partial(step, router, v, x, grad_out) for v in variants}
    times = best_times(spec, runs)
    peaks = {}
    for v in variants:
        clear_grads(v, x)  # freed before the probe starts, so it sees every free it needs to
        peaks[v.name] = peak_mib(spec, runs[v.name], v.resident_bytes + shared)
    return [Row(num_experts, fmt, v.name, times[v.name], peaks[v.name]) for v in variants]


def bench_one(spec: BenchSpec, num_experts: int, fmt: str) -> list[Row]:
    gen = torch.Generator().manual_seed(spec.seed + num_experts)
    router = make_router(spec, num_experts, gen)
    dense = dense_weights(spec, num_experts)
    x = torch.randn(spec.tokens, spec.hidden, generator=gen).to(spec.device, torch.bfloat16).requires_grad_()
    grad_out = torch.randn(spec.tokens, spec.hidden, generator=gen).to(spec.device, torch.bfloat16)
    frozen = frozen_experts(spec, dense, fmt)
    peft_dense = dense if fmt == "bf16" else None  # PEFT runs on plain bf16 tensors only
    del dense  # at real-V3 sizes the bf16 stack is 22 GB; quantized runs do not need it
    base = Variant("base", frozen, [], frozen_bytes(frozen))
    ours = [
        ours_variant(spec, frozen, torch.Generator().manual_seed(spec.seed), k, layout)
        for layout in spec.layouts
        for k in spec.kernels
    ]
    rows = measure_variants(spec, num_experts, fmt, [base, *ours], router, x, grad_out)
    del frozen, base, ours
    if peft_dense is not None:
        try:
            rows += measure_variants(spec, num_experts, fmt, [peft_variant(spec, peft_dense)], router, x, grad_out)
        except (RuntimeError, MemoryError) as err:  # e.g. out of memory: PEFT forms full-size W + dW and its grad
            rows.append(Row(num_experts, fmt, "peft", note=f"failed: {str(err).splitlines()[0][:60]}"))
    for r in rows:
        if r.time_ms is not None:
            r.tokens_per_s = spec.tokens / (r.time_ms / 1e3)
            r.time_vs_base, r.mem_vs_base = r.time_ms / rows[0].time_ms, r.peak_mib / rows[0].peak_mib
    return rows


def run_benchmark(spec: BenchSpec) -> list[Row]:
    rows = []
    for fmt in spec.formats:
        for n in spec.experts:
            rows += bench_one(spec, n, fmt)
    return rows


def worst_ours(rows: list[Row]) -> tuple[float, float]:
    ours = [r for r in rows if r.variant.startswith("ours") and r.time_vs_base is not None]
    return max(r.time_vs_base for r in ours), max(r.mem_vs_base for r in ours)


def format_table(spec: BenchSpec, rows: list[Row]) -> str:
    fmt_num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = [
        f"MoE layer fwd+bwd: hidden {spec.hidden}, moe_intermediate {spec.intermediate}, tokens {spec.tokens}, "
        f"top-{spec.top_k}, rank {spec.rank}, device {spec.device} ({torch.get_num_threads()} threads), "
        f"time = best of {spec.repeats} ({'process CPU time' if cpu_clock(spec) else 'wall clock'})",
        "base = FrozenExperts (grad to input); ours = LoRAExperts (grad to input + A/B; ours:K with kernel K); "
        "peft = PEFT target_parameters on DeepseekV3Experts (bf16 only: PEFT needs plain tensors)",
        f"{'experts':>7}  {'format':<6}  {'variant':<30}{'time ms':>10}{'tokens/s':>10}{'peak MiB':>11}{'time/base':>11}{'mem/base':>10}  note",
    ]
    for r in rows:
        lines.append(
            f"{r.experts:>7}  {r.format:<6}  {r.variant:<30}{fmt_num(r.time_ms, '.1f'):>10}{fmt_num(r.tokens_per_s, '.0f'):>10}{fmt_num(r.peak_mib, '.1f'):>11}"
            f"{fmt_num(r.time_vs_base, '.2f'):>11}{fmt_num(r.mem_vs_base, '.2f'):>10}  {r.note}".rstrip()
        )
    t, m = worst_ours(rows)
    lines.append(f"worst ours/base: time {t:.2f}x, memory {m:.2f}x")
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[BenchSpec, str | None]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--experts", help="comma list, e.g. 8,32,64")
    ap.add_argument("--formats", help="comma list of bf16,nf4,fp8,int8")
    ap.add_argument("--kernels", help="comma list of auto,loop,grouped_mm (routed-expert LoRA kernels to time)")
    ap.add_argument("--layouts", help="comma list of per_expert,shared_outer (routed-expert LoRA layouts to time)")
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--threads", type=int, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    ap.add_argument("--real-v3", action="store_true", help="DeepSeek-V3 sizes (GPU)")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args(argv)
    values = dict(QUICK) if args.quick else dict(REAL_V3) if args.real_v3 else {}
    for key in ("hidden", "intermediate", "tokens", "rank", "top_k", "device", "repeats", "threads"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if args.experts:
        values["experts"] = tuple(int(v) for v in args.experts.split(","))
    if args.formats:
        values["formats"] = tuple(args.formats.split(","))
    if args.kernels:
        values["kernels"] = tuple(args.kernels.split(","))
    if args.layouts:
        values["layouts"] = tuple(args.layouts.split(","))
    return BenchSpec(**values), args.json


def main(argv=None) -> list[Row]:
    spec, json_path = parse_args(argv)
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(spec.threads)
        rows = run_benchmark(spec)
        table = format_table(spec, rows)
    finally:
        torch.set_num_threads(threads_before)
    print(table, flush=True)
    if json_path:
        t, m = worst_ours(rows)
        result = {
            "spec": asdict(spec),
            "rows": [asdict(r) for r in rows],
            "worst_ours_vs_base": {"time": t, "memory": m},
        }
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
