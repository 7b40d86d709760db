"""What per-worker dynamic sampling costs against global filling, at 2 and 4 workers, and streamed rounds against
sequential ones.

    python -m benchmarks.sampling_fill [--steps 40] [--workers 2,4] [--fills worker,global]
                                       [--rounds sequential] [--out runs/sampling-fill]

The default job (recipes/configs/tiny_cpu.yaml, its warm-started base, the same 32 prompts x 8 samples per
step) run by recipes/dapo.py under Ray for --steps steps, for each worker count with algorithm.sampling_fill
worker (each worker fills its own quota; the step waits for the worker that needed the most rounds) and global
(the workers fill the batch together). Per run, from metrics.jsonl: mean generation rounds per step (the most
any worker ran), groups generated per step (all workers), median s/step (steps after the first) and the held-out
accuracy at the end; and the ratios worker / global. --rounds sequential,streamed runs each also with
algorithm.sampling_rounds streamed (the next round's rows queued behind the last's in the torch engine's slots; the
same batch a step) and reports decode fill (tokens over slot-steps), positions computed per trained token and rows
dropped per step beside them. Writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
DEFAULT_CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"


def run_config(default: dict, workers: int, fill: str, steps: int, out_dir: Path, rounds: str = "sequential") -> dict:
    config = json.loads(json.dumps(default))
    config["parallel"]["workers_per_node"] = workers
    config["algorithm"]["sampling_fill"] = fill
    config["algorithm"]["sampling_rounds"] = rounds
    config["run"].update(
        out_dir=str(out_dir), steps=steps, eval_every=steps, checkpoint_every=steps, time_limit_minutes=None
    )
    return config


def summarize(metrics_path: Path) -> dict:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "sampling_rounds" in r]
    accuracy = [r["heldout_accuracy"] for r in records if "heldout_accuracy" in r]
    return {
        "steps": len(steps),
        "rounds_per_step": statistics.mean(r["sampling_rounds"] for r in steps),
        "groups_generated_per_step": statistics.mean(r["groups_generated"] for r in steps),
        "seconds_per_step": statistics.median(r["step_seconds"] for r in steps[1:]),
        "decode_fill": statistics.mean(r["decode_fill"] for r in steps),
        "positions_per_trained_token": statistics.mean(r["positions_per_trained_token"] for r in steps),
        "dropped_per_step": statistics.mean(r.get("samples_dropped", 0) for r in steps),
        "heldout_base": accuracy[0],
        "heldout_end": accuracy[-1],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--fills", default="worker,global", help="algorithm.sampling_fill values")
    parser.add_argument("--rounds", default="sequential", help="algorithm.sampling_rounds values")
    parser.add_argument("--out", default="runs/sampling-fill")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    default = yaml.safe_load(DEFAULT_CONFIG.read_text())
    results: dict[str, dict] = {}
    fills, kinds = args.fills.split(","), args.rounds.split(",")
    for workers, fill, rounds in itertools.product([int(w) for w in args.workers.split(",")], fills, kinds):
        name = f"{workers} workers, {fill}" + (f", {rounds}" if rounds != "sequential" else "")
        tag = f"w{workers}-{fill}" + (f"-{rounds}" if rounds != "sequential" else "")
        run_dir = out / tag
        config_path = out / f"{tag}.yaml"
        config_path.write_text(yaml.safe_dump(run_config(default, workers, fill, args.steps, run_dir, rounds)))
        print(f"{name}: {args.steps} steps ...", flush=True)
        with open(out / f"{tag}.log", "w") as log:
            done = subprocess.run(
                [sys.executable, str(ROOT / "recipes" / "dapo.py"), "--config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        if done.returncode != 0:
            raise SystemExit(f"{name}: recipes/dapo.py exited with {done.returncode}; see {out / f'{tag}.log'}")
        results[name] = summarize(run_dir / "metrics.jsonl")
        (out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    header = f"{'run':<34} {'rounds/step':>11} {'groups/step':>11} {'fill':>5} {'pos/token':>9} {'dropped':>7}"
    print(f"\n{header} {'s/step':>7} {'held-out base -> end':>22}")
    for name, r in results.items():
        print(
            f"{name:<34} {r['rounds_per_step']:>11.2f} {r['groups_generated_per_step']:>11.1f} "
            f"{r['decode_fill']:>5.2f} {r['positions_per_trained_token']:>9.2f} {r['dropped_per_step']:>7.1f} "
            f"{r['seconds_per_step']:>7.2f} {100 * r['heldout_base']:>10.1f}% -> {100 * r['heldout_end']:.1f}%"
        )
    for workers in [int(w) for w in args.workers.split(",")]:
        if {"worker", "global"} <= set(fills):
            per, glob = results[f"{workers} workers, worker"], results[f"{workers} workers, global"]
            print(
                f"{workers} workers: per-worker filling runs {per['rounds_per_step'] / glob['rounds_per_step']:.2f}x "
                f"the rounds, {per['groups_generated_per_step'] / glob['groups_generated_per_step']:.2f}x the groups "
                f"and {per['seconds_per_step'] / glob['seconds_per_step']:.2f}x the s/step of global filling"
            )
        for fill in fills if "streamed" in kinds and "sequential" in kinds else []:
            seq, streamed = results[f"{workers} workers, {fill}"], results[f"{workers} workers, {fill}, streamed"]
            print(
                f"{workers} workers, {fill}: decode fill {seq['decode_fill']:.3f} -> {streamed['decode_fill']:.3f}, "
                f"{streamed['seconds_per_step'] / seq['seconds_per_step']:.2f}x the s/step of sequential rounds"
            )
    return results


if __name__ == "__main__":
    main()
