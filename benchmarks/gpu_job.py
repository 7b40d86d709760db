"""The default job in one process on a GPU against the same job on the CPU (issue 10's GPU check (a)).

    python -m benchmarks.gpu_job [--devices cuda,cpu] [--steps 600] [--cpu-steps 30] [--out runs/gpu-job]

For each device, a config is written from recipes/configs/tiny_cpu.yaml that differs from it only where one
process needs it to (one worker holding all 32 prompts per step, run in this process with --no-ray, so no
restarts or step timeout) and in parallel.device; `recipes/dapo.py` runs it. The first device runs
--steps steps (held-out accuracy before and after), the others --cpu-steps (their s/step only). Prints
per device: steps, median s/step (step_seconds in metrics.jsonl, steps after the first), held-out accuracy
before -> after, and the s/step ratio of each device against the first; writes the same as JSON to
OUT/summary.json after each device, and each run's output to OUT/<device>-<i>.log as it is printed.
Needs what the one-process job imports: torch, transformers, peft, accelerate, bitsandbytes, math-verify
(no Ray, no vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
DEFAULT_CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
ACCURACY = re.compile(r"^held-out accuracy: base ([\d.]+)% -> trained ([\d.]+)%$", re.M)


def one_process_config(default: dict, device: str, steps: int, out_dir: Path) -> dict:
    """The default job as one worker on `device` (the total batch unchanged: every prompt on that worker)."""
    config = json.loads(json.dumps(default))
    config["parallel"].update(workers_per_node=1, device=device)
    config["run"].update(
        out_dir=str(out_dir),
        steps=steps,
        max_restarts=0,
        step_timeout=None,
        time_limit_minutes=None,
        eval_every=steps,
        checkpoint_every=steps,
    )
    return config


def step_seconds(metrics_path: Path) -> list[float]:
    """step_seconds of every step after the first (the first includes the engine's warm-up)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [r["step_seconds"] for r in records if "step_seconds" in r and r.get("step", 0) > 1]


def run_job(config: dict, path: Path) -> dict:
    """Run one config; its output goes to <path>.log as it is printed (a run cut off by a time limit leaves
    its log and its metrics.jsonl so far)."""
    path.write_text(yaml.safe_dump(config))
    log_path = path.parent / f"{path.stem}.log"
    with log_path.open("w") as log:
        done = subprocess.run(
            [sys.executable, str(ROOT / "recipes" / "dapo.py"), "--config", str(path), "--no-ray"],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    output = log_path.read_text()
    if done.returncode != 0:
        raise RuntimeError(f"{path}: recipes/dapo.py exited {done.returncode}:\n{output[-3000:]}")
    times = step_seconds(Path(config["run"]["out_dir"]) / "metrics.jsonl")
    accuracy = ACCURACY.search(output)
    return {
        "device": config["parallel"]["device"],
        "steps": config["run"]["steps"],
        "median_step_seconds": statistics.median(times) if times else None,
        "heldout_before": float(accuracy.group(1)) if accuracy else None,
        "heldout_after": float(accuracy.group(2)) if accuracy else None,
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cuda,cpu", help="comma list; the first runs --steps, the others --cpu-steps")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--cpu-steps", type=int, default=30)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--out", default="runs/gpu-job")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    default = yaml.safe_load(Path(args.config).read_text())
    rows = []
    for i, device in enumerate(args.devices.split(",")):
        steps = args.steps if i == 0 else args.cpu_steps
        rows.append(
            run_job(one_process_config(default, device, steps, out / f"run-{device}-{i}"), out / f"{device}-{i}.yaml")
        )
        first, row = rows[0]["median_step_seconds"], rows[-1]
        row["step_seconds_vs_first"] = (
            row["median_step_seconds"] / first if first and row["median_step_seconds"] else None
        )
        print(
            f"{device}: {steps} steps, {row['median_step_seconds']:.3f} s/step (x{row['step_seconds_vs_first']:.2f} of "
            f"{rows[0]['device']}), held-out avg@4 {row['heldout_before']}% -> {row['heldout_after']}%",
            flush=True,
        )
        (out / "summary.json").write_text(
            json.dumps(rows, indent=2)
        )  # after every device: a cut-off run keeps the rest
    return rows


if __name__ == "__main__":
    main()
