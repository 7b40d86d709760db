"""`allsync plan --search`: every layout of a config on N GPUs that fits, ranked by the estimated step time.

Enumerated:
    engines                                        the config's and the other (torch: the trainer's own model, one
                                                   copy of the base, with and without rollout.decode_graphs, its
                                                   rollout.decode_batch or 64 KV slots, sharing the KV room in
                                                   pages where 64 rows at full length do not fit,
                                                   its KV cache in the compute dtype and in FP8
                                                   (rollout.kv_cache_dtype); vLLM: its own copy or the trainer's
                                                   tensors)
    colocated (all-sync, and all-sync + overlap)   expert-parallel size k dividing both N and n_routed_experts;
                                                   colocation resident / sleep / shared (vLLM; the torch engine
                                                   generates with the trainer's weights)
    split (disaggregated, one-step-off)            generators G_gen in whole nodes (single GPUs below two nodes),
                                                   their expert parallelism k_gen; trainers N - G_gen at the
                                                   smallest expert parallelism whose train phase fits
A layout fits when fit.plan_run's verdict is "fits" (colocated), or when the generators hold the engine and one
full-length sequence of KV cache and the trainers' train phase fits their memory (split). Not searched: pipeline
stages (the trainer has none) and engine tensor parallelism (vLLM's external-launcher world is the trainer's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from allsync.config.checks import sampler_unlike_trainer
from allsync.engines.torch_engine import DEFAULT_DECODE_BATCH
from allsync.plan.activations import RunTraces
from allsync.plan.estimate import colocated_steps, split_steps
from allsync.plan.generation import Workload, generator_bytes
from allsync.plan.fit import (
    COLOCATIONS,
    Layout,
    engine_expert_parallel,
    engine_extra_bytes,
    kv_bytes_per_token,
    plan_run,
    tokens_per_forward,
)
from allsync.plan.hardware import Hardware
from allsync.plan.schedules import StepTime
from allsync.plan.weights import critic_bytes, trainer_bytes


COLOCATION_NOT_BUILT = {
    "sleep": "vLLM's level-1 sleep with the trainer's frozen weights in host memory while vLLM generates",
    "shared": "vLLM reading the trainer's frozen tensors",
}


def missing_wiring(run, gpus: int, gpus_per_node: int, expert_parallel: int, layout: str) -> str | None:
    """What the loop's config checker refuses in `run` laid out this way (None: it runs today)."""
    from allsync.config import ConfigError, validate

    nodes = gpus // gpus_per_node if gpus % gpus_per_node == 0 else 1
    parallel = replace(
        run.parallel, nodes=nodes, workers_per_node=gpus // nodes, expert_parallel=expert_parallel, layout=layout
    )
    try:
        validate(replace(run, parallel=parallel), "", this_machine=False)
    except ConfigError as exc:
        return str(exc).removeprefix(": ").split(" (`allsync plan")[0]
    return None


def not_built(run, step: StepTime, layout: dict, gpus_per_node: int) -> list[str]:
    """What of a candidate the loop does not run today: its schedule, its colocation, or what the config checker
    refuses in the config laid out this way."""
    out = [] if step.built else [f"the {step.schedule} schedule"]
    if layout.get("colocation") in COLOCATION_NOT_BUILT and run.rollout.engine == "vllm":
        out.append(COLOCATION_NOT_BUILT[layout["colocation"]])
    if "generators" in layout:
        if layout["generators"] != layout["trainers"]:
            out.append("an uneven split (parallel.layout disaggregated halves the workers)")
        halves = 2 * layout["trainers"]  # the loop's disaggregated layout: as many generators as trainers
        refusal = missing_wiring(run, halves, gpus_per_node, layout["trainer_expert_parallel"], "disaggregated")
    else:
        refusal = missing_wiring(run, layout["gpus"], gpus_per_node, layout["expert_parallel"], "colocated")
    return out + ([refusal] if refusal else [])


