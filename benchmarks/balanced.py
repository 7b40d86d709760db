"""Balanced reasoning (issue 27): DAPO with and without Kimi-1.5's length reward from the same verbose base.

    python -m benchmarks.balanced [--steps 100] [--eval-every 25] [--out runs/balanced]

Both runs are `python recipes/dapo.py` on recipes/configs/tiny_cpu_balanced.yaml (the default model and task,
warm-started to sum column by column and restate its result before `Answer: N`; the base is built once):
    accuracy-only   DAPO as configured: +1 / 0 on the answer
    balanced        the same with reward.length {coef: 1.0}: within a group the shortest correct reply earns +0.5,
                    the longest -0.5, a wrong reply is never rewarded for being short
Reported for the base and both runs: held-out avg@4 and the mean tokens of the held-out replies, at every
evaluation. Writes OUT/balanced.json and OUT/balanced.png (held-out accuracy against mean reply tokens over
training). Last line: `balanced reasoning: accuracy X% of the accuracy-only run's with Y% of its tokens`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from benchmarks.dapo_runs import run_dapo

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu_balanced.yaml"
VARIANTS = {"accuracy-only": None, "balanced": {"coef": 1.0}}


def variant_config(length: dict | None, steps: int, eval_every: int) -> dict:
    config = yaml.safe_load(CONFIG.read_text())
    config["model"]["base"] = str(ROOT / config["model"]["base"])
    config.setdefault("reward", {})["length"] = length
    config["run"].update(steps=steps, eval_every=eval_every, checkpoint_every=steps)
    return config


def run_variant(name: str, config: dict, out: Path) -> dict:
    rows, _ = run_dapo(name, config, out / name)
    return {
        "heldout": {r["step"]: r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r},
        "heldout_tokens": {r["step"]: r["heldout_mean_tokens"] for r in rows if "heldout_mean_tokens" in r},
        "train_length": {r["step"]: r["response_length"] for r in rows if "response_length" in r},
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, r in results.items():
        steps = sorted(set(r["heldout"]) & set(r["heldout_tokens"]))
        ax.plot([r["heldout_tokens"][s] for s in steps], [100 * r["heldout"][s] for s in steps], marker="o", label=name)
        for s in (steps[0], steps[-1]):
            ax.annotate(f"step {s}", (r["heldout_tokens"][s], 100 * r["heldout"][s]), fontsize=7)
    ax.set(xlabel="mean held-out reply tokens", ylabel="held-out accuracy (avg@4, %)")
    ax.set_title("balanced reasoning: accuracy against reply length over training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", default=str(ROOT / "runs" / "balanced"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    results = {}
    for name, length in VARIANTS.items():
        results[name] = run_variant(name, variant_config(length, args.steps, args.eval_every), out)
        r = results[name]
        print(f"{name:<14} held-out {r['heldout']}  held-out tokens {r['heldout_tokens']}", flush=True)
    (out / "balanced.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "balanced.png")
    last = {name: max(r["heldout"]) for name, r in results.items()}
    plain, balanced = results["accuracy-only"], results["balanced"]
    accuracy = balanced["heldout"][last["balanced"]] / max(plain["heldout"][last["accuracy-only"]], 1e-9)
    tokens = balanced["heldout_tokens"][last["balanced"]] / plain["heldout_tokens"][last["accuracy-only"]]
    print(f"base: held-out {plain['heldout'][0]:.1%} with {plain['heldout_tokens'][0]:.1f} tokens per reply")
    print(f"wrote {out / 'balanced.json'} and {out / 'balanced.png'}")
    print(f"balanced reasoning: accuracy {accuracy:.0%} of the accuracy-only run's with {tokens:.0%} of its tokens")
    return results


if __name__ == "__main__":
    main()
