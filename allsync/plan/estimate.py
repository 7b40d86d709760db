"""A step's seconds for one layout: each GPU's sequences drawn from the response lengths, generated on a simulated
continuous-batching engine (generation.py), trained by the roofline of step_time.py (training.py), and put together
by each schedule of schedules.py; the engine's variants (decode graphs, kernels) priced side by side.

Per step and GPU (all-sync, colocated):
    sequences      q = rollout.prompts_per_step / GPUs prompts x rollout.group_size per sampling round
    rounds         dynamic sampling (`sampling_rounds`): each round generates q groups, each kept (a reward spread)
                   with probability --kept-groups, until the worker has kept q (algorithm.sampling_fill worker) or
                   the workers together have kept all (global), at most algorithm.max_sampling_rounds; the q first
                   kept groups train. Rounds run one after another, each to its own longest response; under expert
                   parallelism the ranks of an EP group decode in lockstep, so a round lasts as long as the group's
                   slowest rank, and with global filling every worker waits for every round
    generate       generation_timeline of each round with the generator's weights (vLLM's own copy, or the trainer's
                   frozen model for the torch engine and for colocation `shared`) and the plan's KV room
    train          train_phase: the kept sequences (prompt + response tokens) packed into forwards as the learner packs
                   them, at step_time.forward_seconds each, expert-parallel ranks in lockstep, plus one all-reduce of
                   the LoRA gradients (float32) per minibatch: the routed experts' over their GPUS / EP replicas,
                   the rest over all GPUs
    adapter sync   vLLM's load of the updated adapter, at the host-side rate measured by
                   benchmarks/vllm_adapter_sync.py (0.055 s for 199 MB); the torch engine shares the trainer's
    sleep          fit.Plan.sleep_seconds (colocation sleep)
Disaggregated and one-step-off split the GPUs: generators hold only the engine (more KV room), trainers only the
trainer; the adapter crosses the network to each generator and is loaded there.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from allsync.plan import schedules
from allsync.plan.fit import (
    Layout,
    Plan,
    decode_cache_is_expanded,
    engine_expert_parallel,
    kv_bytes_per_token,
    kv_step_bytes_per_token,
)
from allsync.plan.generation import (
    ADAPTER_LOAD_SECONDS_PER_BYTE,
    Workload,
    generate,
    generate_phase,
    generator_bytes,
    generator_cost,
    sampling_rounds,
)
from allsync.plan.hardware import Hardware
from allsync.plan.step_time import (
    DecodeCost,
)
from allsync.plan.training import grad_sync_seconds, train_phase
from allsync.plan.weights import (
    LORA_VALUE_BYTES,
    held_experts,
    lora_values,
    stored_plan,
)


GRAPHS = "rollout.decode_graphs"
ATTENTION_KERNEL = "rollout.attention_kernel triton"
EXPERT_KERNEL = "rollout.frozen_expert_kernel triton"
FP8_GEMM = "rollout.fp8_linear_kernel scaled_mm"


def schedule_with(keys: list[str]) -> str:
    """'all-sync with a, b and c': the all-sync schedule with the settings `keys` added to the config's."""
    return "all-sync with " + (" and ".join(keys) if len(keys) < 3 else ", ".join(keys[:-1]) + " and " + keys[-1])


def graphed_note(cost: DecodeCost) -> str:
    """What a fixed-shape step's price rests on (the note beside a schedule): the graphed step as measured on an H200,
    its time over the roofline of its weights and of its cache (torch_decode.GRAPHED_H200), or the roofline alone."""
    if cost.graphed is None:
        return "fixed-shape steps at their roofline (no measured factors)"
    (low, kv), (high, _) = cost.graphed_factors(0), cost.graphed_factors(float("inf"))
    reads = [
        "attention reading each slot's own positions as stored" if cost.own_positions else "",
        "the NF4 experts' stored bytes once, by their kernel" if cost.experts_read_once else "",
        "the FP8 linears by FP8 GEMMs, their copies' measured cost taken off (assumed)"
        if cost.fp8_linears_read_once
        else "",
    ]
    how = "; ".join(r for r in reads if r)
    return (
        f"graphed fixed-shape steps as measured on an H200{' (' + how + ')' if how else ''}: {low:.3g}-{high:.3g}x "
        f"the weights' roofline, {kv:.3g}x the cache's"
    )