@dataclass
class Candidate:
    step: StepTime
    layout: dict  # what distinguishes it: gpus, expert parallelism, colocation or the split
    memory: dict = field(default_factory=dict)  # peak bytes per GPU (per side when split), KV room in sequences
    not_built: list[str] = field(default_factory=list)  # what the loop does not run today (empty: it runs)

    @property
    def label(self) -> str:
        lay = self.layout
        offload = ", activations offloaded" if lay["activation_offload"] else ""
        if "generators" in lay:
            return (
                f"engine {lay['engine']}, {lay['generators']} generate (EP {lay['generator_expert_parallel']}) + "
                f"{lay['trainers']} train "
                f"(EP {lay['trainer_expert_parallel']}{offload})"
            )
        fp8 = ", FP8" if lay.get("kv_cache") == "fp8" else ""
        paged = f" sharing {lay['kv_cache_tokens']:,} tokens" if lay.get("kv_cache_tokens") else ""
        slots = f" ({lay['decode_batch']} KV slots{paged}{fp8})" if lay.get("decode_batch") else ""
        engine_ep = f" (engine EP {lay['engine_expert_parallel']})" if lay.get("engine_expert_parallel") else ""
        return (
            f"engine {lay['engine']}{slots}, EP {lay['expert_parallel']}{engine_ep}, colocation {lay['colocation']}"
            f"{offload}"
        )

    def to_json(self) -> dict:
        return {**self.step.to_json(), "layout": self.layout, "memory": self.memory, "not_built": self.not_built}


def divisors(n: int, experts: int) -> list[int]:
    """Expert-parallel sizes for n GPUs: the divisors of gcd(n, experts)."""
    g = math.gcd(n, experts)
    return [k for k in range(1, g + 1) if g % k == 0]


# slots sharing the KV room in pages that the search tries: more rows a decode step spread its weights' reads over
# (as measured, a graphed step at 256 rows takes 1.24x one at 32), and more preemptions when the rows outgrow the room
PAGED_SLOTS = (DEFAULT_DECODE_BATCH, 2 * DEFAULT_DECODE_BATCH)


def planned_with_slots(
    run, model_config, layout: Layout, traces: RunTraces, paged: bool = True, slots: int = DEFAULT_DECODE_BATCH
):
    """(run, its plan on `layout`): the torch engine without rollout.decode_batch gets DEFAULT_DECODE_BATCH slots,
    each with room for a row at full length where that many fit, else `slots` slots sharing the generate phase's KV
    room in pages (rollout.kv_cache_tokens, whole pages; at least 1 slot where not one row fits); not `paged`: as
    many full-length slots as fit, at most DEFAULT_DECODE_BATCH (at least 1). Any other run as it is."""
    from moe_lora.kv_caches import KV_PAGE_TOKENS

    plan = plan_run(run, model_config, layout, traces)
    r = run.rollout
    if r.engine == "torch" and r.decode_batch is None:
        full_length = min(DEFAULT_DECODE_BATCH, plan.sequences_at_once)  # slots that fit at full length
        room = plan.kv_cache_tokens // KV_PAGE_TOKENS * KV_PAGE_TOKENS  # whole pages
        if r.kv_cache_tokens is not None:
            r = replace(r, decode_batch=slots)
        elif full_length >= min(DEFAULT_DECODE_BATCH, plan.sequences) or not paged:
            r = replace(r, decode_batch=max(full_length, 1))  # every row this GPU decodes at once fits unpaged
        elif room >= plan.sequence_tokens + KV_PAGE_TOKENS:
            r = replace(r, decode_batch=slots, kv_cache_tokens=room)
        else:
            r = replace(r, decode_batch=max(full_length, 1))
        run = replace(run, rollout=r)
        plan = plan_run(run, model_config, layout, traces)
    return run, plan


def engine_spans(vllm: bool, gpus: int, expert_parallel: int, colocation: str) -> tuple[bool, ...]:
    """rollout.engine_expert_parallel values a colocated layout can run with: vLLM one engine per worker (every
    expert in each: only without trainer expert parallelism, or reading the trainer's tensors, colocation shared)
    and one engine over all the GPUs (experts over every one); the torch engine has no such setting."""
    if not vllm:
        return (False,)
    per_worker = (False,) if expert_parallel == 1 or colocation == "shared" else ()
    return per_worker + ((True,) if gpus > 1 and colocation != "shared" else ())


