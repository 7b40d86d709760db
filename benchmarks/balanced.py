"""Balanced reasoning (issue 27): DAPO with and without Kimi-1.5's length reward from the same verbose base.

    python -m benchmarks.balanced [--steps 100] [--eval-every 25] [--seeds 0] [--reasoning verbose|mixed]
                                  [--coef 1.0] [--length-groups all|with_correct] [--variants accuracy-only,balanced]
                                  [--previous FILE] [--out runs/balanced]

Both runs are `python recipes/dapo.py` on recipes/configs/tiny_cpu_balanced.yaml (the default model and task,
warm-started to sum column by column and restate its result before `Answer: N`; the base is built once).
`--reasoning mixed` (issue 49) warm-starts its own base (runs/tiny-base-mixed) on task.reasoning mixed: the same
verbose replies, and for one problem in four the same column sums in a few tokens (compact_reply), a shorter correct
reasoning the base has seen.
    accuracy-only   DAPO as configured: +1 / 0 on the answer
    balanced        the same with reward.length {coef: --coef, groups: --length-groups}: within a group the shortest
                    correct reply earns +0.5 coef, the longest -0.5 coef, a wrong reply is never rewarded for being
                    short (with_correct: no length term in a group without a correct reply)
Each of --variants runs once per `--seeds` value (run.seed: the LoRA's start and the sampling); `--previous` adds the
runs of an earlier run's balanced.json (a variant and seed run now replaces the file's). Reported for the base and every run: held-out avg@4 and the mean tokens of the
held-out replies, at every evaluation, and the held-out replies' lengths (quartiles) of the base and of each run's
last evaluation. Writes OUT/balanced.json, OUT/balanced.png (held-out accuracy against mean reply tokens over
training, seed 0) and OUT/balanced_lengths.png (the held-out replies' lengths before and after, every seed's replies
together). Last line, from the seeds' means at the last step:
`balanced reasoning: accuracy X% of the accuracy-only run's with Y% of its tokens`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from benchmarks.dapo_runs import run_dapo

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu_balanced.yaml"
VARIANTS = {"accuracy-only": None, "balanced": {"coef": 1.0}}
BASES = {"verbose": "runs/tiny-base-verbose", "mixed": "runs/tiny-base-mixed"}  # --reasoning -> model.base


def variant_config(length: dict | None, steps: int, eval_every: int, seed: int, reasoning: str = "verbose") -> dict:
    config = yaml.safe_load(CONFIG.read_text())
    config["task"]["reasoning"] = reasoning
    config["model"]["base"] = str(ROOT / BASES[reasoning])
    config.setdefault("reward", {})["length"] = length
    config["run"].update(steps=steps, eval_every=eval_every, checkpoint_every=steps, seed=seed)
    return config


def reply_lengths(folder: Path) -> list[int]:
    """The tokens of every held-out reply an evaluation wrote to `folder` (samples.jsonl)."""
    lines = (folder / "samples.jsonl").read_text().splitlines()
    return [json.loads(line)["tokens"] for line in lines if line.strip()]


def quartiles(lengths: list[int]) -> list[float]:
    """min, the three quartiles and max of `lengths`."""
    q = statistics.quantiles(lengths, n=4)
    return [min(lengths), *q, max(lengths)]


def run_variant(name: str, config: dict, out: Path) -> dict:
    rows, _ = run_dapo(name, config, out / name)
    run = out / name / "run"
    return {
        "heldout": {r["step"]: r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r},
        "heldout_tokens": {r["step"]: r["heldout_mean_tokens"] for r in rows if "heldout_mean_tokens" in r},
        "train_length": {r["step"]: r["response_length"] for r in rows if "response_length" in r},
        "lengths_base": reply_lengths(run / "eval-base"),
        "lengths_final": reply_lengths(run / "eval"),
    }


def plot_lengths(results: dict, path: Path) -> None:
    """Histograms of the held-out replies' tokens: the base's, and each variant's after its last step (every seed's
    replies together)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(results.values()))
    series = {"base": [n for r in first.values() for n in r.get("lengths_base", [])]}
    series.update(
        {
            f"{name}, last step": [n for r in runs.values() for n in r.get("lengths_final", [])]
            for name, runs in results.items()
        }
    )
    series = {k: v for k, v in series.items() if v}
    if not series:
        return
    top = max(max(v) for v in series.values())
    bins = range(0, top + 8, 4)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, lengths in series.items():
        ax.hist(
            lengths,
            bins=bins,
            histtype="step",
            linewidth=1.5,
            label=f"{label} (median {statistics.median(lengths):.0f})",
        )
    ax.set(xlabel="held-out reply tokens", ylabel="replies")
    ax.set_title("balanced reasoning: held-out reply lengths before and after")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, by_seed in results.items():
        r = by_seed[min(by_seed, key=int)]
        steps = sorted(set(r["heldout"]) & set(r["heldout_tokens"]), key=int)
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
    parser.add_argument("--seeds", default="0", help="comma-separated run.seed values")
    parser.add_argument("--previous", help="an earlier run's balanced.json: its seeds join the report")
    parser.add_argument("--reasoning", default="verbose", choices=sorted(BASES), help="task.reasoning of the base")
    parser.add_argument("--coef", type=float, default=1.0, help="the balanced run's reward.length.coef")
    parser.add_argument("--length-groups", default="all", help="the balanced run's reward.length.groups")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which of accuracy-only, balanced to run")
    parser.add_argument("--out", default=str(ROOT / "runs" / "balanced"))
    args = parser.parse_args(argv)
    variants = {name: VARIANTS.get(name, ()) for name in args.variants.split(",")}
    if () in variants.values():
        raise SystemExit(f"--variants: use accuracy-only, balanced or both, got {args.variants!r}")
    if "balanced" in variants:
        variants["balanced"] = {"coef": args.coef, "groups": args.length_groups}
    out = Path(args.out)
    results = {name: {} for name in VARIANTS}
    if args.previous:
        for name, by_seed in json.loads(Path(args.previous).read_text()).items():
            results[name].update(by_seed if "heldout" not in by_seed else {"0": by_seed})  # older files: seed 0 alone
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, length in variants.items():
            config = variant_config(length, args.steps, args.eval_every, seed, args.reasoning)
            r = results[name][str(seed)] = run_variant(name, config, out / f"seed-{seed}")
            print(f"{name:<14} seed {seed} held-out {r['heldout']}  held-out tokens {r['heldout_tokens']}", flush=True)
            print(
                f"{'':<14} reply tokens (min, quartiles, max): base {quartiles(r['lengths_base'])}, "
                f"last step {quartiles(r['lengths_final'])}",
                flush=True,
            )
    (out / "balanced.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "balanced.png")
    plot_lengths(results, out / "balanced_lengths.png")

    def final(name: str, key: str) -> float:
        """The seeds' mean of `key` at each run's last evaluation."""
        runs = list(results[name].values())
        return sum(r[key][max(r[key], key=int)] for r in runs) / len(runs)

    accuracy = final("balanced", "heldout") / max(final("accuracy-only", "heldout"), 1e-9)
    tokens = final("balanced", "heldout_tokens") / final("accuracy-only", "heldout_tokens")
    seed0 = results["accuracy-only"][min(results["accuracy-only"], key=int)]
    base = min(seed0["heldout"], key=int)
    print(f"base: held-out {seed0['heldout'][base]:.1%} with {seed0['heldout_tokens'][base]:.1f} tokens per reply")
    print(f"seeds: {', '.join(sorted(results['balanced'], key=int))}")
    print(f"wrote {out / 'balanced.json'}, {out / 'balanced.png'} and {out / 'balanced_lengths.png'}")
    print(f"balanced reasoning: accuracy {accuracy:.0%} of the accuracy-only run's with {tokens:.0%} of its tokens")
    return results


if __name__ == "__main__":
    main()