def graphed_variants(run, model_config: dict, cost: DecodeCost) -> list[tuple[str, DecodeCost]]:
    """(schedule, cost) of the torch engine's decode with what `run` does not set yet, added one at a time:
    rollout.decode_graphs, then rollout.attention_kernel triton (where the slots hold the latent), then
    rollout.fp8_linear_kernel scaled_mm (where FP8 linears are held), then rollout.frozen_expert_kernel triton (NF4
    experts without double quantization); each priced as assumed."""
    r = run.rollout
    if r.engine != "torch":
        return []
    out, keys = [], []
    if not cost.fixed_shapes:
        cost = replace(cost, fixed_shapes=True)
        keys.append(GRAPHS)
        out.append((schedule_with(keys), cost))
    if not cost.own_positions and not decode_cache_is_expanded(model_config, r.engine, r.kv_cache_dtype):
        kv = kv_step_bytes_per_token(model_config, r.engine, r.kv_cache_dtype, "triton")
        cost = replace(cost, own_positions=True, kv_bytes_per_token=kv)
        keys.append(ATTENTION_KERNEL)
        out.append((schedule_with(keys), cost))
    if not cost.fp8_linears_read_once and cost.fp8_linear_params and not r.merge_lora:
        cost = replace(cost, fp8_linears_read_once=True)
        keys.append(FP8_GEMM)
        out.append((schedule_with(keys), cost))
    if not cost.experts_read_once and expert_kernel_reads(run):
        cost = replace(cost, experts_read_once=True)
        keys.append(EXPERT_KERNEL)
        out.append((schedule_with(keys), cost))
    return out


def expert_kernel_reads(run) -> bool:
    """quant.fused_experts' kernel can read the run's routed experts: NF4 without double quantization."""
    return run.model.quant.plan().format_of("routed_experts") == "nf4" and not run.model.quant.double_quant


def within_kv_room(run, plan: Plan) -> tuple[object, str | None]:
    """The torch engine's KV settings cut to what the plan's generate phase has room for, and what was cut (for the
    step's note): rollout.kv_cache_tokens to the room's whole pages, or full-length slots (no kv_cache_tokens) to
    the sequences that fit. A config that fits, or vLLM (it sizes its own cache), as given. Priced as given, such a
    config would be faster than what the loop can run (the plan says it does not fit)."""
    from moe_lora.kv_caches import KV_PAGE_TOKENS

    r = run.rollout
    if r.engine != "torch":
        return run, None
    if r.kv_cache_tokens is not None:
        room = plan.kv_cache_tokens // KV_PAGE_TOKENS * KV_PAGE_TOKENS
        if r.kv_cache_tokens <= room:
            return run, None
        cut = replace(r, kv_cache_tokens=max(room, plan.sequence_tokens + KV_PAGE_TOKENS))
        why = f"priced at the {cut.kv_cache_tokens:,} KV tokens there is room for, not rollout.kv_cache_tokens {r.kv_cache_tokens:,}"
        return replace(run, rollout=cut), why
    fit = max(plan.kv_cache_tokens // plan.sequence_tokens, 1)
    if r.decode_batch_size <= fit:
        return run, None
    why = f"priced at the {fit} full-length slots there is room for, not rollout.decode_batch {r.decode_batch_size}"
    return replace(run, rollout=replace(r, decode_batch=fit)), why


def colocated_steps(run, model_config: dict, layout: Layout, plan: Plan, hw: Hardware, work: Workload) -> list:
    """All-sync on the plan's layout, and all-sync with in-step overlap where both copies stay on the GPU. The torch
    engine's KV settings as the generate phase has room for (`within_kv_room`)."""
    run, cut = within_kv_room(run, plan)
    ep, gpus = layout.expert_parallel, layout.gpus
    own_copy = run.rollout.engine == "vllm" and layout.colocation != "shared"
    engine_ep = engine_expert_parallel(run, layout)  # the generator's group: the engine's, ranks in lockstep
    cost = generator_cost(
        run,
        model_config,
        hw,
        engine_ep,
        generator_bytes(model_config, engine_ep, own_copy, plan.per_gpu_bytes),
        own_copy,
    )
    if layout.colocation == "shared":
        routed_format = stored_plan(model_config).format_of("routed_experts")
    else:
        routed_format = run.model.quant.plan().format_of("routed_experts")
    sampling = sampling_rounds(run, gpus, work)
    per_token = plan.offloaded_bytes / plan.tokens_per_forward
    training = train_phase(run, model_config, hw, ep, routed_format, sampling.trained, work.prompt_tokens, per_token)
    grad_sync = run.optim.minibatches * grad_sync_seconds(run, model_config, hw, gpus, ep)
    train = training.busy + grad_sync
    trained = training.per_sequence
    fixed = {"sleep transfers": plan.sleep_seconds} if plan.sleep_seconds else {}
    if run.rollout.engine == "vllm":
        fixed["adapter sync"] = plan.per_gpu_bytes["lora"] * ADAPTER_LOAD_SECONDS_PER_BYTE
    gen = generate_phase(run, sampling, work, plan.kv_cache_tokens, cost, engine_ep)
    out = [schedules.all_sync(gen, train, fixed, training.wall + grad_sync)]
    if cost.fixed_shapes:
        out[0].note = graphed_note(cost)
    for schedule, variant in graphed_variants(run, model_config, cost):  # what the settings not set would give
        gen = generate_phase(run, sampling, work, plan.kv_cache_tokens, variant, engine_ep)
        out.append(schedules.all_sync(gen, train, fixed, training.wall + grad_sync))
        out[-1].schedule, out[-1].note = schedule, graphed_note(variant)
    if cut is not None:
        for step in out:
            step.note = f"{step.note}; {cut}" if step.note else cut
    r = run.rollout
    # overlap: the engine and the trainer's activations at once; the KV cache gets what the train phase leaves
    overlap_kv = (layout.gpu_memory_bytes - plan.train_bytes) // kv_bytes_per_token(
        model_config, r.engine, r.kv_cache_dtype
    )
    # overlap is modelled for vLLM's continuous batching over one wave of groups
    one_wave = sampling.round_count == 1 and work.waves == 1 and run.rollout.engine == "vllm"
    one_wave = one_wave and not run.optim.balance_ranks  # balanced rows train where they did not finish
    if layout.colocation != "sleep" and overlap_kv >= plan.sequence_tokens and one_wave:
        runs = [generate(g[0][0], work.prompt_tokens, overlap_kv, cost) for g in sampling.rounds]
        group_train = [t.reshape(-1, run.rollout.group_size).sum(axis=1) for t in trained]
        ready = [finish[: len(t)] for (_, finish), t in zip(runs, group_train)]  # the kept groups: the first to finish
        out.append(
            schedules.all_sync_overlap(
                ready, group_train, np.array([s for s, _ in runs]), {**fixed, "gradient sync": grad_sync}
            )
        )
    return out


