"""The 671B DAPO step lever by lever (issue 48): from the layout shipped before the issue to the torch-engine config
of today, each bar a plan the code computes (allsync.plan, as `allsync plan` computes it), on 32, 48 and 64 H100s.

    python -m benchmarks.plan_levers [--gpus 32,48,64] [--gpu h100] [--seeds 5] [--png docs/plan_671b_levers.png]
                                     [--json FILE]

Stages, each adding one lever to the one before (DAPO's batch: 480 prompts at 48 GPUs, 512 elsewhere, x 16 samples;
responses lognormal, median 6,000 tokens, cap 20,480; half the groups kept; a 10% memory margin):
    shipped         recipes/configs/dapo_math_deepseek_v3_671b.yaml as shipped before the issue: vLLM with its own FP8
                    copy of the base, the trainer's frozen weights asleep in host memory while it generates
                    (--colocation sleep), each worker filling its own quota, each minibatch's rows where they were
                    generated (not run by the loop: vLLM's copy and the trainer's taking turns is not built)
    balanced        + optim.balance_ranks (lever 4: each minibatch's rows dealt over the workers by tokens)
    global fill     + algorithm.sampling_fill global (the workers fill the batch together)
    torch engine    one copy of the base (lever 1): the trainer's own model generates, EP 16 in lockstep over as many
                    full-length KV slots as fit (at most 64), its decode steps in fixed shapes as CUDA graphs
                    (rollout.decode_graphs; as measured on an H200, allsync.plan.torch_decode.GRAPHED_H200)
    engine logprobs + algorithm.old_logprobs engine (no old-logprob forward before the update)
    FP8 KV          + rollout.kv_cache_dtype fp8 (lever 3: more KV slots in the same memory); the engine then samples
                    from the rounded cache, so algorithm.old_logprobs engine is refused: recompute and algorithm.tis
    shared-outer    + lora.expert_layout shared_outer (lever 2: a smaller routed adapter, its gradients and AdamW
                    state leave room for more KV slots)
    latent kernel   + rollout.attention_kernel triton (moe_lora/latent_attention.py: each slot reads its own positions
                    of the FP8 latent as stored, not every slot up to the longest row's span through a bf16 copy;
                    as measured on an H200)
    streamed rounds + algorithm.sampling_rounds streamed (allsync/producers/streamed.py: dynamic sampling's next round
                    queued behind the last in the slots, so a step waits for one tail instead of one per round)
    paged KV        + rollout.kv_cache_tokens (64 slots sharing the KV room in pages of 64 positions, a row preempted
                    when they run out: as many rows at once as their real lengths fit, not as many as fit at full
                    length; moe_lora.kv_caches.SlotKVCache)
    128 slots       the same room shared by 128 slots (allsync.plan.search.PAGED_SLOTS: a decode step's weights read
                    for twice the rows, more preemptions): recipes/configs/dapo_math_deepseek_v3_671b_torch_engine.yaml
    FP8 GEMMs       + rollout.fp8_linear_kernel scaled_mm (quant.formats.fp8_gemm: the FP8 attention, shared experts
                    and dense MLP multiplied as FP8 GEMMs with V3's block scales as stored, without their bf16 copies;
                    their copies' cost taken off the step at the dequantizing step's measured factor: assumed)
    expert kernel   + rollout.frozen_expert_kernel triton (quant/fused_experts.py: the fixed-shape step's routed experts
                    read from their NF4 bytes, without a bf16 copy of every held expert), last: as measured on the
                    H200 it is slower than dequantizing, so the config leaves it off

What the next lever would need (not built; the kernels' speeds assumed, the plan computing the rest): the last
stage's layout priced again with the NF4 expert kernel at 2x its roofline, then the latent attention kernel at 3x
too, then both at their roofline (this layout's bound): WHAT_NEXT, `what_next` in FILE and a table of its own.

A stage whose layout does not fit its GPUs at the margin is still priced (as `allsync plan` prices it, "if it fit")
and marked; vLLM's layouts, whose generate phase has no KV room for one sequence inside the 10% margin, are priced
with the KV room a 5% margin leaves, as the shipped config was. The plan draws one step's response lengths and kept groups from a seeded generator; with half the groups
kept, whether two refill rounds are enough is close to a coin flip, so each stage is planned with --seeds draws
(Workload.seed 0, 1, ...) and reported as their mean and range. Writes the table (markdown), FILE (JSON) and the PNG: one waterfall per GPU count, the 1.5 h of the
all-sync LoRA report drawn across.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from allsync.config import load_config_for_planning
from allsync.config.algorithm import TISSection
from allsync.plan.activations import RunTraces
from allsync.plan.command import kept_share
from allsync.plan.estimate import colocated_steps
from allsync.plan.generation import Workload
from allsync.plan.fit import Layout, plan_run
from allsync.plan.hardware import hardware
from allsync.plan.lengths import DEFAULT_LENGTHS, parse_lengths
from allsync.plan.schedules import mean_over_draws
from allsync.engines.torch_engine import DEFAULT_DECODE_BATCH
from allsync.plan.search import PAGED_SLOTS, planned_with_slots
from allsync.plan.torch_decode import GRAPHED_H200, GraphedDecodeFactors
from allsync.plan.shapes import DEEPSEEK_V3
from benchmarks.plan_671b import CONFIG as VLLM_CONFIG
from benchmarks.plan_671b import DAPO_PROMPTS
from quant.checkpoint_io import atomic_write_text

TARGET_HOURS = 1.5  # the all-sync LoRA report's step on 48 H100


def _set(run, section: str, **values):
    return replace(run, **{section: replace(getattr(run, section), **values)})


def shipped(run):
    """The vLLM config as shipped before issue 48: each worker fills its own quota, rows trained where generated."""
    run = _set(run, "algorithm", sampling_fill="worker", old_logprobs="recompute")
    return _set(run, "optim", balance_ranks=False)


# (name, what the stage changes, its colocation): each stage applies its change to the stage before
STAGES = [
    ("shipped", shipped, "sleep"),
    ("balanced", lambda run: _set(run, "optim", balance_ranks=True), "sleep"),
    ("global fill", lambda run: _set(run, "algorithm", sampling_fill="global"), "sleep"),
    (
        "torch engine",
        lambda run: _set(run, "rollout", engine="torch", decode_graphs=True, decode_batch=None, merge_lora=False),
        "resident",
    ),
    ("engine logprobs", lambda run: _set(run, "algorithm", old_logprobs="engine"), "resident"),
    (
        "FP8 KV",  # sampling from the rounded cache: old logprobs recomputed again (engine's refused), TIS
        lambda run: _set(
            _set(run, "rollout", kv_cache_dtype="fp8", decode_batch=None),
            "algorithm",
            old_logprobs="recompute",
            tis=TISSection(),
        ),
        "resident",
    ),
    ("shared-outer LoRA", lambda run: _set(run, "lora", expert_layout="shared_outer"), "resident"),
    ("latent kernel", lambda run: _set(run, "rollout", attention_kernel="triton"), "resident"),
    ("streamed rounds", lambda run: _set(run, "algorithm", sampling_rounds="streamed"), "resident"),
    ("paged KV", lambda run: run, "resident"),  # planned_with_slots pages the slots from here on
    ("128 slots", lambda run: run, "resident"),  # and gives them PAGED_SLOTS[1] slots from here on
    ("FP8 GEMMs", lambda run: _set(run, "rollout", fp8_linear_kernel="scaled_mm"), "resident"),
    ("expert kernel", lambda run: _set(run, "rollout", frozen_expert_kernel="triton"), "resident"),
]
PAGED_FROM = "paged KV"
# what-ifs after the last stage: (label, the NF4 expert kernel's weights factor, the latent kernel's cache factor);
# None keeps the H200's measured one
WHAT_NEXT = [
    ("NF4 expert kernel at 2x its roofline (assumed)", 2.0, None),
    ("+ latent attention kernel at 3x its roofline (assumed)", 2.0, 3.0),
    ("both kernels at their roofline (this layout's bound)", 1.0, 1.0),
]
MORE_SLOTS_FROM = "128 slots"


SHIPPED_MARGIN = 0.05  # vLLM's layouts: at the 10% margin its generate phase has no KV room for one sequence


def stage_plan(
    run, gpus: int, colocation: str, hw, traces, works: list[Workload], paged: bool, slots: int = DEFAULT_DECODE_BATCH
) -> dict:
    """One stage on `gpus` GPUs at the config's expert parallelism: its fit and its all-sync step for each of `works`
    (draws of one step's lengths and kept groups; the torch engine's KV slots as many full-length ones as fit, at
    most DEFAULT_DECODE_BATCH, or with `paged` that many sharing the KV room in pages:
    allsync.plan.search.planned_with_slots, as `allsync plan --search` gives them)."""
    layout = Layout(
        gpus, run.parallel.expert_parallel, hw.memory_bytes, colocation, 1024, hw.host_link_bytes_per_second
    )
    run, plan = planned_with_slots(run, DEEPSEEK_V3, layout, traces, paged, slots)
    fits = plan.fits
    if plan.kv_cache_tokens < plan.sequence_tokens and run.rollout.engine == "vllm":
        layout = replace(layout, margin=SHIPPED_MARGIN)  # priced as it was shipped; it still does not fit
        plan = plan_run(run, DEEPSEEK_V3, layout, traces)
    if plan.kv_cache_tokens < plan.sequence_tokens:
        return {"fits": False, "step_seconds": None, "problems": plan.problems, "margin": layout.margin}
    step = mean_over_draws([colocated_steps(run, DEEPSEEK_V3, layout, plan, hw, work) for work in works])[0]
    return {
        "fits": fits,
        "margin": layout.margin,
        "problems": plan.problems,
        "step_seconds": step.seconds,
        "step_seconds_per_seed": step.per_draw,
        "parts": step.parts,
        "note": step.note,
        "train_bytes": plan.train_bytes,
        "decode_batch": run.rollout.decode_batch if run.rollout.engine == "torch" else None,
        "kv_cache_tokens": run.rollout.kv_cache_tokens,
    }


def assumed_kernels(expert_factor: float, latent_factor: float | None) -> GraphedDecodeFactors:
    """The H200's graphed-step factors with the NF4 expert kernel's weights factor `expert_factor` at every row count
    and, unless None, the latent attention kernel's cache factor `latent_factor`."""
    weights = {**GRAPHED_H200.weights, ("nf4", "triton"): ((32, expert_factor), (256, expert_factor))}
    kv = GRAPHED_H200.kv if latent_factor is None else {**GRAPHED_H200.kv, "triton": latent_factor}
    return GraphedDecodeFactors(weights, kv)