def colocated(config_run, model_config, hw: Hardware, gpus: int, traces: RunTraces, work: Workload, base: Layout):
    """(candidates, refusals): every expert-parallel size and colocation on `gpus` GPUs."""
    found, refused = [], []
    vllm, experts = config_run.rollout.engine == "vllm", model_config["n_routed_experts"]
    colocations = COLOCATIONS if vllm else ("resident",)
    for ep, colocation, engine_wide in (
        (ep, c, w) for ep in divisors(gpus, experts) for c in colocations for w in engine_spans(vllm, gpus, ep, c)
    ):
        run = config_run
        if vllm:
            run = replace(run, rollout=replace(run.rollout, engine_expert_parallel=engine_wide))
        layout = replace(base, gpus=gpus, expert_parallel=ep, colocation=colocation)
        engine_ep = engine_expert_parallel(run, layout)
        label = f"EP {ep}" + (f" (engine EP {engine_ep})" if vllm else "") + f", colocation {colocation}"
        for slots in PAGED_SLOTS:  # more slots than the default only where they share the room in pages
            here, plan = planned_with_slots(run, model_config, layout, traces, slots=slots)
            paged = here.rollout.kv_cache_tokens is not None and run.rollout.decode_batch is None
            if not plan.fits:
                if slots == DEFAULT_DECODE_BATCH:
                    refused.append((label, plan.problems[0]))
            else:
                memory = {"peak_bytes": plan.total_bytes, "sequences_in_kv": plan.sequences_at_once}
                described = {
                    "engine": run.rollout.engine,
                    "decode_batch": here.rollout.decode_batch if run.rollout.engine == "torch" else None,
                    "kv_cache_tokens": here.rollout.kv_cache_tokens,
                    "kv_cache": run.rollout.kv_cache_dtype,
                    "gpus": gpus,
                    "expert_parallel": ep,
                    "engine_expert_parallel": engine_ep if vllm else None,
                    "colocation": colocation,
                    "activation_offload": run.optim.activation_offload,
                }
                for step in colocated_steps(here, model_config, layout, plan, hw, work):
                    found.append(Candidate(step, described, memory, not_built(here, step, described, hw.gpus_per_node)))
            if not paged:
                break
    return found, refused


def trainer_peak(run, model_config, expert_parallel: int, traces: RunTraces, tokens: int) -> tuple[int, int]:
    """(a training GPU's peak bytes: resident trainer, critic and activations at `tokens` per forward; the
    activations it offloads to host memory)."""
    activations, offloaded = traces.activations(model_config, tokens, run.optim, expert_parallel)
    resident = sum(trainer_bytes(run, model_config, expert_parallel).values())
    return resident + sum(critic_bytes(run, model_config).values()) + activations, offloaded