def split_steps(
    run,
    model_config: dict,
    hw: Hardware,
    gen_gpus: int,
    gen_ep: int,
    generator: dict[str, int],
    kv_tokens: int,
    train_gpus: int,
    train_ep: int,
    work: Workload,
    offloaded_per_token: float = 0.0,
) -> list:
    """Disaggregated and one-step-off with `gen_gpus` generators (expert parallelism gen_ep, holding `generator`
    (generator_bytes) and `kv_tokens` of KV room each) and `train_gpus` trainers (train_ep): [StepTime, StepTime]."""
    own_copy = run.rollout.engine == "vllm"
    cost = generator_cost(run, model_config, hw, gen_ep, generator, own_copy)
    sampling = sampling_rounds(run, gen_gpus, work)
    gen = generate_phase(run, sampling, work, kv_tokens, cost, gen_ep)
    batch = np.concatenate(sampling.trained)
    per_trainer = [batch[i::train_gpus] for i in range(train_gpus)]
    routed_format = run.model.quant.plan().format_of("routed_experts")
    training = train_phase(
        run, model_config, hw, train_ep, routed_format, per_trainer, work.prompt_tokens, offloaded_per_token
    )
    grad_sync = run.optim.minibatches * grad_sync_seconds(run, model_config, hw, train_gpus, train_ep)
    train, train_wall = training.busy + grad_sync, training.wall + grad_sync
    experts = held_experts(model_config, gen_ep)
    # what generators receive: per expert, shared_outer's shared factors repeated for each (the form vLLM loads)
    adapter = lora_values(model_config, run.lora.rank, tuple(run.lora.targets), experts) * LORA_VALUE_BYTES
    transfer = adapter / hw.network_bytes_per_second + (adapter * ADAPTER_LOAD_SECONDS_PER_BYTE if own_copy else 0.0)
    return [
        schedules.disaggregated(gen, train, transfer, train_wall),
        schedules.one_step_off(gen, train, transfer, train_wall),
    ]
