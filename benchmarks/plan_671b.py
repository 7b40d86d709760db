"""DeepSeek-V3 671B with the DAPO config on 16, 32, 48 and 64 H100s: `allsync plan --search` for each, as a table
and a plot of the estimated step time per schedule (computed, nothing runs on GPUs).

    python -m benchmarks.plan_671b [--gpus 16,32,48,64] [--gpu h100] [--expert-layout per_expert]
                                   [--png docs/plan_671b.png] [--json FILE]

--expert-layout shared_outer plans the config with lora.expert_layout shared_outer (its smaller routed adapter).

DAPO's batch is 512 prompts x 16 samples; 512 prompts do not split over 48 GPUs, so 48 GPUs plan the config's 480.
Per GPU count it prints the fastest layout of each schedule, and the fastest all-sync layout the loop runs today.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from allsync.config import load_config_for_planning
from allsync.plan.activations import RunTraces
from allsync.plan.command import kept_share
from allsync.plan.estimate import ATTENTION_KERNEL, EXPERT_KERNEL, FP8_GEMM, GRAPHS, schedule_with
from allsync.plan.generation import Workload
from allsync.plan.fit import Layout
from allsync.plan.hardware import hardware
from allsync.plan.lengths import DEFAULT_LENGTHS, parse_lengths
from allsync.plan.schedules import SCHEDULES
from allsync.plan.search import search
from allsync.plan.shapes import DEEPSEEK_V3

CONFIG = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
DAPO_PROMPTS = 512


def plan_gpus(run, gpus: int, hw, traces, work) -> dict:
    prompts = DAPO_PROMPTS if DAPO_PROMPTS % gpus == 0 else run.rollout.prompts_per_step
    run = replace(run, rollout=replace(run.rollout, prompts_per_step=prompts))
    base = Layout(gpus, 1, hw.memory_bytes, "resident", 1024, hw.host_link_bytes_per_second)
    ranked, _ = search(run, DEEPSEEK_V3, hw, gpus, traces, work, base)
    best = {name: next((c for c in ranked if chosen(c)), None) for name, chosen in COLUMNS.items()}
    return {
        "gpus": gpus,
        "prompts": prompts,
        "best": {name: (c.to_json() | {"label": c.label}) if c else None for name, c in best.items()},
        "runs_today": next((c.to_json() | {"label": c.label} for c in ranked if not c.not_built), None),
    }


def _engine(c) -> str:
    return c.layout["engine"]


# the table's columns: the fastest candidate of each schedule, all-sync apart per engine (vLLM's layouts are not
# wired in; the torch engine's run, eager as measured on an H200, and with rollout.decode_graphs, then the latent
# attention kernel, then the FP8 GEMMs, then the NF4 expert kernel added, as assumed: the chain
# allsync.plan.estimate.graphed_variants prices)
COLUMNS = {
    "all-sync, vLLM": lambda c: c.step.schedule == "all-sync" and _engine(c) == "vllm",
    "all-sync, torch engine": lambda c: c.step.schedule == "all-sync" and _engine(c) == "torch",
    "all-sync, torch engine + decode graphs": lambda c: c.step.schedule == schedule_with([GRAPHS]),
    "+ latent attention kernel": lambda c: c.step.schedule == schedule_with([GRAPHS, ATTENTION_KERNEL]),
    "+ FP8 GEMMs": lambda c: c.step.schedule == schedule_with([GRAPHS, ATTENTION_KERNEL, FP8_GEMM]),
    "+ NF4 expert kernel": lambda c: (
        c.step.schedule == schedule_with([GRAPHS, ATTENTION_KERNEL, FP8_GEMM, EXPERT_KERNEL])
    ),
    **{s: (lambda c, s=s: c.step.schedule == s) for s in SCHEDULES if s != "all-sync"},
}


def hours(entry: dict | None) -> str:
    return "does not fit" if entry is None else f"{entry['step_seconds'] / 3600:.2f} h ({entry['label']})"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in COLUMNS:
        points = [(r["gpus"], r["best"][name]["step_seconds"] / 3600) for r in results if r["best"][name]]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_yscale("log")
    ax.axhline(1.5, color="grey", linestyle="--", label="all-sync LoRA report: ~1.5 h")
    ax.set_xlabel("H100 GPUs")
    ax.set_ylabel("estimated hours per DAPO step")
    ax.set_title("DeepSeek-V3 671B, DAPO + LoRA: fastest layout that fits")
    ax.set_xticks([r["gpus"] for r in results])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="16,32,48,64")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--png", default="docs/plan_671b.png")
    parser.add_argument("--json")
    parser.add_argument("--expert-layout", choices=("per_expert", "shared_outer"), default="per_expert")
    args = parser.parse_args(argv)
    run, _ = load_config_for_planning(CONFIG)
    run = replace(run, lora=replace(run.lora, expert_layout=args.expert_layout))
    hw = hardware(args.gpu)
    traces = RunTraces.of(run, DEEPSEEK_V3)
    work = Workload(parse_lengths(DEFAULT_LENGTHS), 1024, kept_share(run, None))
    counts = [int(g) for g in args.gpus.split(",")]
    results = [plan_gpus(run, g, hw, traces, work) for g in tqdm(counts, desc="GPU counts", unit="plan")]
    print(f"| GPUs | prompts | {' | '.join(COLUMNS)} | runs in the loop today |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for r in results:
        cells = " | ".join(hours(r["best"][name]) for name in COLUMNS)
        print(f"| {r['gpus']} | {r['prompts']} | {cells} | {hours(r['runs_today']) if r['runs_today'] else 'none'} |")
    plot(results, Path(args.png))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
