"""Fault drills on a live run: does the health detector name the faulty worker, how fast, and how often wrongly?

    python -m benchmarks.faults [--episodes 120] [--episode-steps 6] [--out runs/faults] [--score-only]
                                [--eval-every N] [--checkpoint-every N]

One run of the default tiny job (recipes/configs/tiny_cpu.yaml) with 4 Ray workers, cut into episodes of
`episode-steps` RL steps after a warm-up. Half the episodes (seeded, shuffled) inject one fault into one random
worker from the episode's second step (health.faults, allsync/health/faults.py), cycling through the kinds below; the
others run clean. The run logs every worker's report (workers.jsonl); both detectors then replay it
(allsync/health/detector.py: the Minder-style similarity detector the run used online, and the per-metric threshold
baseline). Scoring, per episode:
- injected: a true positive when an alarm names the faulty worker from the fault's first step to the episode's
  end; latency = alarm step - first faulty step + 1 (steps) and the wall time from that step's start to the
  alarm (seconds). An alarm naming another worker is a false positive.
- clean: every alarm is a false positive; false alarms per hour of clean running.
At scale (`--scale 64 256 1024`, after the live numbers and kept apart from them): recorded traces of N
simulated workers, each step's reports drawn from the live run's workers at a clean step (so the noise, shared
and per worker, is the live run's), with the live injected episodes' faulty-worker patterns (its values over
the median of the others, step by step) laid onto one random simulated worker.
The last line is `live injections: precision P recall R F1 F latency S steps (baseline F1 B)`.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "dapo.py"
DEFAULT = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
WORKERS = 4
WARMUP_STEPS = 6
# kind -> the fault's settings (allsync.health.faults.Fault): severities a real fleet sees (a device at half speed, a
# 10 s stall, a gradient group 1 s late, 128 MiB leaked per step, NaN gradients)
KINDS = {
    "slow": {"factor": 2.0, "steps": 3},
    "hog": {"steps": 3},
    "hang": {"seconds": 10.0, "steps": 1},
    "delay": {"seconds": 1.0, "steps": 3},
    "nan": {"steps": 1},
    "leak": {"mb": 128.0, "steps": 3},
}


@dataclass
class Episode:
    first: int  # first step
    last: int
    fault: dict | None  # the health.faults entry, None for a clean episode


def plan(episodes: int, episode_steps: int, seed: int) -> list[Episode]:
    """Half injected (kinds cycling, random rank), half clean, shuffled; episodes follow the warm-up."""
    rng = random.Random(seed)
    injected = episodes // 2
    kinds = [list(KINDS)[i % len(KINDS)] for i in range(injected)]
    labels = kinds + [None] * (episodes - injected)
    rng.shuffle(labels)
    out = []
    for i, kind in enumerate(labels):
        first = WARMUP_STEPS + 1 + i * episode_steps
        fault = (
            None if kind is None else {"kind": kind, "rank": rng.randrange(WORKERS), "step": first + 1, **KINDS[kind]}
        )
        out.append(Episode(first, first + episode_steps - 1, fault))
    return out


def run_config(
    base: dict, out: Path, episodes: list[Episode], eval_every: int = 10**6, checkpoint_every: int = 10**6
) -> dict:
    """The drill run's config; evaluations and checkpoints only at the end unless given (they run between steps,
    and the detector must not mistake the step after one for a fault)."""
    config = json.loads(json.dumps(base))
    config["parallel"]["workers_per_node"] = WORKERS
    config["run"].update(
        out_dir=str(out),
        steps=episodes[-1].last,
        eval_every=eval_every,
        eval_samples=1,
        checkpoint_every=checkpoint_every,
        max_consecutive_nan=10,
    )
    config["run"].pop("time_limit_minutes", None)
    config["health"] = {"faults": [e.fault for e in episodes if e.fault is not None]}
    return config


def score(alarms: list, episodes: list[Episode], times: dict[int, float]) -> dict:
    """Precision, recall, F1, latency (steps, seconds) and false alarms per clean hour over the episodes."""
    tp = fp = fp_clean = 0
    latencies, seconds, clean_seconds = [], [], 0.0
    per_kind: dict[str, list[int]] = {}
    for e in episodes:
        mine = [a for a in alarms if e.first <= a.step <= e.last]
        if e.fault is None:
            fp += len(mine)
            fp_clean += len(mine)
            clean_seconds += times[e.last] - times[e.first - 1]
            continue
        start = e.fault["step"]
        hits = [a for a in mine if a.rank == e.fault["rank"] and a.step >= start]
        fp += sum(1 for a in mine if a.rank != e.fault["rank"])
        per_kind.setdefault(e.fault["kind"], []).append(int(bool(hits)))
        if hits:
            tp += 1
            latencies.append(hits[0].step - start + 1)
            seconds.append(times[hits[0].step] - times[start - 1])
    injected = sum(e.fault is not None for e in episodes)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / injected if injected else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "tp": tp,
        "fp": fp,
        "injected": injected,
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "latency_steps": mean(latencies),
        "latency_seconds": mean(seconds),
        "false_alarms_per_clean_hour": fp_clean / max(clean_seconds / 3600, 1e-9),
        "recall_per_kind": {k: sum(v) / len(v) for k, v in sorted(per_kind.items())},
    }


def fault_patterns(records: dict[int, list[dict]], episodes: list[Episode]) -> list[tuple[str, list[dict]]]:
    """Per live injected episode, step by step from its first step: the faulty worker's value of every health
    signal relative to the median of the others (ratio for log signals, difference otherwise; NaN kept)."""
    import numpy as np

    from allsync.health.detector import PRIORITY

    patterns = []
    for e in episodes:
        if e.fault is None:
            continue
        rank, steps = e.fault["rank"], []
        for step in range(e.first, e.last + 1):
            faulty, others = records[step][rank], [w for i, w in enumerate(records[step]) if i != rank]
            rel = {}
            for sig in PRIORITY:
                if sig.key in faulty:
                    med = float(np.median([w[sig.key] for w in others]))
                    rel[sig.key] = faulty[sig.key] / med if sig.log and med > 0 else faulty[sig.key] - med
            steps.append(rel)
        patterns.append((e.fault["kind"], steps))
    return patterns


def scale_trace(records: dict[int, list[dict]], episodes: list[Episode], workers: int, seed: int):
    """(reports per step, episodes) of `workers` simulated workers: every episode's steps copy a random live
    clean episode's steps, each simulated worker a random live worker's report at that step; half the
    episodes get a random live fault pattern on a random worker."""
    import numpy as np

    from allsync.health.detector import PRIORITY

    rng = np.random.default_rng(seed)
    keys = [sig.key for sig in PRIORITY]
    log = {sig.key for sig in PRIORITY if sig.log}
    clean = [e for e in episodes if e.fault is None]
    patterns = fault_patterns(records, episodes)
    n = len(episodes)
    labels = rng.permutation([True] * (n // 2) + [False] * (n - n // 2))
    trace, out_episodes = [], []
    for step in [
        *range(1, WARMUP_STEPS + 1),
        *range(clean[0].first, clean[0].last + 1),
    ]:  # warm-up: the detectors' noise history
        trace.append(
            [
                {k: records[step][j][k] for k in keys if k in records[step][j]}
                for j in rng.integers(len(records[step]), size=workers)
            ]
        )
    for injected in labels:
        source = clean[rng.integers(len(clean))]
        first = len(trace) + 1
        fault = None
        if injected:
            kind, pattern = patterns[rng.integers(len(patterns))]
            fault = {"kind": kind, "rank": int(rng.integers(workers)), "step": first + 1}
        for offset, step in enumerate(range(source.first, source.last + 1)):
            live = records[step]
            reports = [{k: live[j][k] for k in keys if k in live[j]} for j in rng.integers(len(live), size=workers)]
            if fault is not None:
                rel = pattern[offset]
                victim = reports[fault["rank"]]
                for k, r in rel.items():
                    med = float(np.median([w[k] for w in reports if k in w]))
                    victim[k] = med * r if k in log else med + r
            trace.append(reports)
        out_episodes.append(Episode(first, len(trace), fault))
    return trace, out_episodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT))
    parser.add_argument("--episodes", type=int, default=120)
    parser.add_argument("--episode-steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/faults")
    parser.add_argument("--score-only", action="store_true", help="score the run already in --out")
    parser.add_argument("--scale", type=int, nargs="*", default=[], help="simulated worker counts for recorded traces")
    parser.add_argument(
        "--eval-every", type=int, default=10**6, help="run.eval_every of the drill run (default: at the end)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=10**6, help="run.checkpoint_every (default: at the end)"
    )
    args = parser.parse_args(argv)

    from allsync.health.detector import SimilarityDetector, ThresholdDetector, read_worker_records, replay

    out = Path(args.out)
    episodes = plan(args.episodes, args.episode_steps, args.seed)
    if not args.score_only:
        config = run_config(
            yaml.safe_load(Path(args.config).read_text()), out, episodes, args.eval_every, args.checkpoint_every
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "faults.yaml").write_text(yaml.safe_dump(config))
        done = subprocess.run([sys.executable, str(RECIPE), "--config", str(out / "faults.yaml")], text=True)
        if done.returncode:
            print(f"error: the recipe failed ({done.returncode})", file=sys.stderr)
            return 1
    records = read_worker_records(out)
    times = {r["step"]: r["time"] for r in records}
    times[0] = times[1] - (times[2] - times[1])  # the first step's start, as one step before its end
    steps = [r for r in records if r["step"] >= 1]
    step_seconds = [times[s] - times[s - 1] for s in sorted(times) if s - 1 in times]
    probe = [w["probe_seconds"] for r in steps for w in r["workers"] if w]
    monitor = [r["monitor_seconds"] for r in steps]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(
        f"{len(steps)} steps, {mean(step_seconds):.2f} s/step; monitoring cost: probe {1e3 * mean(probe):.2f} ms per worker-step, "
        f"controller {1e3 * mean(monitor):.2f} ms per step = {100 * (mean(probe) + mean(monitor)) / mean(step_seconds):.3f}% of a step"
    )
    results = {}
    for detector in (SimilarityDetector(), ThresholdDetector()):
        results[detector.name] = s = score(replay(steps, detector), episodes, times)
        print(
            f"{detector.name:>10}: precision {s['precision']:.3f} recall {s['recall']:.3f} F1 {s['f1']:.3f} latency "
            f"{s['latency_steps']:.2f} steps / {s['latency_seconds']:.1f} s, false alarms {s['fp']} "
            f"({s['false_alarms_per_clean_hour']:.1f} per clean hour), recall per kind {s['recall_per_kind']}"
        )
    by_step = {r["step"]: r["workers"] for r in steps}
    for workers in args.scale:
        trace, synthetic = scale_trace(by_step, episodes, workers, args.seed)
        step_time = mean(step_seconds)  # simulated steps take the live run's mean step time
        fake_times = {i: i * step_time for i in range(len(trace) + 1)}
        for detector in (SimilarityDetector(), ThresholdDetector()):
            alarms = [a for i, r in enumerate(trace, 1) for a in detector.observe(i, r)]
            s = score(alarms, synthetic, fake_times)
            results[f"{detector.name}@{workers}"] = s
            print(
                f"recorded traces, {workers} simulated workers, {detector.name:>10}: precision {s['precision']:.3f} recall "
                f"{s['recall']:.3f} F1 {s['f1']:.3f} latency {s['latency_steps']:.2f} steps, false alarms {s['fp']}"
            )
    (out / "faults_score.json").write_text(json.dumps(results, indent=1))
    sim, base = results["similarity"], results["threshold"]
    print(
        f"live injections: precision {sim['precision']:.3f} recall {sim['recall']:.3f} F1 {sim['f1']:.3f} "
        f"latency {sim['latency_steps']:.2f} steps (baseline F1 {base['f1']:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