def split(run, model_config, hw: Hardware, gpus: int, traces: RunTraces, work: Workload, base: Layout):
    """(candidates, refusals): every split of `gpus` into generators and trainers (module docstring), each side's
    peak inside the GPU's memory less base.margin of it."""
    found, refused = [], []
    usable = base.usable_bytes
    r, experts = run.rollout, model_config["n_routed_experts"]
    unit = hw.gpus_per_node if gpus >= 2 * hw.gpus_per_node else 1
    sequence_tokens = work.prompt_tokens + r.max_new_tokens
    kv_token = kv_bytes_per_token(model_config, r.engine, r.kv_cache_dtype)
    for gen_gpus in range(unit, gpus, unit):
        train_gpus = gpus - gen_gpus
        if r.prompts_per_step % gen_gpus:
            refused.append((f"{gen_gpus} generate", f"{r.prompts_per_step} prompts do not split over {gen_gpus} GPUs"))
            continue
        sequences = r.prompts_per_step * r.group_size // train_gpus + 1
        tokens = tokens_per_forward(run, sequences, sequence_tokens)
        o = run.optim
        train_fit = (
            (k, total, offloaded)
            for k in divisors(train_gpus, experts)
            for total, offloaded in [trainer_peak(run, model_config, k, traces, tokens)]
            if total <= usable
        )
        train_ep, train_total, offloaded = next(train_fit, (None, None, 0))  # the smallest EP size that fits
        if train_ep is None:
            refused.append((f"{train_gpus} train", "the train phase does not fit at any expert-parallel size"))
            continue
        own_copy = r.engine == "vllm"
        for gen_ep in divisors(gen_gpus, experts):
            parts = None if own_copy else trainer_bytes(run, model_config, gen_ep)
            generator = generator_bytes(model_config, gen_ep, own_copy, parts)
            weights = sum(generator.values()) + (0 if own_copy else parts["lora"])  # the torch engine's LoRA too
            if own_copy:  # vLLM's absorbed-MLA copies, LoRA slot, buffers and the reserve it leaves free
                weights += sum(engine_extra_bytes(run, model_config, gen_ep).values())
            kv_tokens = (hw.memory_bytes - weights) // kv_token
            label = f"{gen_gpus} generate (EP {gen_ep}) + {train_gpus} train"
            if weights + sequence_tokens * kv_token > usable:
                refused.append((label, f"the generators' weights leave KV room for {max(kv_tokens, 0):,} tokens"))
                continue
            layout = {
                "engine": r.engine,
                "gpus": gpus,
                "generators": gen_gpus,
                "generator_expert_parallel": gen_ep,
                "trainers": train_gpus,
                "trainer_expert_parallel": train_ep,
                "activation_offload": o.activation_offload,
            }
            memory = {
                "generator_weights_bytes": weights,
                "generator_kv_tokens": kv_tokens,
                "trainer_peak_bytes": train_total,
            }
            steps = split_steps(
                run,
                model_config,
                hw,
                gen_gpus,
                gen_ep,
                generator,
                kv_tokens,
                train_gpus,
                train_ep,
                work,
                offloaded / tokens,
            )
            for step in steps:
                found.append(Candidate(step, layout, memory, not_built(run, step, layout, hw.gpus_per_node)))
    return found, refused


ENGINES = ("torch", "vllm")
KV_CACHES = {"torch": ("auto", "fp8"), "vllm": ("auto",)}  # rollout.kv_cache_dtype each engine takes


def with_engine(run, engine: str, kv_cache_dtype: str | None = None):
    """`run` generating with `engine`: the other engine's own settings back to their defaults (the torch engine's
    decode_batch, kv_cache_tokens, decode_graphs, merge_lora, kv_cache_dtype and algorithm.old_logprobs engine; vLLM's
    gpu_memory_utilization and sync_probe_tolerance); kv_cache_dtype given: that KV cache (the torch engine's)."""
    r, algorithm = run.rollout, run.algorithm
    if engine == "vllm" and engine != r.engine:
        r = replace(
            r,
            engine=engine,
            decode_batch=None,
            kv_cache_tokens=None,
            decode_graphs=False,
            merge_lora=False,
            kv_cache_dtype="auto",
        )
        algorithm = replace(algorithm, old_logprobs="recompute")  # only the torch engine's are the trainer's
    elif engine != r.engine:
        r = replace(r, engine=engine, gpu_memory_utilization=None, sync_probe_tolerance=None)
    if kv_cache_dtype is not None and kv_cache_dtype != r.kv_cache_dtype:
        # another cache holds another number of tokens: rollout.decode_batch and kv_cache_tokens as planned_with_slots
        r = replace(r, kv_cache_dtype=kv_cache_dtype, decode_batch=None, kv_cache_tokens=None)
    if algorithm.old_logprobs == "engine" and sampler_unlike_trainer(r):  # refused by the checker: recompute
        algorithm = replace(algorithm, old_logprobs="recompute")
    return run if r is run.rollout and algorithm is run.algorithm else replace(run, rollout=r, algorithm=algorithm)


