"""Multi-conversation DAPO against single-context GRPO on memory_recall (issue 49, item 4): steps and time to the
same held-out accuracy, over seeds.

    python -m benchmarks.multiconv_vs_grpo [--steps 30] [--seeds 0,1,2] [--eval-every 2] [--target 0.9]
                                           [--arms multiconv,single] [--out runs/multiconv-vs-grpo]
    python -m benchmarks.multiconv_vs_grpo --arms long --out runs/multiconv-long   # inputs too long for one context

Arms (each `python recipes/dapo.py` on its config, with only run.steps / seed / eval_every changed):
    multiconv  recipes/configs/tiny_cpu_memory.yaml: each chunk read in its own conversation that writes a memory
               (at most 8 tokens), the answer written from the question and the last memory (12); the final reward
               trains every segment (producer.credit all)
    single     recipes/configs/tiny_cpu_memory_single.yaml: the same problems with both chunks and the question in
               one prompt, answered at once, with the same 28 generated tokens a sample at most
    long       recipes/configs/tiny_cpu_memory_long.yaml: six chunks of four assignments (143 tokens read at once) for
               a base whose context is 96 positions, read as multiconv reads its two; the single-context form of the
               same problems is refused (its warm start is tried and its refusal recorded as `single_refused`)

Both use GRPO advantages with DAPO's clip-higher, token-mean loss and dynamic sampling, the same learning rate, batch
and held-out problems, each from a base warm-started on its own form by the same noisy teacher (the decoy's value
70% of the time; built once). run.seed takes each --seeds value. Reported per run: held-out avg@4 at every
evaluation, the first evaluated step at or above --target and the training time to it (the step_seconds of the
steps before it, evaluations excluded); per arm the mean and spread of those and of the final accuracy. Runs go seed
by seed; OUT/multiconv_vs_grpo.json is rewritten after each, and a run that already finished is read back.
OUT/multiconv_vs_grpo.png: held-out accuracy over steps, every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from benchmarks.dapo_runs import finished_rows, plot_heldout, run_dapo

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "multiconv": ROOT / "recipes" / "configs" / "tiny_cpu_memory.yaml",
    "single": ROOT / "recipes" / "configs" / "tiny_cpu_memory_single.yaml",
    "long": ROOT / "recipes" / "configs" / "tiny_cpu_memory_long.yaml",
}


def arm_config(arm: str, steps: int, seed: int, eval_every: int) -> dict:
    """The arm's shipped config with `steps`, `seed` and `eval_every` set, its base as an absolute path."""
    config = yaml.safe_load(CONFIGS[arm].read_text())
    config["model"]["base"] = str(ROOT / config["model"]["base"])
    config["run"].update(steps=steps, seed=seed, eval_every=eval_every, checkpoint_every=steps, time_limit_minutes=None)
    return config


def build_base(config: dict) -> None:
    """Warm-start a run config's base once, before its runs."""
    from allsync.config import parse_config
    from allsync.warm_start import settings_for_run, warm_start

    parsed = parse_config(config)
    warm_start(parsed.model.base, settings_for_run(parsed))


def single_context_form(config: dict) -> dict:
    """The single-context form of a segmented memory_recall config (as tiny_cpu_memory_single.yaml is of
    tiny_cpu_memory.yaml): task.context single, no producer section, the episode's generated tokens as
    rollout.max_new_tokens (a memory write a chunk plus the answer), its own base directory."""
    task, producer = config["task"], config["producer"]
    single = {k: v for k, v in config.items() if k != "producer"}
    single["task"] = {**task, "context": "single"}
    new_tokens = task["chunks"] * producer["memory_tokens"] + config["rollout"]["max_new_tokens"]
    single["rollout"] = {**config["rollout"], "max_new_tokens": new_tokens}
    single["model"] = {**config["model"], "base": config["model"]["base"] + "-single"}
    return single


def single_context_refusal(config: dict) -> str | None:
    """What the toolkit says when the single-context form of `config` is asked for (its base's warm start is where
    it stops); None if it runs."""
    try:
        build_base(single_context_form(config))
    except ValueError as error:
        return str(error)
    return None


def time_to_target(rows: list[dict], target: float) -> tuple[int | None, float | None]:
    """(the first evaluated step whose held-out accuracy is at least `target`, the training seconds before it: the
    sum of step_seconds over steps 1..that step); (None, None) if no evaluation reached it."""
    reached = sorted(r["step"] for r in rows if r.get("heldout_accuracy", -1.0) >= target)
    if not reached:
        return None, None
    step = reached[0]
    return step, sum(r["step_seconds"] for r in rows if "step_seconds" in r and r["step"] <= step)