def start(gpus: int, lengths, seeds: int):
    """(the shipped config at DAPO's prompts for `gpus`, its traces, `seeds` draws of one step's work)."""
    run, _ = load_config_for_planning(VLLM_CONFIG)
    prompts = DAPO_PROMPTS if DAPO_PROMPTS % gpus == 0 else run.rollout.prompts_per_step
    run = _set(run, "rollout", prompts_per_step=prompts)
    works = [Workload(lengths, 1024, kept_share(run, None), seed=seed) for seed in range(seeds)]
    return run, RunTraces.of(run, DEEPSEEK_V3), works


def staged_runs(run):
    """Each stage of STAGES in turn: (its name, its colocation, the run with its lever and every one before, whether
    its KV slots share the room in pages, how many slots)."""
    paged, slots = False, DEFAULT_DECODE_BATCH
    for name, change, colocation in STAGES:
        run = change(run)
        paged = paged or name == PAGED_FROM
        slots = PAGED_SLOTS[1] if name == MORE_SLOTS_FROM else slots
        yield name, colocation, run, paged, slots


def what_next(gpus: int, hw, lengths, seeds: int) -> list[dict]:
    """The last stage's layout (every lever of STAGES) with each of WHAT_NEXT's kernel speeds."""
    run, traces, works = start(gpus, lengths, seeds)
    *_, (_, colocation, last, paged, slots) = staged_runs(run)
    return [
        {"stage": label, "expert_factor": expert, "latent_factor": latent}
        | stage_plan(
            last,
            gpus,
            colocation,
            replace(hw, decode_factors=assumed_kernels(expert, latent)),
            traces,
            works,
            paged,
            slots,
        )
        for label, expert, latent in WHAT_NEXT
    ]


