"""Memory of the streaming loader: a >= 300 MB DeepSeek-V3-layout checkpoint loaded into NF4.

    python benchmarks/load_quantized.py [--cache runs/bench-ckpt] [--json PATH]

For a bf16 and an FP8 checkpoint of the same model, a fresh process loads it with routed experts,
shared experts, attention and dense MLP in nf4 and reports (all process RSS, from /proc and getrusage):
  base   RSS after imports, before loading
  peak   maximum RSS during the load (ru_maxrss)
  final  RSS once loading is done
  shard  size of the largest shard file
Goal: peak - base <= 1.1 * ((final - base) + shard): the loader holds the finished model plus at most
about one shard (memory-mapped) at a time, never the whole checkpoint in bf16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
# ~330 MB in bf16: hidden 1024, 4 layers (1 dense), 32 experts of 512 -> 3 x 50M expert params.
BENCH_SPEC = dict(
    layers=4,
    dense_layers=1,
    experts=32,
    experts_per_token=8,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    heads=8,
    q_lora_rank=256,
    n_group=4,
    topk_group=2,
    shards=4,
)


def ensure_checkpoint(path: Path, fp8: bool) -> Path:
    from moe_lora.tiny import TinySpec, make_tiny

    if not (path / "config.json").exists():
        make_tiny(path, TinySpec(**BENCH_SPEC, fp8=fp8), overwrite=True)
    return path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def measure_in_this_process(checkpoint: str) -> dict:
    """Runs in the child: load into nf4 and report RSS figures."""
    import resource

    import torch  # noqa: F401  (imports count in the base, not in the load)
    import transformers  # noqa: F401

    from quant.formats import _bnb_functional
    from quant.loader import QuantPlan, byte_report, load_frozen_model

    _bnb_functional()
    base = _rss_bytes()
    t0 = time.perf_counter()
    model = load_frozen_model(checkpoint, QuantPlan.uniform("nf4"), progress=False)
    seconds = time.perf_counter() - t0
    final = _rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "base": base,
        "peak": peak,
        "final": final,
        "seconds": seconds,
        "model_bytes": sum(r.bytes for r in byte_report(model)),
    }


def run_case(checkpoint: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(checkpoint)], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    shards = sorted(checkpoint.glob("*.safetensors"))
    result["largest_shard"] = max(p.stat().st_size for p in shards)
    result["checkpoint_bytes"] = sum(p.stat().st_size for p in shards)
    result["bound"] = 1.1 * (result["final"] - result["base"] + result["largest_shard"])
    result["ok"] = result["peak"] - result["base"] <= result["bound"]
    return result


def format_table(rows: dict[str, dict]) -> str:
    head = f"{'checkpoint':<12}{'on disk':>10}{'largest shard':>15}{'model nf4':>11}{'base':>8}{'peak':>8}{'final':>8}{'peak-base':>11}{'bound':>8}{'seconds':>9}  goal"
    lines = [head]
    for name, r in rows.items():
        lines.append(
            f"{name:<12}{r['checkpoint_bytes'] / MIB:>9.0f}M{r['largest_shard'] / MIB:>14.0f}M{r['model_bytes'] / MIB:>10.0f}M"
            f"{r['base'] / MIB:>7.0f}M{r['peak'] / MIB:>7.0f}M{r['final'] / MIB:>7.0f}M{(r['peak'] - r['base']) / MIB:>10.0f}M"
            f"{r['bound'] / MIB:>7.0f}M{r['seconds']:>9.1f}  {'met' if r['ok'] else 'MISSED'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default="runs/bench-ckpt", help="where the benchmark checkpoints are built once")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_in_this_process(args.child)))
        return
    cache = Path(args.cache)
    rows = {fmt: run_case(ensure_checkpoint(cache / fmt, fp8=(fmt == "fp8"))) for fmt in ("bf16", "fp8")}
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
