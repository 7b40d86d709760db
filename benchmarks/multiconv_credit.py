"""Multi-conversation DAPO: does the final reward have to train the memory writes? credit all vs final.

    python benchmarks/multiconv_credit.py [--config recipes/configs/tiny_cpu_memory.yaml] [--steps N]

Runs the memory recipe twice with everything equal but producer.credit (all: every segment
trains; final: only the answer segment, the ablation), one run after the other on the same machine, each
to the same step count. Prints both runs' wall time, held-out accuracy (base -> trained) and memory
ablation (the trained policy answering from its own memory, a blanked one, the gold one), then
`credit all X% vs final Y% (base Z%)`, and draws held-out accuracy against wall time for both
(multiconv_credit.png in the first run's out_dir parent).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "dapo.py"
DEFAULT = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "tiny_cpu_memory.yaml"


def run(config: dict, credit: str, steps: int | None) -> dict:
    """One recipe run with producer.credit set; its summary lines parsed and its metrics read."""
    config = json.loads(json.dumps(config))
    config["producer"]["credit"] = credit
    config["run"]["out_dir"] = f"{config['run']['out_dir']}-credit-{credit}"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    start = time.time()
    cmd = [sys.executable, str(RECIPE), "--config", f.name] + (["--steps", str(steps)] if steps else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"credit {credit}: the recipe failed ({out.returncode}):\n{out.stderr[-3000:]}")
    text = out.stdout
    (Path(config["run"]["out_dir"]) / "recipe_output.txt").write_text(text)  # what the recipe printed
    accuracy = re.search(r"held-out accuracy: base ([\d.]+)% -> trained ([\d.]+)%", text)
    ablation = re.search(r"memory ablation: own ([\d.]+)%, blanked ([\d.]+)%, gold ([\d.]+)%", text)
    records = [json.loads(line) for line in (Path(config["run"]["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {
        "credit": credit,
        "wall_min": (time.time() - start) / 60,
        "base": float(accuracy[1]),
        "trained": float(accuracy[2]),
        "own": float(ablation[1]),
        "blank": float(ablation[2]),
        "gold": float(ablation[3]),
        "records": records,
        "out_dir": config["run"]["out_dir"],
    }


def plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        elapsed, points = 0.0, [(0.0, 100 * r["records"][0]["heldout_accuracy"])]
        for rec in r["records"][1:]:
            elapsed += rec.get("step_seconds", 0.0) / 60
            if "heldout_accuracy" in rec and "step_seconds" in rec:
                points.append((elapsed, 100 * rec["heldout_accuracy"]))
        ax.plot(*zip(*points), marker="o", label=f"credit {r['credit']}")
    ax.set_xlabel("RL wall time (min)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("memory_recall: reward trains every segment (all) or the answer (final)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT))
    parser.add_argument("--steps", type=int)
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    results = [run(config, credit, args.steps) for credit in ("all", "final")]
    for r in results:
        print(
            f"credit {r['credit']}: {r['wall_min']:.1f} min, held-out accuracy {r['base']:.1f}% -> {r['trained']:.1f}%, "
            f"memory ablation: own {r['own']:.1f}%, blanked {r['blank']:.1f}%, gold {r['gold']:.1f}%"
        )
    png = plot(results, Path(results[0]["out_dir"]).parent / "multiconv_credit.png")
    print(f"plot: {png}")
    print(
        f"credit all {results[0]['trained']:.1f}% vs final {results[1]['trained']:.1f}% (base {results[0]['base']:.1f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
