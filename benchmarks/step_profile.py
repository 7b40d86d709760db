"""Where the default RL step's time goes, phase by phase, against what this machine's matmuls can do.

    python -m benchmarks.step_profile [--steps 50] [--warmup 5] [--baseline REV] [--rounds 2] [--out FILE.json]

One in-process worker doing what each of the default run's two workers does (recipes/configs/tiny_cpu.yaml:
its share of the batch, 32 prompts x 4 samples, dynamic sampling on, one compute thread), on the warm-started
base at runs/tiny-base (built if missing). After `--warmup` steps it times `--steps` steps per phase:

    generate   the engine's prefill and decode (dynamic-sampling rounds included), reward scoring excluded
    reward     scoring the responses in the reward processes (and the reward shaping)
    train      every forward and backward of the update (the logprob passes included)
    optimizer  gradient norm, clipping and AdamW
    sync       handing the new adapter to the engine

It then runs the same steps again from the same seed (the same computation) under torch's FlopCounterMode and
divides each phase's matmul FLOPs by its time: achieved FLOP/s, against this machine's own dense matmul
FLOP/s at the same dtype and thread count (the best of square matmuls of 256-1024; the physical limit here).

--baseline REV: the same profile of another git revision (a temporary worktree, its own tiny_cpu.yaml), run in
turn with this tree's `--rounds` times (baseline, this, baseline, this, ...) so the machine's drift hits both;
prints the medians side by side and this tree's speed-up (baseline s/step / this s/step). Then the default run
itself, as the README starts it (`python recipes/dapo.py`: two Ray workers), for `--launch-steps` steps in each
tree, in turn `--rounds` times: the median step_seconds of its metrics.jsonl (after the first 5 steps) and the
speed-up. The last line:

    step profile: X s/step, generate Y%, train Z% of the step; achieved W% of this machine's measured matmul FLOP/s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "reward", "train", "optimizer", "sync")


def matmul_flops_per_second(dtype, threads: int, sizes=(256, 512, 1024), repeats: int = 20) -> float:
    """The best FLOP/s of square [n, n] @ [n, n] matmuls in `dtype` at `threads` threads (2 n^3 FLOPs each)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            a @ b
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
    torch.set_num_threads(before)
    return best


class PhaseMeter:
    """Wraps a worker's methods to add each phase's seconds (and, with a FlopCounterMode given, its FLOPs)."""

    def __init__(self, worker, counter=None):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.flops = dict.fromkeys(PHASES, 0)
        self.counter = counter
        learner = worker.learner
        self._wrap(worker.scorer, "rewards", "reward")  # the producers call it through scorer.score_episodes
        self._wrap(worker.engine, "generate", "generate")
        self._wrap(learner, "backward", "train")
        self._wrap(learner.passes, "current_logprobs", "train")
        self._wrap(learner.passes, "reference_logprobs", "train")
        self._wrap(worker.policy.optimizer, "step", "optimizer")
        self._wrap(learner, "total_grad_norm", "optimizer")
        self._wrap(worker.engine, "load_adapter", "sync")

    def _wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)
        meter = self

        def timed(*args, **kwargs):
            flops_before = meter.counter.get_total_flops() if meter.counter is not None else 0
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                meter.seconds[phase] += time.perf_counter() - start
                if meter.counter is not None:
                    meter.flops[phase] += meter.counter.get_total_flops() - flops_before

        setattr(owner, name, timed)