def waterfall(gpus: int, hw, lengths, seeds: int) -> list[dict]:
    run, traces, works = start(gpus, lengths, seeds)
    prompts = run.rollout.prompts_per_step
    return [
        {"stage": name, "colocation": colocation, "prompts": prompts}
        | stage_plan(staged, gpus, colocation, hw, traces, works, paged, slots)
        for name, colocation, staged, paged, slots in staged_runs(run)
    ]


def cell(stage: dict) -> str:
    if stage["step_seconds"] is None:
        return "no room for one sequence"
    per_seed = stage["step_seconds_per_seed"]
    text = f"{stage['step_seconds'] / 3600:.2f} h ({min(per_seed) / 3600:.2f}-{max(per_seed) / 3600:.2f})"
    if stage["fits"]:
        return text
    return text + (
        f" (does not fit; KV room at a {stage['margin']:.0%} margin)" if stage["margin"] < 0.1 else " (does not fit)"
    )


def plot(results: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.5), sharey=True, squeeze=False)
    for ax, (gpus, stages) in zip(axes[0], results.items()):
        previous = None
        for i, stage in enumerate(stages):
            hours = stage["step_seconds"] / 3600 if stage["step_seconds"] is not None else None
            if hours is None:
                ax.text(i, 0.2, "no room", ha="center", rotation=90)
                continue
            low, high = (0, hours) if previous is None else sorted((previous, hours))
            color = "tab:gray" if previous is None else ("tab:green" if hours <= previous else "tab:red")
            ax.bar(i, max(high - low, 0.03), bottom=low, color=color, hatch=None if stage["fits"] else "//")
            spread = [s / 3600 for s in stage["step_seconds_per_seed"]]
            ax.errorbar(i, hours, yerr=[[hours - min(spread)], [max(spread) - hours]], color="black", capsize=3)
            ax.text(i, high + 0.1, f"{hours:.2f}", ha="center", fontsize=8)
            previous = hours
        ax.axhline(TARGET_HOURS, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(stages)), [s["stage"] for s in stages], rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{gpus} H100 ({stages[0]['prompts']} prompts x 16)")
    axes[0][0].set_ylabel("step (h): mean, range of the draws")
    fig.suptitle("DeepSeek-V3 671B DAPO step, lever by lever (allsync plan; hatched: does not fit at the 10% margin)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="32,48,64")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--seeds", type=int, default=5, help="draws of one step's lengths and kept groups")
    parser.add_argument("--png", default="docs/plan_671b_levers.png")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    hw = hardware(args.gpu)
    lengths = parse_lengths(DEFAULT_LENGTHS)
    counts = [int(g) for g in args.gpus.split(",")]
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: must be >= 1")
    results = {g: waterfall(g, hw, lengths, args.seeds) for g in tqdm(counts, desc="GPU counts", unit="waterfall")}
    print(f"| stage | {' | '.join(f'{g} GPUs' for g in counts)} |")
    print("|---" * (len(counts) + 1) + "|")
    for i, (name, _, _) in enumerate(STAGES):
        print(f"| {name} | {' | '.join(cell(results[g][i]) for g in counts)} |")
    plot(results, Path(args.png))
    after = {g: what_next(g, hw, lengths, args.seeds) for g in tqdm(counts, desc="what next", unit="GPU count")}
    print(f"\n| after the last stage, not built | {' | '.join(f'{g} GPUs' for g in counts)} |")
    print("|---" * (len(counts) + 1) + "|")
    for i, (label, _, _) in enumerate(WHAT_NEXT):
        print(f"| {label} | {' | '.join(cell(after[g][i]) for g in counts)} |")
    out = {
        "hardware": hw.name,
        "lengths": lengths.description,
        "seeds": args.seeds,
        "stages": {str(g): s for g, s in results.items()},
        "what_next": {str(g): s for g, s in after.items()},
    }
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
