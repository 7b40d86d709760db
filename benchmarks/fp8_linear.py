"""DeepSeek-V3's FP8 linears in a decode step: dequantize-then-multiply (what the engine does) against an FP8 GEMM
with block scales read as stored (issue 48; a GPU with FP8 tensor cores only).

    python -m benchmarks.fp8_linear [--rows 32,256] [--repeats 20] [--json out.json]

The fixed-shape decode step dequantizes every quantized weight to bf16 at every step (quant.formats.frozen_linear:
the FP8 bytes read, a bf16 copy written, scaled in place, read by the matmul: about 9 bytes a parameter), which at 48
H100 and EP 16 is about 60 GB a step for the FP8 attention, shared experts and dense MLP alone. An FP8 GEMM with
DeepSeek's 128 x 128 weight scales (torch.nn.functional.scaled_mm, ScalingType.BlockWise128x128) reads each weight
byte once; the rows are quantized per 1 x 128 block (ScalingType.BlockWise1x128, scales outer-dimension-major, rows
padded to a multiple of 4), which changes the engine's numbers: the relative error against the bf16 product is
reported beside the times. For each of V3's FP8 linears (out x in) and R rows: the median of --repeats timed calls
(CUDA events) of

    dequantize   F.linear(x, fp8_block_dequantize(W, s, dtype=bf16))
    scaled_mm    quantize x per 1 x 128, then F.scaled_mm(x8, W.t(), a, BlockWise1x128, s.t(), BlockWise128x128)

and the roofline of reading W once (N K bytes over the copy bandwidth measured in the same run). A case the GPU's
torch cannot run is reported with its error, not dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.engine_decode import ints
from quant.checkpoint_io import atomic_write_text
from quant.formats import fp8_block_dequantize, fp8_block_quantize, scaled_mm_fp8_blocks

# DeepSeek-V3's FP8 linears a decode step runs on every GPU (out, in): q_a, q_b, o_proj, the dense MLP's gate and up
# (one), its down, the shared expert's gate and up (one), its down. kv_a_proj_with_mqa (576 out) is not whole blocks.
V3_LINEARS = {
    "q_a_proj": (1536, 7168),
    "q_b_proj": (24576, 1536),
    "o_proj": (7168, 16384),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
}


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after two to warm up (CUDA events)."""
    for _ in range(2):
        fn()
    spans = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        spans.append(start.elapsed_time(end) / 1000)
    return statistics.median(spans)


def copy_bandwidth(nbytes: int = 2**31) -> float:
    """Bytes per second of a device copy (2 n / t, the best of 5)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    best = min(timed(lambda: target.copy_(source), 1) for _ in range(5))
    return 2 * nbytes / best


def measure(name: str, shape: tuple[int, int], rows: int, repeats: int, bandwidth: float) -> dict:
    out_dim, in_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(out_dim, in_dim, device="cuda", generator=gen) * 0.02
    q, scale_inv = fp8_block_quantize(w)
    x = torch.randn(rows, in_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    reference = F.linear(x.float(), fp8_block_dequantize(q, scale_inv, dtype=torch.float32))
    case = {"linear": name, "out": out_dim, "in": in_dim, "rows": rows}
    case["roofline_ms"] = round(1000 * out_dim * in_dim / bandwidth, 4)
    modes = {
        "dequantize": lambda: F.linear(x, fp8_block_dequantize(q, scale_inv, dtype=torch.bfloat16)),
        "scaled_mm": lambda: scaled_mm_fp8_blocks(x, q, scale_inv),
    }
    for mode, fn in modes.items():
        try:
            got = fn().float()
            case[f"{mode}_ms"] = round(1000 * timed(fn, repeats), 4)
            case[f"{mode}_error"] = float((got - reference).norm() / reference.norm())
        except Exception as e:  # noqa: BLE001 - reported: what this GPU's torch cannot run is a result
            case[f"{mode}_error_message"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
    return case


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,256")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = ints(args.rows, "--rows")
    if args.repeats < 1:
        raise SystemExit(f"--repeats: must be at least 1, got {args.repeats}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("benchmarks.fp8_linear: needs a GPU with FP8 tensor cores (compute capability 8.9 or later)")
    if not hasattr(F, "scaled_mm"):
        raise SystemExit(f"benchmarks.fp8_linear: torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    bandwidth = copy_bandwidth()
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "cases": [],
    }
    for r in rows:
        for name, shape in V3_LINEARS.items():
            case = measure(name, shape, r, args.repeats, bandwidth)
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
            if args.json:
                atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
