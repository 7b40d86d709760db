"""A step's seconds for one layout: each GPU's sequences drawn from the response lengths, generated on a simulated
continuous-batching engine, trained by the roofline of step_time.py, and put together by each schedule of
schedules.py.

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

from dataclasses import dataclass, replace

import numpy as np

from allsync.balance import dealt
from allsync.plan import schedules
from allsync.plan.fit import (
    Layout,
    Plan,
    decode_cache_is_expanded,
    engine_expert_parallel,
    kv_bytes_per_token,
    kv_step_bytes_per_token,
)
from allsync.plan.hardware import Hardware
from allsync.plan.lengths import ResponseLengths
from allsync.plan.step_time import (
    ADMISSION_HEADROOM_TOKENS,
    DecodeCost,
    allreduce_seconds,
    forward_seconds,
    generation_timeline,
    decode_attention_flops_per_token,
    train_passes,
)
from allsync.plan.torch_decode import EAGER_H200, GRAPHED_H200
from allsync.plan.vllm_decode import vllm_step_factor
from allsync.plan.weights import (
    FROZEN_PARTS,
    LORA_VALUE_BYTES,
    dequantized_values,
    fp8_gemm_values,
    engine_bytes,
    held_experts,
    lora_values,
    routed_lora_values,
    stored_plan,
)

ADAPTER_LOAD_SECONDS_PER_BYTE = 0.055 / 199.0e6  # benchmarks/vllm_adapter_sync.py, in memory (BENCHMARKS.md)


@dataclass(frozen=True)
class Workload:
    """What a step asks for, independent of the layout."""

    lengths: ResponseLengths
    prompt_tokens: int
    kept_groups: float = 1.0  # share of generated groups dynamic sampling keeps
    seed: int = 0
    conversations: int = 1  # per episode (multi-conversation producers; their prompts are prompt_tokens each)
    turns: int = 1  # per episode of a tool agent: replies appended to one row, observations between them
    observation_tokens: int = 0  # per observation (an agent's producer.max_observation_tokens)

    @property
    def waves(self) -> int:
        """Generate calls an episode makes one after another: its conversations or its turns."""
        return max(self.conversations, self.turns)

    def wave_prompt_tokens(self, previous: list[float]) -> int:
        """The prompt of a wave whose episode's earlier replies average `previous` tokens each: an agent's row grows
        by each reply and observation; a conversation starts from its own prompt."""
        if self.turns == 1:
            return self.prompt_tokens
        return round(self.prompt_tokens + sum(previous) + len(previous) * self.observation_tokens)


@dataclass
class Sampling:
    """One step's dynamic sampling over every GPU: the groups each GPU generates in each round it runs, as one
    [groups, group_size] array of response lengths per conversation (one for single-turn episodes; multi-
    conversation episodes generate their conversations one after another), and the sequences it trains."""

    rounds: list[list[list[np.ndarray]]]  # per GPU, per round it generates in, per conversation
    trained: list[np.ndarray]  # per GPU: response lengths of every trained sequence
    fill: str  # algorithm.sampling_fill
    # per GPU: the groups of the round after its last (what streamed rounds begin before the step ends), None where
    # it ran algorithm.max_sampling_rounds; single-turn only (the first conversation's)
    spare: list[np.ndarray | None] | None = None

    @property
    def round_count(self) -> int:
        return max(len(r) for r in self.rounds)


def conversation_caps(run, conversations: int) -> list[int]:
    """Each conversation's response cap: producer.memory_tokens for the memory conversations of a multi-conversation
    episode, rollout.max_new_tokens for its last (the answer) and for single-turn episodes."""
    memory = getattr(run.producer, "memory_tokens", run.rollout.max_new_tokens)
    return [memory] * (conversations - 1) + [run.rollout.max_new_tokens]


def sampling_rounds(run, gpus: int, work: Workload) -> Sampling:
    """Each GPU's rounds and trained sequences (module docstring): response lengths from work.lengths (cut at each
    conversation's cap), each group kept with probability work.kept_groups (numpy's generator seeded with
    work.seed, so a plan is reproducible)."""
    rng = np.random.default_rng(work.seed)
    r, a = run.rollout, run.algorithm
    quota = r.prompts_per_step // gpus
    dynamic = a.dynamic_sampling and work.kept_groups < 1
    max_rounds = a.max_sampling_rounds if dynamic else 1
    caps = conversation_caps(run, work.conversations) if work.turns == 1 else [r.max_new_tokens] * work.turns
    drawn = [
        [
            [work.lengths.draw(quota * r.group_size, cap, rng).reshape(quota, r.group_size) for cap in caps]
            for _ in range(max_rounds)
        ]
        for _ in range(gpus)
    ]
    kept = rng.random((gpus, max_rounds, quota)) < work.kept_groups if dynamic else np.ones((gpus, 1, quota), bool)
    cumulative = kept.sum(axis=2).cumsum(axis=1)  # [gpus, rounds]: groups kept after each round
    if a.sampling_fill == "global":
        enough = cumulative.sum(axis=0) >= quota * gpus
        runs = np.full(gpus, int(np.argmax(enough)) + 1 if enough.any() else max_rounds)
    else:
        done = cumulative >= quota
        runs = np.where(done.any(axis=1), done.argmax(axis=1) + 1, max_rounds)
    trained = []
    for i in range(gpus):
        if work.turns > 1:  # one row per episode: every reply and the observations between them
            rows = [sum(drawn[i][j]) + (work.turns - 1) * work.observation_tokens for j in range(runs[i])]
        else:  # one row per conversation
            rows = [np.concatenate(drawn[i][j], axis=1) for j in range(runs[i])]
        episodes = np.concatenate([rows[j][kept[i, j]] for j in range(runs[i])])  # [kept groups, rows of a group]
        trained.append(episodes[:quota].ravel())
    spare = [drawn[i][runs[i]][0] if runs[i] < max_rounds else None for i in range(gpus)]
    return Sampling([drawn[i][: runs[i]] for i in range(gpus)], trained, a.sampling_fill, spare)


def lockstep_seconds(ranks: list[list[float]]) -> float:
    """Seconds of ranks that run their j-th pieces of work together (an expert-parallel group's forwards or decode
    batches; a rank with fewer runs idle ones): sum over j of max over ranks of t[r, j], a missing piece 0."""
    pieces = max((len(t) for t in ranks), default=0)
    return sum(max(t[j] if j < len(t) else 0.0 for t in ranks) for j in range(pieces))


def generation_seconds(sampling: Sampling, round_chunks: list[list[list[float]]], expert_parallel: int) -> np.ndarray:
    """Each GPU's generate seconds from the seconds of each decode batch of each round on it (`generate_chunks`;
    vLLM's continuous batching is one per round and conversation): its own rounds one after another; the ranks of
    an EP group run their j-th batches together (a rank whose quota is full keeps serving its group's rounds), so
    each costs the group's slowest; with global filling every round waits for every GPU:
        round(g, r) = sum over batches j of max over ranks i in g of t[i, r, j]
        worker fill: sum over r of round(g, r);   global: sum over r of max over g of round(g, r)"""
    gpus, count, group = len(round_chunks), sampling.round_count, max(expert_parallel, 1)
    per_round = np.zeros((gpus // group, count))
    for g in range(gpus // group):
        members = round_chunks[g * group : (g + 1) * group]
        for r in range(count):
            per_round[g, r] = lockstep_seconds([rounds[r] if r < len(rounds) else [] for rounds in members])
    if sampling.fill == "global":
        return np.full(gpus, per_round.max(axis=0).sum())
    return np.repeat(per_round.sum(axis=1), group)


def streams_rounds(run) -> bool:
    """algorithm.sampling_rounds streamed on the torch engine (the only one that streams them)."""
    return run.algorithm.sampling_rounds == "streamed" and run.rollout.engine == "torch"


def streamed_chunks(run, sampling: Sampling, work: Workload, cost: DecodeCost) -> list:
    """[gpu][round] -> decode batch seconds, as round_chunks, of rounds streamed through the slots
    (allsync/producers/streamed.py): one round per GPU, its rounds' groups queued one after another and the next
    round's (`Sampling.spare`) behind them, ending when the last row of the rounds the batch needs ends (the spare
    round's rows take the slots that free before then, and are dropped)."""
    out = []
    for rounds, spare in zip(sampling.rounds, sampling.spare or [None] * len(sampling.rounds)):
        needed = np.concatenate([waves[0] for waves in rounds])
        groups = needed if spare is None else np.concatenate([needed, spare])
        slots = run.rollout.decode_batch_size
        room, headroom = torch_kv_room(run, groups, work.prompt_tokens)
        finish = generation_timeline(groups.ravel(), work.prompt_tokens, room, cost, slots, headroom)
        out.append([[float(finish[: needed.size].max(initial=0.0))]])
    return out


def generate_phase(run, sampling: Sampling, work: Workload, kv_tokens: int, cost: DecodeCost, ep: int) -> np.ndarray:
    """Each GPU's generate seconds (generation_seconds): its rounds one after another, or streamed through its slots
    (`streams_rounds`, `streamed_chunks`: one round that holds them all)."""
    if streams_rounds(run):
        one_round = Sampling([[[np.concatenate([w[0] for w in r])]] for r in sampling.rounds], [], sampling.fill)
        return generation_seconds(one_round, streamed_chunks(run, sampling, work, cost), ep)
    return generation_seconds(sampling, round_chunks(run, sampling, work, kv_tokens, cost), ep)


def generator_bytes(model_config: dict, ep: int, own_copy: bool, trainer_parts: dict | None) -> dict[str, int]:
    """The frozen weights a generator reads every decode step, by part: vLLM's own copy of the base (own_copy), or
    the trainer's frozen parts (`trainer_parts`: weights.trainer_bytes or a Plan's per_gpu_bytes)."""
    if own_copy:
        return engine_bytes(model_config, ep)
    return {k: trainer_parts[k] for k in FROZEN_PARTS}


def generator_cost(
    run,
    model_config: dict,
    hw: Hardware,
    ep: int,
    weights: dict[str, int],
    own_copy: bool,
    decode_graphs: bool | None = None,
) -> DecodeCost:
    """A decode step's costs over the generator's `weights` (generator_bytes), in the formats they are held in;
    decode_graphs: the torch engine's CUDA graphs of fixed-shape steps (None: rollout.decode_graphs)."""
    fmt = (
        stored_plan(model_config).format_of("routed_experts")
        if own_copy
        else run.model.quant.plan().format_of("routed_experts")
    )
    routed = weights.get("routed_experts", 0)
    engine, kv_dtype = run.rollout.engine, run.rollout.kv_cache_dtype
    kernel = run.rollout.attention_kernel if engine == "torch" else "torch"
    expanded = decode_cache_is_expanded(model_config, engine, kv_dtype)
    kv = kv_step_bytes_per_token(model_config, engine, kv_dtype, kernel)
    attention = decode_attention_flops_per_token(model_config, latent=not expanded)
    measured = EAGER_H200 if engine == "torch" else None  # the torch engine as measured (eager), torch_decode.py
    graphs = engine == "torch" and (run.rollout.decode_graphs if decode_graphs is None else decode_graphs)
    # the quantized weights a fixed-shape step dequantizes (the torch engine holds the trainer's)
    routed_values, other_values = dequantized_values(
        model_config, run.model.quant.plan(), held_experts(model_config, ep)
    )
    return DecodeCost(
        model_config,
        hw,
        routed,
        sum(weights.values()) - routed,
        kv,
        ep,
        fmt,
        attention,
        measured,
        graphs,
        routed_values,
        other_values,
        own_positions=kernel == "triton",
        experts_read_once=engine == "torch" and run.rollout.frozen_expert_kernel == "triton",
        graphed=(hw.decode_factors or GRAPHED_H200) if engine == "torch" else None,
        fp8_linears_read_once=engine == "torch" and run.rollout.fp8_linear_kernel == "scaled_mm",
        fp8_linear_params=fp8_gemm_values(model_config, run.model.quant.plan()),
        engine_factor=vllm_step_factor(hw, "routed_experts" in run.lora.targets) if engine == "vllm" else 1.0,
    )


def slot_room(slots: int, groups: np.ndarray, prompt_tokens: int) -> int:
    """KV room that never stops the torch engine's `slots` slots from admitting `groups`' rows: each slot holds a row
    at full length."""
    return (slots + 1) * (prompt_tokens + int(groups.max(initial=0)) + ADMISSION_HEADROOM_TOKENS)


def torch_kv_room(run, groups: np.ndarray, prompt_tokens: int) -> tuple[int, int]:
    """(KV room in tokens, admission headroom per running row) of the torch engine's slots: slot_room's when each
    slot holds a row at full length; with rollout.kv_cache_tokens the pages the slots share (moe_lora.mla_decode.
    SlotKVCache), less half a page per slot (a row's last page is half empty on average) but never less than the
    longest row and its page (the engine refuses a room that cannot admit one; the plan says so, fit.paged_problems),
    a page of headroom a row (the engine admits a row when its pages and one more per live row are free)."""
    from moe_lora.mla_decode import KV_PAGE_TOKENS

    slots, tokens = run.rollout.decode_batch_size, run.rollout.kv_cache_tokens
    if tokens is None:
        return slot_room(slots, groups, prompt_tokens), ADMISSION_HEADROOM_TOKENS
    longest = prompt_tokens + int(groups.max(initial=0)) + KV_PAGE_TOKENS
    return max(tokens - slots * KV_PAGE_TOKENS // 2, longest), KV_PAGE_TOKENS


def generate_chunks(run, groups: np.ndarray, prompt_tokens: int, kv_tokens: int, cost: DecodeCost) -> list[float]:
    """Seconds of generating `groups` ([groups, group_size] response lengths), continuous batching: vLLM's within
    its KV room, the torch engine's over rollout.decode_batch slots that each hold a sequence at full length (the
    plan refuses a batch that does not fit), so it admits a row whenever a slot frees and never preempts, or that
    share rollout.kv_cache_tokens in pages (`torch_kv_room`), preempting as vLLM does."""
    if run.rollout.engine == "torch":
        room, headroom = torch_kv_room(run, groups, prompt_tokens)
        slots = run.rollout.decode_batch_size
        return [generate(groups, prompt_tokens, room, cost, slots, headroom)[0]]
    return [generate(groups, prompt_tokens, kv_tokens, cost)[0]]


def round_chunks(run, sampling: Sampling, work: Workload, kv_tokens: int, cost: DecodeCost) -> list:
    """[gpu][round] -> the seconds of every decode batch of the round, its conversations (or an agent's turns, each
    prompted with the row so far: Workload.wave_prompt_tokens) one after another."""

    def batches(waves: list[np.ndarray]) -> list[float]:
        out = []
        for w, wave in enumerate(waves):
            prompt = work.wave_prompt_tokens([float(v.mean()) for v in waves[:w]])
            out += generate_chunks(run, wave, prompt, kv_tokens, cost)
        return out

    return [[batches(waves) for waves in rounds] for rounds in sampling.rounds]


def generate(
    groups: np.ndarray,
    prompt_tokens: int,
    kv_tokens: int,
    cost: DecodeCost,
    max_sequences: int = 1024,
    headroom: int = ADMISSION_HEADROOM_TOKENS,
) -> tuple[float, np.ndarray]:
    """(seconds until the GPU's last response, each group's finish seconds sorted)."""
    finish = generation_timeline(groups.ravel(), prompt_tokens, kv_tokens, cost, max_sequences, headroom)
    finish = finish.reshape(groups.shape).max(axis=1)
    return float(finish.max()), np.sort(finish)


def grad_sync_seconds(run, model_config: dict, hw: Hardware, gpus: int, ep: int) -> float:
    """One all-reduce of the LoRA gradients: the per-expert routed factors' over gpus / ep replicas, the rest (the
    factors a shared_outer layer's experts share included) over all GPUs."""
    targets = tuple(run.lora.targets)
    experts = held_experts(model_config, ep)
    held = lora_values(model_config, run.lora.rank, targets, experts, run.lora.expert_layout)
    routed = 0
    if "routed_experts" in targets:
        routed = routed_lora_values(model_config, run.lora.rank, experts, run.lora.expert_layout)[0]
    replicas = gpus // ep
    link = hw.link_bytes_per_second(gpus)
    return allreduce_seconds((held - routed) * LORA_VALUE_BYTES, gpus, link) + allreduce_seconds(
        routed * LORA_VALUE_BYTES, replicas, link
    )


@dataclass
class Training:
    """A train phase: each GPU's busy seconds, the phase's wall seconds (waits included), each GPU's seconds per
    trained sequence (its share of its forwards)."""

    busy: np.ndarray
    wall: float
    per_sequence: list[np.ndarray]


def train_phase(
    run,
    model_config,
    hw,
    ep: int,
    routed_format: str,
    sequences: list[np.ndarray],
    prompt_tokens: int,
    offloaded_per_token: float = 0.0,
) -> Training:
    """The train phase of GPUs holding `sequences` (each GPU's response lengths, in the order it trains them), as
    the learner runs it: optim.minibatches contiguous parts, each packed longest first into forwards whose padded size
    (rows x longest) stays within optim.max_tokens_per_forward (allsync.forward.token_budget_chunks; one forward of
    the part without a budget); with optim.balance_ranks each minibatch's rows first go to the GPUs as
    allsync.balance.dealt deals them (one row an episode): with a budget in forwards packed globally and dealt in
    turns, which the GPUs run as dealt; without one by the longest-processing-time rule. Expert-parallel ranks run
    their j-th forwards together (a rank with fewer runs idle ones), so each costs the group's slowest; every
    minibatch ends in a gradient all-reduce over all GPUs:
        wall = sum over minibatches m of max over EP groups g of sum over forwards j of max over ranks r in g t[r,m,j]
    (EP 1: groups of one). Activation offload copies each forward's saved bytes out and back over the host link."""
    from allsync.forward import token_budget_chunks

    o = run.optim
    a = run.algorithm
    passes = train_passes(o.activation_checkpointing, o.minibatches, a.kl_coef > 0, a.uses_critic, a.old_logprobs)
    gpus = len(sequences)
    times = [[[] for _ in range(o.minibatches)] for _ in range(gpus)]  # [gpu][minibatch] -> seconds per forward
    per_sequence = [np.zeros(len(responses)) for responses in sequences]
    # parts[gpu][m]: (tokens, the GPU that generated the row, its index there) of the rows GPU gpu trains in minibatch m
    parts = []
    for i, responses in enumerate(sequences):
        tokens = np.asarray(responses, dtype=np.int64) + prompt_tokens
        bounds = np.cumsum([0] + [len(p) for p in np.array_split(tokens, o.minibatches)])
        parts.append([[(int(tokens[j]), i, j) for j in range(a, b)] for a, b in zip(bounds, bounds[1:])])
    forwards = [[None] * o.minibatches for _ in range(gpus)]  # [gpu][m]: the dealt forwards' rows (None: its own)
    if run.optim.balance_ranks and gpus > 1:  # allsync/balance.py: each minibatch's rows spread by their tokens
        for m in range(o.minibatches):
            shares = dealt([[row[0] for row in p[m]] for p in parts], gpus, o.max_tokens_per_forward)
            moved = [[parts[w][m][i] for w, i in taken] for taken, _ in shares]
            for i, (rows, (_, groups)) in enumerate(zip(moved, shares)):
                parts[i][m], forwards[i][m] = rows, groups
    for i in range(gpus):
        for m, part in enumerate(parts[i]):
            lengths = [row[0] for row in part]
            groups = (
                forwards[i][m] if forwards[i][m] is not None else token_budget_chunks(lengths, o.max_tokens_per_forward)
            )
            for rows in groups:
                longest = max(lengths[r] for r in rows)
                t = forward_seconds(model_config, hw, routed_format, passes, ep, len(rows), longest)
                t += 2 * len(rows) * longest * offloaded_per_token / hw.host_link_bytes_per_second
                times[i][m].append(t)
                for r in rows:
                    _, gpu, j = part[r]
                    per_sequence[gpu][j] = t / len(rows)
    busy = np.array([sum(sum(m) for m in gpu) for gpu in times])
    group = max(ep, 1)
    wall = sum(
        max(lockstep_seconds([times[r][m] for r in range(g, min(g + group, gpus))]) for g in range(0, gpus, group))
        for m in range(o.minibatches)
    )
    return Training(busy, wall, per_sequence)


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
    from moe_lora.mla_decode import KV_PAGE_TOKENS

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