def summarize(rows: list[dict], target: float) -> dict:
    step, seconds = time_to_target(rows, target)
    heldout = {r["step"]: r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r}
    timed = [r["step_seconds"] for r in rows if "step_seconds" in r]
    return {
        "heldout": heldout,
        "final": heldout[max(heldout)],
        "steps_to_target": step,
        "seconds_to_target": seconds,
        "seconds_per_step": statistics.median(timed[1:]) if len(timed) > 1 else None,
        "tokens_per_sample": statistics.mean(r["response_length"] for r in rows if "response_length" in r),
        # the recipe's last evaluation of a segmented run again, its answers from an empty and from the gold memory
        "memory_ablation": {
            k.removeprefix("heldout_accuracy_"): r[k]
            for r in rows
            for k in r
            if k.startswith("heldout_accuracy_") and k.endswith("_memory")
        },
    }


def arm_summary(runs: list[dict]) -> dict:
    """Mean and range of the runs' final accuracy; steps and seconds to the target over the runs that reached it."""
    finals = [r["final"] for r in runs]
    reached = [r for r in runs if r["steps_to_target"] is not None]
    out = {"final_mean": statistics.mean(finals), "final_min": min(finals), "final_max": max(finals)}
    out["reached"] = f"{len(reached)} of {len(runs)}"
    if reached:
        steps = [r["steps_to_target"] for r in reached]
        seconds = [r["seconds_to_target"] for r in reached]
        out |= {"steps_mean": statistics.mean(steps), "steps_min": min(steps), "steps_max": max(steps)}
        out |= {"seconds_mean": statistics.mean(seconds), "seconds_min": min(seconds), "seconds_max": max(seconds)}
    return out


def plot(results: dict, path: Path) -> None:
    colors = {"multiconv": "tab:blue", "single": "tab:orange", "long": "tab:green"}
    labels = {
        "multiconv": "multi-conversation DAPO",
        "single": "single-context GRPO",
        "long": "multi-conversation DAPO, 6 chunks past a 96-position context",
    }
    title = (
        "memory_recall: segments with a memory vs one context (a line a seed)"
        if set(results["arms"]) != {"long"}
        else "memory_recall past a 96-position context, read in segments (a line a seed)"
    )
    plot_heldout(results["runs"], colors, labels, title, path, results["target"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9, help="the held-out accuracy both arms are timed to")
    parser.add_argument("--arms", default=",".join(CONFIGS))
    parser.add_argument("--out", default="runs/multiconv-vs-grpo")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in CONFIGS]
    if unknown:
        raise SystemExit(f"--arms: unknown arm {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    for name in ("steps", "eval_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if not 0 < args.target <= 1:
        raise SystemExit(f"--target: a held-out accuracy in (0, 1], got {args.target}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"steps": args.steps, "target": args.target, "eval_every": args.eval_every, "runs": {}}
    for arm in arms:
        build_base(arm_config(arm, 1, 0, 1))
    if "long" in arms:
        results["single_refused"] = single_context_refusal(arm_config("long", 1, 0, 1))
        print(
            f"single-context form of the long inputs: {results['single_refused'] or 'runs (not refused)'}", flush=True
        )
    for seed in seeds:
        for arm in arms:
            name, folder = f"{arm} seed {seed}", out / f"{arm}-s{seed}"
            print(f"{name}: {args.steps} steps ...", flush=True)
            rows = finished_rows(folder, args.steps)
            if rows is None:
                rows, last = run_dapo(name, arm_config(arm, args.steps, seed, args.eval_every), folder)
            else:
                last = f"read back from {folder}"
            results["runs"][name] = summarize(rows, args.target)
            print(f"  {last}", flush=True)
            (out / "multiconv_vs_grpo.json").write_text(json.dumps(results, indent=2) + "\n")
    results["arms"] = {
        arm: arm_summary([r for n, r in results["runs"].items() if n.startswith(arm + " seed")]) for arm in arms
    }
    for arm, s in results["arms"].items():
        to_target = (
            f"{s['steps_mean']:.1f} steps ({s['steps_min']}-{s['steps_max']}), {s['seconds_mean']:.0f} s"
            if "steps_mean" in s
            else "never"
        )
        print(
            f"{arm}: final held-out {100 * s['final_mean']:.1f}% ({100 * s['final_min']:.1f}-{100 * s['final_max']:.1f}); "
            f"to {100 * args.target:.0f}%: {to_target} ({s['reached']} runs)"
        )
    (out / "multiconv_vs_grpo.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "multiconv_vs_grpo.png")
    return results


if __name__ == "__main__":
    main()