def profile(steps: int, warmup: int, base: str) -> dict:
    """The profile of the allsync importable here (this tree, or a baseline worktree on sys.path)."""
    import torch
    import yaml
    from torch.utils.flop_counter import FlopCounterMode

    import allsync
    from allsync.config import parse_config
    from allsync.run.worker import RLWorker

    tree = Path(allsync.__file__).resolve().parents[1]
    raw = yaml.safe_load((tree / "recipes" / "configs" / "tiny_cpu.yaml").read_text())
    workers = raw["parallel"]["workers_per_node"]
    raw["parallel"]["workers_per_node"] = 1
    raw["rollout"]["prompts_per_step"] //= workers  # one worker's share of the default run
    raw["model"]["base"] = base
    raw["run"].update(max_restarts=0, step_timeout=None)
    config = parse_config(raw)
    from allsync.warm_start import settings_for_run, warm_start

    warm_start(config.model.base, settings_for_run(config))
    problems = config.task.splits()[0].train

    def run(counter=None):
        worker = RLWorker(config, problems, threads=1)
        for step in range(warmup):
            worker.step(step)
        meter = PhaseMeter(worker, counter)
        start, rounds = time.perf_counter(), 0
        for step in range(warmup, warmup + steps):
            rounds += worker.step(step)["sampling_rounds"]
        wall = time.perf_counter() - start
        worker.shutdown()
        return meter, wall, rounds

    timed, wall, rounds = run()
    with FlopCounterMode(display=False) as counter:
        counted, _, _ = run(counter)
    peak = matmul_flops_per_second(getattr(torch, config.model.compute_dtype), threads=1)
    phases = {
        p: {
            "seconds_per_step": timed.seconds[p] / steps,
            "share": timed.seconds[p] / wall,
            "flop_per_step": counted.flops[p] / steps,
            "flops_per_second": counted.flops[p] / timed.seconds[p] if timed.seconds[p] else 0.0,
        }
        for p in PHASES
    }
    total_flops = sum(counted.flops.values())
    return {
        "tree": str(tree),
        "steps": steps,
        "warmup": warmup,
        "seconds_per_step": wall / steps,
        "sampling_rounds_per_step": rounds / steps,
        "phases": phases,
        "matmul_peak_flops_per_second": peak,
        "achieved_flops_per_second": total_flops / wall,
        "achieved_share_of_peak": total_flops / wall / peak,
        "torch": torch.__version__,
        "threads": 1,
        "dtype": config.model.compute_dtype,
    }


def print_profile(p: dict, label: str = "") -> None:
    print(
        f"{label}{p['seconds_per_step']:.3f} s/step over {p['steps']} steps ({p['sampling_rounds_per_step']:.2f} sampling rounds "
        f"per step); matmul peak {p['matmul_peak_flops_per_second'] / 1e9:.1f} GFLOP/s ({p['dtype']}, {p['threads']} thread)"
    )
    print(f"  {'phase':<10} {'s/step':>8} {'share':>7} {'GFLOP/step':>11} {'GFLOP/s':>8} {'of peak':>8}")
    for name, ph in p["phases"].items():
        print(
            f"  {name:<10} {ph['seconds_per_step']:>8.4f} {ph['share']:>7.1%} {ph['flop_per_step'] / 1e9:>11.3f} "
            f"{ph['flops_per_second'] / 1e9:>8.1f} {ph['flops_per_second'] / p['matmul_peak_flops_per_second']:>8.1%}"
        )


def last_line(p: dict) -> str:
    ph = p["phases"]
    return (
        f"step profile: {p['seconds_per_step']:.3f} s/step, generate {ph['generate']['share']:.0%}, train "
        f"{ph['train']['share'] + ph['optimizer']['share']:.0%} of the step; achieved {p['achieved_share_of_peak']:.1%} "
        "of this machine's measured matmul FLOP/s"
    )


