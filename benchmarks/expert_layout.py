"""Per-expert against shared-outer routed-expert LoRA on the default job (issue 47): held-out accuracy over seeds.

    python -m benchmarks.expert_layout [--steps 600] [--seeds 0,1,2] [--arms per_expert,shared_outer,shared_outer_same_count]
                                       [--model default|two_moe_layers] [--out runs/expert-layout]

Each arm is `python recipes/dapo.py` on recipes/configs/tiny_cpu.yaml (the default model: one MoE layer of 4 routed
experts, NF4; its warm-started base, built once) with only lora changed. --model two_moe_layers runs the same on the
default model with one more layer (model.warm_start_shape {layers: 3}: a dense layer then two MoE layers of 4 experts,
its own base at runs/tiny-base-2moe, warm-started like the default's):

    per_expert               lora.expert_layout per_expert, rank 8 (the default)
    shared_outer             lora.expert_layout shared_outer, rank 8: A of gate/up and B of down shared by the experts
    shared_outer_same_count  shared_outer at the rank whose whole adapter comes nearest the per-expert rank-8 one's
                             parameter count (allsync.plan.weights.lora_values; run.export merged when vLLM would
                             not serve that rank)

run.seed takes each --seeds value (the adapter's start and the sampling). Runs go seed by seed, every arm of a seed
before the next seed, and OUT/expert_layout.json is rewritten after each; a run whose folder already holds its
final evaluation (an earlier, cut-off invocation's) is read back, not run again.
Reported per run: held-out avg@4 at every evaluation, the adapter's parameter count, the median s/step; per arm the
mean and spread of the final held-out accuracy. OUT/expert_layout.png: held-out accuracy over steps, every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from benchmarks.dapo_runs import finished_rows, plot_heldout, run_dapo

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
ARMS = ("per_expert", "shared_outer", "shared_outer_same_count")
# --model: the model section's changes from tiny_cpu.yaml's
MODELS = {
    "default": {},
    "two_moe_layers": {"base": "runs/tiny-base-2moe", "warm_start_shape": {"layers": 3}},
}


def adapter_values(config: dict, rank: int, layout: str) -> int:
    """The whole adapter's parameters for the default model (its base's config.json) at `rank` in `layout`."""
    from allsync.plan.weights import lora_values

    base_config = json.loads((ROOT / config["model"]["base"] / "config.json").read_text())
    return lora_values(base_config, rank, tuple(config["lora"]["targets"]), None, layout)


def same_count_rank(config: dict) -> int:
    """The shared_outer rank whose adapter's parameter count is nearest the per-expert default's."""
    target = adapter_values(config, config["lora"]["rank"], "per_expert")
    return min(range(1, 65), key=lambda r: abs(adapter_values(config, r, "shared_outer") - target))


def model_config(model: str) -> dict:
    """tiny_cpu.yaml with the model section of `model` (MODELS) and its base as an absolute path."""
    config = yaml.safe_load(CONFIG.read_text())
    config["model"].update(MODELS[model])
    config["model"]["base"] = str(ROOT / config["model"]["base"])
    return config


def build_base(model: str) -> None:
    """Warm-start the base of `model` once, before the arms (the same-count rank is read off its config.json)."""
    from allsync.config import parse_config
    from allsync.warm_start import settings_for_run, warm_start

    config = parse_config(model_config(model))
    warm_start(config.model.base, settings_for_run(config))


def arm_config(arm: str, steps: int, seed: int, model: str = "default") -> dict:
    from allsync.config import VLLM_LORA_RANKS

    config = model_config(model)
    layout = "per_expert" if arm == "per_expert" else "shared_outer"
    config["lora"]["expert_layout"] = layout
    if arm == "shared_outer_same_count":
        config["lora"]["rank"] = same_count_rank(config)
        config["lora"]["alpha"] = 2 * config["lora"]["rank"]  # the default's alpha / rank = 2
        if config["lora"]["rank"] not in VLLM_LORA_RANKS:
            config["run"]["export"] = "merged"
    config["run"].update(steps=steps, seed=seed, checkpoint_every=steps, time_limit_minutes=None)
    return config


def summarize(rows: list[dict], config: dict) -> dict:
    steps = [r for r in rows if "step_seconds" in r]
    return {
        "rank": config["lora"]["rank"],
        "adapter_values": adapter_values(config, config["lora"]["rank"], config["lora"]["expert_layout"]),
        "heldout": {r["step"]: r["heldout_accuracy"] for r in rows if "heldout_accuracy" in r},
        "seconds_per_step": statistics.median(r["step_seconds"] for r in steps[1:]) if len(steps) > 1 else None,
    }


def plot(results: dict, path: Path, model: str) -> None:
    colors = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:green")))
    where = "the default job" if model == "default" else "two MoE layers"
    title = f"Routed-expert LoRA layout on {where} (each line a seed)"
    plot_heldout(results["runs"], colors, {arm: arm for arm in ARMS}, title, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--model", default="default", choices=sorted(MODELS))
    parser.add_argument("--out", default="runs/expert-layout")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown arm {unknown[0]!r}; known: {', '.join(ARMS)}")
    if args.steps < 1:
        raise SystemExit(f"--steps: must be at least 1, got {args.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"steps": args.steps, "model": args.model, "runs": {}}
    build_base(args.model)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in arms:
            name = f"{arm} seed {seed}"
            config = arm_config(arm, args.steps, seed, args.model)
            print(f"{name}: rank {config['lora']['rank']}, {args.steps} steps ...", flush=True)
            rows = finished_rows(out / f"{arm}-s{seed}", args.steps)
            if rows is None:
                rows, last = run_dapo(name, config, out / f"{arm}-s{seed}")
            else:
                last = f"read back from {out / f'{arm}-s{seed}'}"
            results["runs"][name] = summarize(rows, config)
            print(f"  {last}", flush=True)
            (out / "expert_layout.json").write_text(json.dumps(results, indent=2) + "\n")
    results["arms"] = {}
    for arm in arms:
        finals = [
            r["heldout"][max(r["heldout"], key=int)] for n, r in results["runs"].items() if n.startswith(arm + " seed")
        ]
        results["arms"][arm] = {
            "final_mean": statistics.mean(finals),
            "final_min": min(finals),
            "final_max": max(finals),
        }
        print(
            f"{arm}: held-out {100 * statistics.mean(finals):.1f}% (seeds {', '.join(f'{100 * f:.1f}' for f in finals)})"
        )
    (out / "expert_layout.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "expert_layout.png", args.model)
    return results


if __name__ == "__main__":
    main()