def search(run, model_config, hw: Hardware, gpus: int, traces: RunTraces, work: Workload, base: Layout):
    """(every feasible candidate, fastest first; the refusals (label, reason)): both engines (the config's, and the
    other with its own settings at their defaults; the torch engine with each KV cache), with and without activation
    offload."""
    found, refused = [], []
    kinds = [
        (e, kv, offload, kind)
        for e in ENGINES
        for kv in KV_CACHES[e]
        for offload in (False, True)
        for kind in (colocated, split)
    ]
    for engine, kv, offload, kind in tqdm(kinds, desc="layouts", unit="kind"):
        variant = replace(with_engine(run, engine, kv), optim=replace(run.optim, activation_offload=offload))
        f, r = kind(variant, model_config, hw, gpus, traces, work, base)
        found += f
        engine_label = f"engine {engine}" + (" (FP8 KV)" if kv == "fp8" else "")
        refused += [
            (f"{engine_label}, {label}" + (", activations offloaded" if offload else ""), why) for label, why in r
        ]
    # ties (e.g. training hidden behind generation either way) go to the simpler layout: no offload
    return sorted(found, key=lambda c: (round(c.step.seconds), c.layout["activation_offload"])), refused


def why_faster(a: Candidate, b: Candidate) -> str:
    """Why `a` beats the next-ranked `b`: what differs between them, and the step-time part that differs most."""
    keys = set(a.step.parts) | set(b.step.parts)
    key = max(keys, key=lambda k: abs(b.step.parts.get(k, 0.0) - a.step.parts.get(k, 0.0)))
    differs = [] if a.step.schedule == b.step.schedule else [f"{a.step.schedule} instead of {b.step.schedule}"]
    if a.label != b.label:
        differs.append(f"{a.label} instead of {b.label}")
    gain = b.step.seconds - a.step.seconds
    if gain < 0.5:
        return f"as fast as the next ({'; '.join(differs) or 'same layout'}), ranked first for being simpler"
    return (
        f"{gain:,.0f} s faster than the next ({'; '.join(differs) or 'same layout'}): "
        f"{key} {a.step.parts.get(key, 0.0):,.0f} s against {b.step.parts.get(key, 0.0):,.0f} s"
    )


def format_search(ranked: list[Candidate], refused: list[tuple[str, str]], gpus: int, top: int = 5) -> str:
    """The top `top` layouts with why each beats the next, the best of each schedule, and what did not fit."""
    from allsync.plan.schedules import SCHEDULES

    lines = [
        f"layouts of this config on {gpus} GPUs that fit: {len(ranked)}, fastest first (estimated on the first draw of "
        "the step's lengths and kept groups):"
    ]
    for i, c in enumerate(ranked[:top]):
        built = f" (not built: {'; '.join(c.not_built)})" if c.not_built else " (runs today)"
        built += f" ({c.step.note})" if c.step.note else ""
        parts = ", ".join(f"{k} {v:,.0f} s" for k, v in c.step.parts.items() if v >= 0.5)
        lines.append(
            f"{i + 1}. {c.step.schedule}, {c.label}: {c.step.seconds / 3600:.2f} h per step, "
            f"{c.step.idle_fraction:.0%} of GPU time idle ({parts}){built}"
        )
        if i + 1 < len(ranked):
            lines.append(f"   {why_faster(c, ranked[i + 1])}")
    runs_today = next((c for c in ranked if not c.not_built), None)
    lines.append(
        "fastest layout the loop runs today: "
        + (
            f"{runs_today.step.schedule}, {runs_today.label}, {runs_today.step.seconds / 3600:.2f} h"
            + (f" ({runs_today.step.note})" if runs_today.step.note else "")
            if runs_today
            else "none"
        )
    )
    lines.append("best layout of each schedule:")
    for schedule in SCHEDULES:
        best = next((c for c in ranked if c.step.schedule == schedule), None)
        text = (
            "no layout fits"
            if best is None
            else (f"{best.step.seconds / 3600:.2f} h per step, {best.step.idle_fraction:.0%} idle ({best.label})")
        )
        lines.append(f"  {schedule:<20}{text}")
    colocated_refusals = {}  # the largest expert-parallel size of each engine, colocation (and offload) not fitting
    for label, why in refused:
        engine, rest = label.split(", ", 1)
        if rest.startswith("EP "):
            colocated_refusals[(engine, rest.split(", ", 1)[1])] = (label, why)
    if refused:
        lines.append(
            f"did not fit: {len(refused)} layouts; all-sync at the largest expert-parallel size of each colocation:"
        )
        lines += [f"  {label}: {why}" for label, why in colocated_refusals.values()]
    return "\n".join(lines)
