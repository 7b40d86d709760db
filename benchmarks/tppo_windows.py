"""T-PPO where windows matter (issue 27): T-PPO, PPO on whole responses and DAPO for the same wall-clock minutes.

    python -m benchmarks.tppo_windows [--minutes 12] [--window 32] [--pool 128] [--arms DAPO,PPO,T-PPO]
                                      [--out runs/tppo-windows]

The task has long, variable-length responses: recipes/configs/tiny_cpu_balanced.yaml's verbose arithmetic (the sum
column by column with carries, then 0-3 restatements, 72-172 tokens), from a weaker base than that config's
(model.warm_start_steps 450: held-out avg@4 about 25%, so there is room to learn; built once, 4 minutes). Arms,
each `python recipes/dapo.py` from that base, stopped by run.time_limit_minutes = --minutes:
    DAPO    the config as shipped: 32 problems x 4 samples a step, group baselines
    PPO     producer.kind windows without a window: --pool problems x 1 whole responses a step, GAE with the
            critic (allsync/update/critic.py), gamma 1, lambda 1, value_lam 1, the critic alone for the first 5 steps
            (640 responses)
    T-PPO   the same pool, but every step generates --window more tokens of each in-flight response and trains
            those; EGAE bootstraps the responses cut at the window; the critic alone for the first 20 steps
            (about as many finished responses as PPO's 5)
Probes of T-PPO's collapse (issue 49; `--arms` names them):
    PPO-last    PPO whose policy loss reaches only each reply's last --window tokens, as T-PPO's reward reaches only
                a reply's last window (benchmarks/probes/last_tokens_credit.py, through run.imports)
    T-PPO-critic4x  T-PPO with four times the critic-only steps (a critic that has seen more returns)
    T-PPO-scale T-PPO with algorithm.whiten scale: the batch's advantages divided by their standard deviation, the
                mean not taken off (PPO's whitening subtracts the batch mean, which the few finished windows set, from
                every token of the many cut ones alike)
Each arm evaluates held-out avg@4 about every `--eval-minutes` (its eval_every from the step time measured on the
2-core Xeon), so that evaluation costs each arm about the same share of its minutes.

Reported per arm: held-out accuracy against training minutes (the sum of step_seconds: evaluation excluded), steps,
mean step time, its generate / train split (worker 0), utilization (busy / wall) and decode fill (the tokens of the
engine's decode forwards over their KV slots; until issue 46, over its static batches' rows x steps), responses
finished and tokens trained per minute. Writes OUT/tppo_windows.json and OUT/tppo_windows.png. Last line:
`T-PPO reached PPO's final held-out accuracy (X%) in A min of PPO's B min: R x (goal 1.5)`, or that it did not.
Measured (BENCHMARKS.md, 2026-11-26): DAPO 24.0% -> 34.6%, PPO -> 34.0%, T-PPO collapsed to 0%.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import yaml
from tqdm import tqdm

from benchmarks.dapo_runs import run_dapo

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu_balanced.yaml"
BASE = "runs/tiny-base-verbose-450"
WARM_START_STEPS = 450
# seconds a step of each arm took on the 2-core Xeon (2026-11-26; T-PPO with window 32): the evaluation cadence
STEP_SECONDS = {"DAPO": 2.1, "PPO": 2.8, "T-PPO": 1.6, "PPO-last": 2.8, "T-PPO-critic4x": 1.6, "T-PPO-scale": 1.6}
ARMS = tuple(STEP_SECONDS)
CRITIC = {
    "gamma": 1.0,
    "lam": 1.0,  # PPO with lam 0.95 lost accuracy and grew its responses in a 1-minute probe (134 -> 160 tokens)
    "value_lam": 1.0,
    "loss_agg": "token-mean",
    "clip_low": 0.2,
    "clip_high": 0.28,
    "dynamic_sampling": False,
}


def base_config(minutes: float, step_seconds: float, eval_minutes: float) -> dict:
    """tiny_cpu_balanced.yaml on the weaker verbose base, stopped after `minutes` (run.steps: twice the steps
    expected, a bound for the progress bar)."""
    config = yaml.safe_load(CONFIG.read_text())
    config["model"].update(base=str(ROOT / BASE), warm_start_steps=WARM_START_STEPS)
    steps = math.ceil(2 * 60 * minutes / step_seconds)
    eval_every = max(1, round(60 * eval_minutes / step_seconds))
    config["run"].update(
        steps=steps, time_limit_minutes=minutes, eval_every=eval_every, checkpoint_every=steps, max_restarts=0
    )
    return config


def critic_arm(config: dict, pool: int, window: int | None, value_pretrain_steps: int) -> dict:
    """The PPO / T-PPO arm: `pool` problems x 1 sample in flight, the critic learning Monte Carlo returns."""
    out = copy.deepcopy(config)
    out["rollout"].update(prompts_per_step=pool, group_size=1, decode_batch=pool // out["parallel"]["workers_per_node"])
    out["producer"] = {"kind": "windows", **({"window": window} if window else {})}
    out["algorithm"] = {
        "advantage": "egae" if window else "gae",
        "value_pretrain_steps": value_pretrain_steps,
        "overlong": config["algorithm"]["overlong"],
        **CRITIC,
    }
    out["optim"]["value_lr"] = 1e-3
    return out


def last_tokens_arm(config: dict, window: int) -> dict:
    """The PPO-last probe: PPO's config with only each reply's last `window` tokens in the policy loss."""
    out = copy.deepcopy(config)
    out["run"]["imports"] = ["benchmarks.probes.last_tokens_credit"]
    out["producer"] = {"kind": "last_tokens_credit", "trained_tokens": window}
    return out


def scaled_arm(config: dict) -> dict:
    """The T-PPO-scale probe: advantages divided by the batch's standard deviation without its mean taken off
    (algorithm.whiten scale), so the finished windows' mean does not shift every cut window's tokens."""
    out = copy.deepcopy(config)
    out["algorithm"]["whiten"] = "scale"
    return out


def arm_configs(minutes: float, window: int, pool: int, eval_minutes: float, arms=ARMS[:3]) -> dict[str, dict]:
    base = lambda name: base_config(minutes, STEP_SECONDS[name], eval_minutes)  # noqa: E731
    mean_tokens = 131  # the base's mean response: a response spans about mean_tokens / window windows
    tppo_pretrain = round(5 * mean_tokens / window)
    build = {
        "DAPO": lambda: base("DAPO"),
        "PPO": lambda: critic_arm(base("PPO"), pool, None, value_pretrain_steps=5),
        "T-PPO": lambda: critic_arm(base("T-PPO"), pool, window, value_pretrain_steps=tppo_pretrain),
        "PPO-last": lambda: last_tokens_arm(critic_arm(base("PPO-last"), pool, None, value_pretrain_steps=5), window),
        "T-PPO-critic4x": lambda: critic_arm(base("T-PPO"), pool, window, value_pretrain_steps=4 * tppo_pretrain),
        "T-PPO-scale": lambda: scaled_arm(critic_arm(base("T-PPO"), pool, window, value_pretrain_steps=tppo_pretrain)),
    }
    return {name: build[name]() for name in arms}


def summarize(rows: list[dict], workers: list[dict]) -> dict:
    """One arm's curve and rates from its metrics.jsonl and workers.jsonl rows."""
    minutes, curve = 0.0, []
    for r in rows:
        minutes += r.get("step_seconds", 0.0) / 60
        if "heldout_accuracy" in r:
            curve.append((r["step"], round(minutes, 3), r["heldout_accuracy"]))
    steps = [r for r in rows if "step_seconds" in r]
    worker0 = [w["workers"][0] for w in workers if w.get("workers")]
    filled = [r["decode_fill"] for r in steps if "decode_fill" in r]
    return {
        "curve": curve,  # (step, training minutes, held-out avg@4)
        "steps": len(steps),
        "train_minutes": minutes,
        "step_seconds": 60 * minutes / max(len(steps), 1),
        "generate_seconds": sum(w["generate_seconds"] for w in worker0) / max(len(worker0), 1),
        "train_seconds": sum(w["train_seconds"] for w in worker0) / max(len(worker0), 1),
        "utilization": sum(r["utilization"] for r in steps) / max(len(steps), 1),
        "decode_fill": sum(filled) / max(len(filled), 1),
        "responses_per_minute": sum(r["samples_per_second"] * r["step_seconds"] for r in steps) / max(minutes, 1e-9),
        "trained_tokens_per_minute": sum(r["trained_tokens"] for r in steps) / max(minutes, 1e-9),
    }