def profile_in_subprocess(tree: Path, steps: int, warmup: int, base: str) -> dict:
    """This script's `--child` profile with `tree` first on sys.path (its allsync, quant, moe_lora, evals)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        args = ["--child", "--steps", str(steps), "--warmup", str(warmup), "--base", base, "--out", out.name]
        # run_path, not `python FILE`: that would put benchmarks/ first on sys.path, where benchmarks/allsync.py
        # would hide the allsync package
        run = f"import runpy, sys; sys.argv = {[__file__, *args]!r}; runpy.run_path({__file__!r}, run_name='__main__')"
        subprocess.run([sys.executable, "-c", run], cwd=tree, env=env, check=True)
        return json.loads(Path(out.name).read_text())


def launch_step_seconds(tree: Path, steps: int, base: str) -> float:
    """The median step_seconds (steps 6..) of the default run started in `tree` as the README does, for `steps` steps."""
    (tree / "runs").mkdir(exist_ok=True)
    if not (tree / "runs" / "tiny-base").exists():  # the default config's model.base, built once and shared
        (tree / "runs" / "tiny-base").symlink_to(base, target_is_directory=True)
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run(
            [sys.executable, "recipes/dapo.py", "--steps", str(steps), "--out-dir", f"{out}/run"],
            cwd=tree,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        rows = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_seconds"] for r in rows if "step_seconds" in r and r["step"] > 5)


def compare(baseline_rev: str, rounds: int, steps: int, warmup: int, base: str, launch_steps: int) -> dict:
    """The profile and the default launch of `baseline_rev` and of this tree, in turn, `rounds` times each;
    medians and the speed-ups."""
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), baseline_rev],
            check=True,
            capture_output=True,
        )
        try:
            runs = {"baseline": [], "this": []}
            for r in range(rounds):
                for name, tree in (("baseline", worktree), ("this", ROOT)):
                    print(f"round {r + 1}/{rounds}: {name} ({tree})", flush=True)
                    runs[name].append(profile_in_subprocess(tree, steps, warmup, base))
            launches = {"baseline": [], "this": []}
            for r in range(rounds if launch_steps else 0):
                for name, tree in (("baseline", worktree), ("this", ROOT)):
                    print(f"round {r + 1}/{rounds}: the default run of {name}, {launch_steps} steps", flush=True)
                    launches[name].append(launch_step_seconds(tree, launch_steps, base))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    median = {
        name: min(rs, key=lambda p: abs(p["seconds_per_step"] - statistics.median(x["seconds_per_step"] for x in rs)))
        for name, rs in runs.items()
    }
    speedup = median["baseline"]["seconds_per_step"] / median["this"]["seconds_per_step"]
    launch = {name: statistics.median(v) for name, v in launches.items() if v}
    return {
        "baseline_rev": baseline_rev,
        "runs": runs,
        "median": median,
        "speedup": speedup,
        "launch_runs": launches,
        "launch_seconds_per_step": launch,
        "launch_speedup": launch["baseline"] / launch["this"] if launch else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--base", default=str(ROOT / "runs" / "tiny-base"), help="the warm-started base (built if missing)"
    )
    parser.add_argument("--baseline", metavar="REV", help="also profile this git revision, in turn with this tree")
    parser.add_argument("--rounds", type=int, default=2, help="with --baseline: runs of each")
    parser.add_argument(
        "--launch-steps", type=int, default=60, help="with --baseline: steps of each default run (0: none)"
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    base = str(Path(args.base).resolve())
    if args.child:
        result = profile(args.steps, args.warmup, base)
    elif args.baseline:
        result = compare(args.baseline, args.rounds, args.steps, args.warmup, base, args.launch_steps)
        for name in ("baseline", "this"):
            print_profile(result["median"][name], f"{name} ({args.baseline if name == 'baseline' else 'this tree'}): ")
        b, t = result["median"]["baseline"], result["median"]["this"]
        print(
            f"speed-up: {result['speedup']:.2f}x per step ({b['seconds_per_step']:.3f} -> {t['seconds_per_step']:.3f} s); "
            f"achieved share of the matmul peak {b['achieved_share_of_peak']:.1%} -> {t['achieved_share_of_peak']:.1%}"
        )
        if result["launch_speedup"] is not None:
            lb, lt = result["launch_seconds_per_step"]["baseline"], result["launch_seconds_per_step"]["this"]
            print(
                f"the default run (python recipes/dapo.py, 2 Ray workers): {lb:.3f} -> {lt:.3f} s/step (median), "
                f"speed-up {result['launch_speedup']:.2f}x"
            )
        print(last_line(t))
    else:
        result = profile(args.steps, args.warmup, base)
        print_profile(result)
        print(last_line(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
