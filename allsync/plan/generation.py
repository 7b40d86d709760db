"""A step's generation phase in the plan: the sequences each GPU draws per sampling round (dynamic sampling), the
decode cost of its generator (vLLM's own copy or the trainer's frozen model), and the seconds a simulated
continuous-batching engine takes over them with the plan's KV room (step_time.generation_timeline)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from allsync.plan.fit import (
    decode_cache_is_expanded,
    kv_step_bytes_per_token,
)
from allsync.plan.hardware import Hardware
from allsync.plan.lengths import ResponseLengths
from allsync.plan.step_time import (
    ADMISSION_HEADROOM_TOKENS,
    DecodeCost,
    generation_timeline,
    decode_attention_flops_per_token,
)
from allsync.plan.torch_decode import EAGER_H200, GRAPHED_H200
from allsync.plan.vllm_decode import vllm_step_factor
from allsync.plan.weights import (
    FROZEN_PARTS,
    dequantized_values,
    fp8_gemm_values,
    engine_bytes,
    held_experts,
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
    from moe_lora.kv_caches import KV_PAGE_TOKENS

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
