"""Expert parallelism in the RL loop, on CPU: what each rank holds, reads and sends, and what it costs in time.

    python benchmarks/expert_parallel.py [--experts 16] [--steps 6] [--json PATH]

Runs the DAPO loop (torch engine, dynamic sampling off, so every step holds the same samples) on a tiny
DeepSeek-V3 with NF4 routed experts through Ray workers, at expert_parallel 1, 2 and 4:
  - resident bytes per rank of the routed experts, their LoRA tensors and AdamW's state for them, against
    1/k of EP=1's (goal: within 5%);
  - checkpoint bytes each rank reads at load (the routed experts' share, and everything else);
  - all-to-all traffic per step: the rows a rank sends to other ranks (tokens out, outputs back, their
    gradients; a row per (token, rank holding one of its experts)) against routed assignments, with the fraction
    a row per (token, expert) would send ((k-1)/k under uniform routing), and at EP 4 over two nodes of two
    (parallel.nodes 2) the bytes that cross nodes;
  - step time at EP=2 against replicated experts (EP=1), both with 2 processes (goal <= 1.3x).
EP=4 runs 4 processes (on one node, then on two). Last line: `EP=2 step time / replicated: R.RRx (goal <= 1.3x)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file, this folder would shadow the allsync package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from allsync.config import parse_config  # noqa: E402
from allsync.launch.ray_actors import RayGroup  # noqa: E402
from allsync.tasks import ArithmeticGenerator, make_splits  # noqa: E402
from moe_lora.tiny import TinySpec, make_tiny  # noqa: E402


def run(base: Path, workers: int, expert_parallel: int, steps: int, seed: int = 0, nodes: int = 1) -> dict:
    config = parse_config(
        {
            "model": {"base": str(base), "compute_dtype": "float32", "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 8, "alpha": 16},
            "rollout": {"prompts_per_step": 4 * workers, "group_size": 4, "max_new_tokens": 16},
            "algorithm": {"dynamic_sampling": False},
            "optim": {"lr": 1e-3},
            "parallel": {"nodes": nodes, "workers_per_node": workers // nodes, "expert_parallel": expert_parallel},
            "run": {"seed": seed},
        }
    )
    problems = make_splits(ArithmeticGenerator(2, 2), 2000, 20, 0).train
    group = RayGroup(config, problems)
    try:
        metrics = [group.step(s) for s in range(1, steps + 1)]
        memory, loaded = group.call("expert_memory"), group.call("loaded_bytes")
    finally:
        group.shutdown()
        import ray

        ray.shutdown()  # the next run may need more CPUs than this cluster was started with
    steady = metrics[1:]  # the first step warms caches up
    return {
        "workers": workers,
        "nodes": nodes,
        "expert_parallel": expert_parallel,
        "step_seconds": statistics.median(max(m["wall_seconds"] for m in step) for step in steady),
        "memory": memory,
        "loaded": loaded,
        "alltoall_bytes": [
            statistics.mean(step[r].get("alltoall_bytes", 0) for step in steady) for r in range(workers)
        ],
        "forward_rows": [
            statistics.mean(step[r].get("alltoall_forward_rows", 0) for step in steady) for r in range(workers)
        ],
        "backward_rows": [
            statistics.mean(step[r].get("alltoall_backward_rows", 0) for step in steady) for r in range(workers)
        ],
        "assignments": [
            statistics.mean(step[r].get("routed_assignments", 0) for step in steady) for r in range(workers)
        ],
        "bytes_across_nodes": [
            statistics.mean(step[r].get("alltoall_bytes_across_nodes", 0) for step in steady) for r in range(workers)
        ],
    }


def report(results: list[dict], hidden: int) -> list[str]:
    one = results[0]
    per_rank_one = sum(one["memory"][0].values())
    lines = [
        "| EP | processes | routed experts + LoRA + AdamW per rank (bytes) | vs 1/k of EP=1 | checkpoint bytes read per rank (experts / all) | step s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results[:3]:
        held = [sum(m.values()) for m in r["memory"]]
        ideal = per_rank_one / r["expert_parallel"]
        worst = max(abs(h - ideal) / ideal for h in held)
        read = ", ".join(f"{x['expert_bytes']:,} / {x['bytes']:,}" for x in r["loaded"][: min(2, len(r["loaded"]))])
        lines.append(
            f"| {r['expert_parallel']} | {r['workers']} | {max(held):,} | {100 * worst:+.1f}% worst rank | {read} | "
            f"{r['step_seconds']:.2f} |"
        )
    lines.append("")
    lines.append(
        "| EP | nodes | routed assignments / step (rank 0, all forward passes) | forward rows sent to other ranks "
        "| / (2 x assignments) | a row per (token, expert): (k-1)/k | backward rows | bytes sent | of them to other nodes |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in results[1:]:
        k, a, fwd, bwd = r["expert_parallel"], r["assignments"][0], r["forward_rows"][0], r["backward_rows"][0]
        sent, far = r["alltoall_bytes"][0], r["bytes_across_nodes"][0]
        lines.append(
            f"| {k} | {r['nodes']} | {a:,.0f} | {fwd:,.0f} | {fwd / max(2 * a, 1):.2f} | {(k - 1) / k:.2f} | {bwd:,.0f} "
            f"| {sent:,.0f} | {far:,.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    spec = TinySpec(experts=args.experts, experts_per_token=2, layers=3, dense_layers=1, n_group=1, topk_group=1)
    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny(Path(tmp) / "tiny", spec)
        results = [run(base, 2, 1, args.steps), run(base, 2, 2, args.steps), run(base, 4, 4, args.steps)]
        results.append(run(base, 4, 4, args.steps, nodes=2))  # EP 4 over two nodes of two: rail then node
    print("\n".join(report(results, spec.hidden_size)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"EP=2 step time / replicated: {results[1]['step_seconds'] / results[0]['step_seconds']:.2f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