def time_to_reach(curve: list, accuracy: float) -> float | None:
    """Training minutes of the first evaluation after step 0 at or above `accuracy` (None if none)."""
    return next((minutes for step, minutes, a in curve if step and a >= accuracy), None)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, r in results.items():
        ax.plot([m for _, m, _ in r["curve"]], [100 * a for _, _, a in r["curve"]], marker="o", label=name)
    ax.set(xlabel="training minutes (evaluation excluded)", ylabel="held-out accuracy (avg@4, %)")
    ax.set_title("verbose arithmetic (72-172 tokens): same wall-clock minutes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=12.0, help="each arm's run.time_limit_minutes")
    parser.add_argument("--window", type=int, default=32, help="T-PPO's producer.window")
    parser.add_argument(
        "--pool", type=int, default=128, help="PPO / T-PPO responses in flight (rollout.prompts_per_step)"
    )
    parser.add_argument("--eval-minutes", type=float, default=2.0)
    parser.add_argument("--arms", default="DAPO,PPO,T-PPO", help=f"of {', '.join(ARMS)}")
    parser.add_argument("--out", default=str(ROOT / "runs" / "tppo-windows"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    results = {}
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"--arms: unknown arm {unknown[0]!r}; known: {', '.join(ARMS)}")
    configs = arm_configs(args.minutes, args.window, args.pool, args.eval_minutes, arms)
    for name, config in tqdm(configs.items(), desc=f"arms ({args.minutes:g} min each)", unit="arm"):
        folder = out / name
        rows, _ = run_dapo(name, config, folder)
        workers = [json.loads(line) for line in (folder / "run" / "workers.jsonl").read_text().splitlines() if line]
        r = results[name] = summarize(rows, workers)
        tqdm.write(
            f"{name:<6} {r['steps']} steps, {r['step_seconds']:.2f} s a step (generate {r['generate_seconds']:.2f}, "
            f"train {r['train_seconds']:.2f}), decode fill {r['decode_fill']:.0%}, utilization {r['utilization']:.0%}, "
            f"{r['responses_per_minute']:.0f} responses / min, {r['trained_tokens_per_minute']:.0f} tokens trained / "
            f"min; held-out {', '.join(f'{100 * a:.1f}% at {m:.1f} min' for _, m, a in r['curve'])}"
        )
    settings = {"minutes": args.minutes, "window": args.window, "pool": args.pool, "base": BASE}
    (out / "tppo_windows.json").write_text(json.dumps({"settings": settings, "arms": results}, indent=1) + "\n")
    plot(results, out / "tppo_windows.png")
    print(f"wrote {out / 'tppo_windows.json'} and {out / 'tppo_windows.png'}")
    if not {"PPO", "T-PPO"} <= set(results):
        return results
    ppo, tppo = results["PPO"], results["T-PPO"]
    target, ppo_minutes = ppo["curve"][-1][2], ppo["train_minutes"]
    print(
        f"base {ppo['curve'][0][2]:.1%}; final: "
        + ", ".join(f"{n} {r['curve'][-1][2]:.1%}" for n, r in results.items())
    )
    reached = time_to_reach(tppo["curve"], target)
    if reached is None:
        best = max(a for _, _, a in tppo["curve"])
        print(
            f"T-PPO did not reach PPO's final held-out accuracy ({target:.1%}) in {tppo['train_minutes']:.1f} min "
            f"(best {best:.1%}); PPO took {ppo_minutes:.1f} min (goal: 1.5x faster)"
        )
    else:
        print(
            f"T-PPO reached PPO's final held-out accuracy ({target:.1%}) in {reached:.1f} min of PPO's "
            f"{ppo_minutes:.1f} min: {ppo_minutes / max(reached, 1e-9):.2f}x (goal 1.5)"
        )
    return results


if __name__ == "__main__":
    main()
