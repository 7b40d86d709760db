"""One `python recipes/dapo.py` run of a config dict, as the benchmarks that compare configs run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_dapo(name: str, config: dict, folder: Path) -> tuple[list[dict], str]:
    """Write `config` to folder/config.yaml, train with recipes/dapo.py into folder/run; (its metrics.jsonl rows,
    the last line it printed). A failed run stops the benchmark with its stderr's end."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [
        sys.executable,
        str(ROOT / "recipes" / "dapo.py"),
        "--config",
        str(path),
        "--out-dir",
        str(folder / "run"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name}: recipes/dapo.py failed\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, done.stdout.strip().splitlines()[-1]


def finished_rows(folder: Path, steps: int) -> list[dict] | None:
    """The metrics rows of a run_dapo run in `folder` that reached step `steps` and evaluated there (None otherwise):
    what a benchmark cut off earlier already finished, read back instead of run again."""
    path = folder / "run" / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = any(r.get("step") == steps and "heldout_accuracy" in r for r in rows)
    return rows if done else None


def plot_heldout(runs: dict, colors: dict, labels: dict, title: str, path: Path, target: float | None = None) -> None:
    """Held-out accuracy over steps, a line a run (runs: "ARM seed N" -> {"heldout": {step: accuracy}}), colored and
    labelled by arm (the first run of an arm gives the legend its entry); `target` drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labelled: set[str] = set()
    for name, run in runs.items():
        arm = name.rsplit(" seed ", 1)[0]
        steps = sorted(run["heldout"], key=int)
        label = None if arm in labelled else labels[arm]
        labelled.add(arm)
        accuracy = [100 * run["heldout"][s] for s in steps]
        ax.plot([int(s) for s in steps], accuracy, color=colors[arm], alpha=0.7, label=label)
    if target is not None:
        ax.axhline(100 * target, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy, avg@4 (%)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
