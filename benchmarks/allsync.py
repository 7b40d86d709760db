"""All-sync (colocated) against disaggregated synchronous RL: same workers, same work.

    python benchmarks/allsync.py [--workers 2] [--steps 6] [--prompts-per-worker 16] [--base CHECKPOINT] [--json PATH]

Both layouts run the same config on the same number of Ray workers (one CPU core or one GPU each) for
the same steps, with the torch engine:
  colocated      every worker generates its share of the batch, then every worker trains (all-reduced
                 LoRA gradients): nobody waits for another phase.
  disaggregated  workers/2 generate the whole batch, workers/2 train on it, the adapter goes back to the
                 generators: each half idles while the other half works.
Dynamic sampling is off so every step holds exactly prompts x group_size samples in both layouts.
Reported: samples/s (after one warm-up step), per-worker utilization = busy / wall, and bytes per sync:
the adapter tensors actually moved, against the full merged weights a weight-sync engine would need,
for the benchmarked model and for DeepSeek-V3 671B (computed from its shapes, bf16).
Also measured: this machine's ceiling for that ratio. Disaggregated keeps workers/2 processes busy at a
time, colocated keeps all of them busy; if k concurrent single-threaded processes each run at speed s_k
(the same fixed torch work, timed alone and side by side), the ratio cannot exceed
    ceiling = (workers * s_workers) / (workers/2 * s_{workers/2}),
which is 2 where cores do not slow each other down (one GPU per worker) and less where they share caches,
memory bandwidth or a host's physical core.
Last line: `all-sync/disaggregated throughput: R.RRx` (goal >= 1.8x).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file, this folder would shadow the allsync package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from allsync.config import parse_config  # noqa: E402
from allsync.launch.disaggregated import DisaggregatedGroup
from allsync.launch.local import LocalGroup
from allsync.launch.ray_actors import RayGroup  # noqa: E402
from allsync.plan.shapes import DEEPSEEK_V3  # noqa: E402
from allsync.plan.weights import lora_values  # noqa: E402
from allsync.tasks import make_splits  # noqa: E402
from quant.layout import expected_tensors  # noqa: E402


def sync_sizes(config: dict, targets: list[str], rank: int, bytes_per_value: int = 2) -> dict[str, int]:
    """Bytes of one sync: adapter only (allsync.plan.weights.lora_values: r (in + out) per adapted weight), against every
    weight of the model."""
    full = sum(math.prod(spec.shape) for spec in expected_tensors(config).values())
    adapter = lora_values(config, rank, tuple(targets))
    return {"adapter_bytes": adapter * bytes_per_value, "merged_bytes": full * bytes_per_value}


def bench_config(base: str, workers: int, layout: str, prompts_per_worker: int = 16) -> dict:
    return {
        "model": {"base": base, "quant": {"routed_experts": "nf4"}},
        "lora": {"rank": 8, "alpha": 16},
        "rollout": {"prompts_per_step": prompts_per_worker * workers, "group_size": 8, "max_new_tokens": 12},
        "algorithm": {"dynamic_sampling": False},
        "optim": {"lr": 1e-4},
        "parallel": {"workers_per_node": workers, "layout": layout},
        "task": {"min_digits": 2, "max_digits": 2, "train_size": 4000, "heldout_size": 50},
    }


def run_layout(base: str, workers: int, layout: str, steps: int, prompts_per_worker: int) -> dict:
    config = parse_config(bench_config(base, workers, layout, prompts_per_worker))
    problems = make_splits(config.task.generator(), config.task.train_size, config.task.heldout_size).train
    colocated = RayGroup if workers > 1 else LocalGroup
    group = colocated(config, problems) if layout == "colocated" else DisaggregatedGroup(config, problems)
    try:
        group.step(0)  # warm-up: first-call costs out of the measurement
        per_step = []
        for step in tqdm(range(1, steps + 1), desc=layout, unit="step"):
            per_step.append(group.step(step))
    finally:
        group.shutdown()
    wall = sum(max(m["wall_seconds"] for m in workers_metrics) for workers_metrics in per_step)
    samples = sum(sum(w["samples_generated"] for w in m) for m in per_step)
    busy = [sum(m[i]["busy_seconds"] for m in per_step) for i in range(len(per_step[0]))]
    walls = [sum(m[i]["wall_seconds"] for m in per_step) for i in range(len(per_step[0]))]
    return {
        "layout": layout,
        "workers": len(busy),
        "steps": steps,
        "samples": samples,
        "seconds": round(wall, 2),
        "samples_per_second": samples / wall,
        "utilization": [round(b / w, 3) for b, w in zip(busy, walls)],
        "sync_bytes_per_step": sum(sum(w["sync_bytes"] for w in m) for m in per_step) / steps,
        "phases": [[{k: w.get(k, 0.0) for k in PHASES} for w in m] for m in per_step],
    }


PHASES = ("generate_seconds", "reward_seconds", "train_seconds", "sync_seconds")


def predicted_ratio(colocated_phases: list[list[dict]], ceiling: dict) -> float:
    """The all-sync/disaggregated ratio allsync.plan.schedules predicts from the colocated run's measured phases.

    Per step, worker i generated (and scored) for g_i seconds, trained for t_i and loaded the adapter for s_i. The
    disaggregated layout gives its W/2 generators and W/2 trainers twice a worker's share, at the speed of W/2 busy
    processes instead of W (ceiling: s_half / s_all faster each):
        gen' = sum g / (W/2) x s_all / s_half,  train' = sum t / (W/2) x s_all / s_half,  transfer = max s
    and compares schedules.disaggregated(gen', train', transfer) with schedules.all_sync(g, t, {sync: max s})."""
    from allsync.plan import schedules

    time_scale = ceiling["speed_all"] / ceiling["speed_half"]  # < 1: fewer busy processes run faster
    all_sync = disaggregated = 0.0
    for step in colocated_phases:
        gen = np.array([w["generate_seconds"] + w["reward_seconds"] for w in step])
        train = np.array([w["train_seconds"] for w in step])
        sync = max(w["sync_seconds"] for w in step)
        half = len(step) // 2
        all_sync += schedules.all_sync(gen, train, {"sync": sync}).seconds
        disaggregated += schedules.disaggregated(
            np.full(half, gen.sum() / half * time_scale), np.full(half, train.sum() / half * time_scale), sync
        ).seconds
    return disaggregated / all_sync


def _fixed_work(iterations: int, start, done) -> None:
    """Single-threaded forward + backward of a small MLP, the tiny model's scale (hidden 128, 256 tokens)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.SiLU(), torch.nn.Linear(512, 128))
    x = torch.randn(256, 128)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(iterations):
        net(x).square().mean().backward()
    done.put(time.perf_counter() - t0)


