"""Activation memory and time of the update with and without a token budget and activation checkpointing.

    python -m benchmarks.update_memory [--steps 6] [--budget 1024] [--out BENCHMARKS-update-memory.json]

One in-process worker per setting, all built from recipes/configs/tiny_cpu.yaml (one worker holding the whole
batch, the warm-started base at model.base, built if missing) with the same seed, stepped in turn (step 1 of
each, then step 2 of each, ...) so that the machine's drift hits every setting alike. Settings: off,
optim.max_tokens_per_forward = BUDGET, optim.activation_checkpointing, both. Per setting it prints the median
update time (train_seconds of each step after the first: the logprob passes plus every forward+backward) and
the peak bytes autograd saved for one backward (distinct storages of the largest micro-batch's forward: the
activation memory the update needs at once; on a GPU also torch.cuda.max_memory_allocated), and the ratios
against off.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).parents[1]
DEFAULT_CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"


class SavedBytes:
    """Wraps a Learner's micro-batch backward and keeps the most bytes autograd saved during one of them."""

    def __init__(self, learner):
        self.peak, self.backward = 0, learner.backward
        learner.backward = self

    def __call__(self, *args):
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.backward(*args)
        self.peak = max(self.peak, sum(storages.values()))


def settings(budget: int) -> dict[str, dict]:
    return {
        "off": {},
        f"budget {budget}": {"max_tokens_per_forward": budget},
        "checkpointing": {"activation_checkpointing": True},
        f"budget {budget} + checkpointing": {"max_tokens_per_forward": budget, "activation_checkpointing": True},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    from allsync.config import parse_config
    from allsync.tasks import Problem
    from allsync.warm_start import settings_for_run, warm_start
    from allsync.run.worker import RLWorker

    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["parallel"]["workers_per_node"] = 1
    raw["run"].update(max_restarts=0, step_timeout=None)
    base_config = parse_config(raw)
    warm_start(base_config.model.base, settings_for_run(base_config))
    problems: list[Problem] = base_config.task.splits()[0].train
    workers, meters, times = {}, {}, {}
    for name, optim in settings(args.budget).items():
        config = parse_config({**raw, "optim": {**raw["optim"], **optim}})
        workers[name] = RLWorker(config, problems)
        meters[name], times[name] = SavedBytes(workers[name].learner), []
    cuda_peaks: dict[str, int] = {}
    for step in range(1, args.steps + 1):
        for name, worker in workers.items():
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            metrics = worker.step(step)
            if torch.cuda.is_available():
                cuda_peaks[name] = max(cuda_peaks.get(name, 0), torch.cuda.max_memory_allocated())
            if step > 1:
                times[name].append(metrics["train_seconds"])
            print(
                f"step {step} {name}: update {metrics['train_seconds']:.3f} s, trained tokens {metrics['trained_tokens']}",
                flush=True,
            )
    results = {
        name: {
            "update_seconds_median": statistics.median(times[name]),
            "peak_saved_bytes": meters[name].peak,
            **({"cuda_max_memory_allocated": cuda_peaks[name]} if cuda_peaks else {}),
        }
        for name in workers
    }
    off = results["off"]
    print(f"\n{'setting':<32} {'update s':>9} {'x off':>6} {'saved MiB':>10} {'x off':>6}")
    for name, r in results.items():
        r["time_ratio"] = r["update_seconds_median"] / off["update_seconds_median"]
        r["saved_ratio"] = r["peak_saved_bytes"] / off["peak_saved_bytes"]
        print(
            f"{name:<32} {r['update_seconds_median']:>9.3f} {r['time_ratio']:>6.2f} {r['peak_saved_bytes'] / 2**20:>10.2f} {r['saved_ratio']:>6.3f}"
        )
    for worker in workers.values():
        worker.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
