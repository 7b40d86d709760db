"""Where the fixed-shape decode step's time goes (issue 48): torch.profiler over the step a CUDA graph captures.

    python -m benchmarks.decode_profile [--plan nf4] [--cases 32x1024,256x20480] [--attention torch]
                                        [--expert-kernel dequantize] [--steps 3] [--top 25] [--json out.json]

The model and the pool are benchmarks/engine_decode.py's (two real-width DeepSeek-V3 layers, one dense and one MoE
of 256 routed experts, LoRA rank 16 on the 671B targets, every slot live with random FP8 latents of C positions);
the step is allsync.engines.slots.FixedShapeStep run eagerly, the same kernels rollout.decode_graphs replays. For
each case R x C: after one step to warm up, --steps steps are profiled, and the GPU kernels (on the CPU: the aten
operators) are listed by their time per step, largest first, with their share of the step's summed kernel time
and the calls per step; the operators that launched them come with their own device time, so a kernel can be
traced to the code that asks for it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from benchmarks.engine_decode import decode_model, decode_setup, use_expert_kernel
from benchmarks.v3_layer_memory import REAL_V3_TWO_LAYERS, v3_config, write_checkpoint
from quant.checkpoint_io import atomic_write_text


def device_time(event) -> float:
    """Self device microseconds of a profiler average (the attribute's name moved between torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def table(events, steps: int, top: int, key) -> list[dict]:
    """The `top` events by key(event) (microseconds over `steps` steps) as rows of ms per step, share, calls per step."""
    timed = [(key(e), e) for e in events if key(e) > 0]
    total = sum(t for t, _ in timed)
    timed.sort(key=lambda pair: -pair[0])
    return [
        {
            "name": e.key[:120],
            "ms_per_step": round(t / steps / 1000, 3),
            "share": round(t / total, 4),
            "calls_per_step": round(e.count / steps, 1),
        }
        for t, e in timed[:top]
    ]


@torch.no_grad()
def profile_case(model, rows: int, context: int, attention: str, expert_kernel: str, steps: int, top: int) -> dict:
    """The fixed-shape step of `rows` live rows over `context` positions under torch.profiler (module docstring)."""
    cuda = model.device.type == "cuda"
    use_expert_kernel(model, expert_kernel)
    step, last, seeds, counts = decode_setup(model, rows, context, steps + 2, "fixed", True, attention)
    last, _ = step(last, seeds, counts, context + 1)  # compiles the Triton kernels, warms the allocator
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for s in range(steps):
            counts += 1
            last, _ = step(last, seeds, counts, context + s + 2)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        operators = [e for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::")]
        kernel_rows = table(kernels, steps, top, device_time)
        operator_rows = table(operators, steps, top, device_time)
        busy = sum(device_time(e) for e in kernels) / steps / 1000
    else:
        operators = [e for e in events if e.key.startswith("aten::")]
        kernel_rows = []
        operator_rows = table(operators, steps, top, lambda e: float(e.self_cpu_time_total))
        busy = sum(float(e.self_cpu_time_total) for e in operators) / steps / 1000
    return {
        "rows": rows,
        "context": context,
        "attention": attention,
        "expert_kernel": expert_kernel,
        "step_ms_profiled": round(1000 * wall, 3),
        "kernel_ms_per_step": round(busy, 3),
        "kernels": kernel_rows,
        "operators": operator_rows,
    }


def print_case(case: dict) -> None:
    print(
        f"\n== rows {case['rows']} context {case['context']} attention {case['attention']} experts "
        f"{case['expert_kernel']}: step {case['step_ms_profiled']:.2f} ms under the profiler, "
        f"{case['kernel_ms_per_step']:.2f} ms of kernels"
    )
    for title, rows in (("kernels", case["kernels"]), ("operators (self time)", case["operators"])):
        if rows:
            print(f"  {title}:")
        for r in rows:
            print(f"    {r['ms_per_step']:8.3f} ms {100 * r['share']:5.1f}% x{r['calls_per_step']:<7} {r['name']}")


def cases_of(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise SystemExit(f"--cases: use ROWSxCONTEXT[,ROWSxCONTEXT...], got {text!r}") from None
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise SystemExit(f"--cases: use ROWSxCONTEXT with both at least 1, got {text!r}")
    return pairs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="nf4", choices=("nf4", "fp8"))
    ap.add_argument("--cases", default="32x1024,256x20480", help="ROWSxCONTEXT, comma-separated")
    ap.add_argument("--attention", default="torch", choices=("torch", "triton"))
    ap.add_argument("--expert-kernel", default="dequantize", choices=("dequantize", "triton"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--ckpt", default="/tmp/v3-two-layers-decode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="JSON overrides of the shape (a small one for a CPU run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cases = cases_of(args.cases)
    if args.steps < 1:
        raise SystemExit(f"--steps: must be at least 1, got {args.steps}")
    if "triton" in (args.attention, args.expert_kernel) and not args.device.startswith("cuda"):
        from quant.fused_experts import interpreted

        if not interpreted():
            raise SystemExit("--attention/--expert-kernel triton: Triton needs --device cuda (or TRITON_INTERPRET=1)")
    shape = {**REAL_V3_TWO_LAYERS, **(json.loads(args.shape) if args.shape else {})}
    config = v3_config(shape, max(c for _, c in cases) + args.steps + 4)
    ckpt = write_checkpoint(Path(args.ckpt), config, args.device)
    model = decode_model(ckpt, args.plan, args.device)
    out = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "plan": args.plan,
        "shape": shape,
        "cases": [],
    }
    for rows, context in cases:
        out["cases"].append(
            profile_case(model, rows, context, args.attention, args.expert_kernel, args.steps, args.top)
        )
        print_case(out["cases"][-1])
        if args.json:
            atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