def per_process_speed(concurrent: int, iterations: int = 2000) -> float:
    """Iterations per second of one process while `concurrent` run the same work side by side (mean)."""
    ctx = multiprocessing.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_fixed_work, args=(iterations, start, done)) for _ in range(concurrent)]
    for proc in procs:
        proc.start()
    time.sleep(2.0)  # let every process import torch before the clock starts
    start.set()
    seconds = [done.get() for _ in procs]
    for proc in procs:
        proc.join()
    return iterations / (sum(seconds) / len(seconds))


def concurrency_ceiling(workers: int) -> dict[str, float]:
    """The best all-sync/disaggregated ratio this machine allows (see the module docstring)."""
    half, full = per_process_speed(workers // 2), per_process_speed(workers)
    return {"speed_half": half, "speed_all": full, "ceiling": (workers * full) / (workers // 2 * half)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="Ray workers in both layouts (even)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--prompts-per-worker", type=int, default=16, help="x 8 samples each, per step (the default run's size)"
    )
    parser.add_argument("--base", help="checkpoint (default: a fresh tiny DeepSeek-V3 from allsync.warm_start's spec)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        base = args.base
        if base is None:
            from allsync.warm_start import DEFAULT_SPEC
            from moe_lora.tiny import make_tiny

            base = str(make_tiny(Path(tmp) / "tiny", DEFAULT_SPEC))
        rows = [
            run_layout(base, args.workers, layout, args.steps, args.prompts_per_worker)
            for layout in ("colocated", "disaggregated")
        ]
        tiny_config = json.loads((Path(base) / "config.json").read_text())
    targets = parse_config(bench_config(base, args.workers, "colocated")).lora.targets
    sizes = {
        "benchmarked model (rank 8)": sync_sizes(tiny_config, targets, 8),
        "DeepSeek-V3 671B (rank 16, the 48xH100 plan)": sync_sizes(DEEPSEEK_V3, targets, 16),
    }
    ratio = rows[0]["samples_per_second"] / rows[1]["samples_per_second"]
    ceiling = concurrency_ceiling(args.workers)

    print(f"{'layout':<14} {'workers':>7} {'samples':>8} {'seconds':>8} {'samples/s':>10}  utilization per worker")
    for r in rows:
        print(
            f"{r['layout']:<14} {r['workers']:>7} {r['samples']:>8} {r['seconds']:>8.2f} {r['samples_per_second']:>10.1f}  "
            + " ".join(f"{u:.2f}" for u in r["utilization"])
        )
    print()
    print(f"{'bytes per sync (bf16)':<44} {'adapter only':>14} {'merged weights':>16} {'ratio':>8}")
    for name, s in sizes.items():
        print(
            f"{name:<44} {s['adapter_bytes']:>14,} {s['merged_bytes']:>16,} {s['merged_bytes'] / s['adapter_bytes']:>7.0f}x"
        )
    print(
        f"(measured: disaggregated moved {rows[1]['sync_bytes_per_step']:,.0f} adapter bytes (fp32) per step to its generators; "
        "colocated workers share the model with their engine and move none)"
    )
    print(
        f"this machine's ceiling: one process alone {ceiling['speed_half']:.0f} it/s with {args.workers // 2} busy, "
        f"{ceiling['speed_all']:.0f} it/s each with {args.workers} busy -> at most {ceiling['ceiling']:.2f}x; "
        f"measured {ratio:.2f}x = {ratio / ceiling['ceiling']:.0%} of it"
    )
    predicted = predicted_ratio(rows[0]["phases"], ceiling)
    print(
        f"the schedule model (allsync.plan.schedules) fed with the colocated run's measured phases predicts "
        f"{predicted:.2f}x; measured {ratio:.2f}x ({ratio / predicted:.0%} of the prediction)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"rows": rows, "sync_sizes": sizes, "ratio": ratio, "ceiling": ceiling, "predicted_ratio": predicted},
                indent=2,
            )
        )
    print(f"all-sync/disaggregated throughput: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
