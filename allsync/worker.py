"""One RL worker: the frozen base loaded once, used by its rollout engine and its trainer.

All-sync (colocated): every worker generates its share of the batch, then every worker trains on it,
gradients of the replicated LoRA tensors are all-reduced (gloo/NCCL) so the replicas stay identical,
and the new adapter is synced to the engine. Strictly on-policy: every sample records the adapter
version that produced it, and training checks it equals the version being trained (staleness 0).

Expert parallelism (parallel.expert_parallel = k > 1, see moe_lora/expert_parallel.py): the worker loads
and trains only its block of E/k routed experts; their gradients are summed over its expert-data-parallel
group. Every MoE layer then exchanges tokens with the other ranks of its EP group, so the ranks run every
forward and backward in lockstep: a rank with nothing of its own still takes part, on one masked-out row
(`idle_batch`), in generation rounds (`_serve_generation_rounds`) and through the torch engine.

The class is plain Python; the recipe wraps it in a Ray actor (one per device), runs it in-process, or runs one per
process under torchrun / accelerate launch (allsync.placement.SPMDGroup).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from allsync.algorithms import (
    DynamicSamplingExhausted,
    GroupBatch,
    InFlight,
    advance_window,
    egae,
    fill_batch_with_dynamic_sampling,
    get,
    group_length_reward,
    overlong_filter_mask,
    overlong_penalty,
    whiten_advantages,
    whitening_sums,
)
from allsync.checkpoint import (
    VALUE_HEAD_PREFIX,
    optimizer_state_from_files,
    optimizer_state_to_files,
    read_state,
    rng_state,
    set_rng_state,
    write_state,
)
from allsync.config import ConfigError, RunConfig
from allsync.distributed import Groups, connect
from allsync.rollout import Rollout, Sampling, TorchEngine
from allsync.evaluation import RewardError, sample_records, score_texts  # noqa: F401 - RewardError is part of the worker's API
from allsync.tasks import Problem, encode_prompt
from allsync.trainer import (
    LossSettings,
    SequenceBatch,
    ValueHead,
    ValueTargets,
    build_sequences,
    forward_logprobs,
    logprob_gap,
    minibatch_loss,
    response_positions,
    scatter_response_values,
    to_response_layout,
    to_sequence_layout,
)
from evals.reward_pool import RewardPool
from moe_lora.expert_parallel import ExpertLayout, expert_parameters, shard_experts
from moe_lora.lora import (
    PEFT_PREFIX,
    LoRAConfig,
    LoRAExperts,
    adapters_disabled,
    attach_lora,
    expert_slots,
    load_lora_state_dict,
    lora_state_dict,
    seeded_init_,
)
from quant.checkpoint_io import read_config
from quant.loader import load_frozen_model


class NaNLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    finish_reason: str
    reward: float
    correct: bool
    adapter_version: int


@dataclass
class PartialResponse:
    """A response generated over several T-PPO windows: its tokens so far and who produced them."""

    problem: Problem
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    engine_logprobs: list[float] = field(default_factory=list)
    started_version: int = 0  # adapter version of its first window
    window_start: int = 0  # index of the first token generated in the latest window

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> "PartialResponse":
        return PartialResponse(**{**data, "problem": Problem(**data["problem"])})


@dataclass
class TrainBatch:
    """What the minibatch loop needs: sequences whose response_mask marks the tokens to train, and
    per-token tensors [B, L-1] aligned with them. Critic fields are None for group baselines;
    ref_logprobs (the frozen base's, adapters off) only with algorithm.kl_coef > 0."""

    sequences: SequenceBatch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None  # response tokens of finished responses (the critic learns from those)
    ref_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def minibatch(self, rows: torch.Tensor) -> "TrainBatch":
        """These rows, cut to their own longest row (sequences are right-padded to the whole batch's)."""
        sequences = self.sequences.select(rows)
        width = sequences.width
        cut = lambda t: None if t is None else t[rows][:, : width - 1]  # noqa: E731
        return TrainBatch(sequences.trimmed(width), cut(self.old_logprobs), cut(self.advantages),
                          cut(self.returns), cut(self.value_mask), cut(self.ref_logprobs))  # fmt: skip

    def counts(self, rows: torch.Tensor) -> torch.Tensor:
        """[policy tokens, sequences with a policy token, critic tokens] of these rows."""
        mask = self.sequences.response_mask[rows]
        critic = self.value_mask[rows].sum() if self.value_mask is not None else 0.0
        return torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum()), float(critic)], dtype=torch.float64)


EVENTS_KEPT = 4096  # the most recent phases kept for inspection (benchmarks); busy time is a running total


@dataclass
class Timeline:
    """Phases as (phase, start, end) in wall-clock seconds, and busy time: the time inside phases minus
    the time blocked in collectives (waiting for other workers, plus the transfer itself). A worker that
    finishes its share first and waits in the all-reduce for a slower one is idle for that wait, so
    busy / wall is the worker's real utilization. O(1) per phase."""

    events: deque = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    busy_total: float = 0.0
    reported: float = 0.0  # busy_total at the last `busy_since_last_report`

    def record(self, phase: str, start: float) -> float:
        end = time.time()
        self.events.append((phase, start, end))
        self.busy_total += end - start
        return end

    def waited(self, seconds: float) -> None:
        """Time spent blocked in a collective inside a phase: not busy."""
        self.busy_total -= seconds

    def busy_since_last_report(self) -> float:
        busy, self.reported = self.busy_total - self.reported, self.busy_total
        return busy


def flat_gradients(params: list[torch.nn.Parameter], flag: bool = True, device: torch.device | None = None) -> torch.Tensor:
    """One zeroed buffer holding every parameter's .grad as a view, plus (flag) one last slot for a flag (a
    rank's non-finite loss): a minibatch's gradients and the flag are all-reduced in one collective."""
    if not params:
        return torch.zeros(int(flag), device=device)
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError(f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; one flat gradient buffer needs one")
    flat = torch.zeros(sum(p.numel() for p in params) + int(flag), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def worker_device(device: str, launcher: bool) -> torch.device:
    """cpu, or this worker's GPU: cuda:LOCAL_RANK under a launcher (one process per GPU), cuda:0 under Ray
    (the actor sees only the GPU its bundle holds)."""
    if device == "cpu":
        return torch.device("cpu")
    import os

    index = int(os.environ.get("LOCAL_RANK", 0)) if launcher else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """lr(step) = lr * min(1, (step + 1) / warmup_steps), step counted from 0 (the adapter version)."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else lr


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class RLWorker:
    def __init__(self, config: RunConfig, problems: list[Problem], rank: int = 0, world_size: int = 1,
                 dist_address: str | None = None, threads: int | None = None, max_model_len: int | None = None,
                 launcher: bool = False):  # fmt: skip
        """rank / world_size: this worker's place among the workers that share the data (prompts are strided
        over them). dist_address: join the process groups of `world_size` workers (allsync.distributed) through
        a TCP store there; None for a worker that only generates (the disaggregated baseline's generators).
        launcher: SPMD, started by torchrun / accelerate launch: the groups come from the environment.
        max_model_len: the vLLM engine's context (longest prompt + rollout.max_new_tokens, see
        allsync.tasks.model_len_needed); None computes it from `problems`."""
        self.config, self.rank, self.world_size = config, rank, world_size
        if threads:
            torch.set_num_threads(threads)
        base = config.model.base
        self.device = worker_device(config.parallel.resolved_device(), launcher)
        k = config.parallel.expert_parallel
        self.layout = ExpertLayout(world_size, k, read_config(base)["n_routed_experts"]) if k > 1 else None
        self.groups = Groups(rank, 1, self.layout)
        if world_size > 1 and (dist_address is not None or launcher):
            self.groups = connect(rank, world_size, dist_address, config.parallel.resolved_backend(), self.layout,
                                  default_group=self.layout is not None)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base)
        experts = self.layout.experts_of(rank) if self.layout is not None else None
        self.model = load_frozen_model(base, config.model.quant.plan(), compute_dtype=_dtype(config.model.compute_dtype),
                                       progress=rank == 0, experts=experts, device=self.device)  # fmt: skip
        lc = config.lora
        attach_lora(self.model, LoRAConfig(lc.rank, lc.alpha, tuple(lc.targets), lc.dropout, lc.use_rslora))
        seeded_init_(self.model, config.run.seed)  # the same adapter on every rank and under every expert layout
        self.dispatch_stats = shard_experts(self.model, self.groups.ep, self.layout, rank) if self.layout is not None else None
        if self.layout is not None:
            held, m = self.layout.experts_of(rank), self.model
            print(f"rank {rank}: routed experts {held.start}-{held.stop - 1} of {self.layout.num_experts}; read "
                  f"{m.checkpoint_bytes_read:,} checkpoint bytes ({m.checkpoint_expert_bytes_read:,} of them experts')")  # fmt: skip
        lora_params = [p for p in self.model.parameters() if p.requires_grad]
        sharded = {id(p) for p in expert_parameters(self.model)} if self.layout is not None else set()
        self.expert_params = [p for p in lora_params if id(p) in sharded]  # summed over the EDP group
        self.params = [p for p in lora_params if id(p) not in sharded]  # summed over every rank
        self.value_head = ValueHead(self.model.config.hidden_size).to(self.device) if config.algorithm.uses_critic else None
        if self.value_head is not None:
            self.params += list(self.value_head.parameters())
        self.flat_grad = flat_gradients(self.params, device=self.device)  # every rank all-reduces one buffer per minibatch
        self.flat_expert_grad = flat_gradients(self.expert_params, flag=False, device=self.device)
        self._broadcast_params()  # replicas start identical whatever their seeds (the value head)
        # seeded after building: how many numbers attach_lora drew depends on the experts this rank holds
        self._seed_everything(config.run.seed * 1000 + rank)
        o = config.optim
        self.optimized = lora_params + (list(self.value_head.parameters()) if self.value_head is not None else [])
        groups = [{"params": lora_params, "base_lr": o.lr}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "base_lr": o.value_lr})
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.problems = problems
        self.reward_pool = RewardPool(config.reward.spec(), config.reward.processes)
        self.reward_errors = 0  # samples whose reward raised or timed out since the last report
        self.max_model_len = max_model_len
        self.engine = self._make_engine()
        self.adapter_version = 0
        self.position = 0  # prompts taken so far by this worker (data position)
        self.consecutive_nan = 0
        self.in_flight: list[PartialResponse] = []  # gae / egae: the pool of responses being generated
        self.waiting: list[PartialResponse] = []  # samples of problems already taken that have not started
        self.timeline = Timeline()
        self.loss_settings = LossSettings(
            config.algorithm.clip_low, config.algorithm.clip_high, config.algorithm.clip_c, config.algorithm.loss_agg,
            config.rollout.temperature, config.algorithm.kl_coef, config.algorithm.kl_estimator,
        )  # fmt: skip

    # ------------------------------------------------------------------------------ helpers
    def _make_engine(self):
        """torch: generate with the training model itself. vllm: a vLLM engine in this process on the same
        checkpoint, given the LoRA tensors after every update (adapter-only sync)."""
        if self.config.rollout.engine == "torch":
            lockstep = self.groups if self.groups.expert_parallel else None
            return TorchEngine(self.model, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, lockstep=lockstep)
        from allsync.tasks import longest_prompt_tokens, model_len_needed
        from allsync.vllm_engine import VLLMEngine, unsupported_targets

        lc = self.config.lora
        if (reason := unsupported_targets(lc.targets)) is not None:
            raise ConfigError(f"rollout.engine vllm with lora.targets {lc.targets}: {reason}")
        model_len = self.max_model_len or model_len_needed(
            longest_prompt_tokens(self.tokenizer, self.problems), self.config.rollout.max_new_tokens,
            self.model.config.max_position_embeddings,
        )  # fmt: skip
        engine = VLLMEngine(self.config.model.base, lc.rank, lc.alpha, lc.use_rslora, dtype=self.config.model.compute_dtype,
                            max_model_len=model_len)  # fmt: skip
        moved = engine.load_adapter(self.adapter_tensors(), 0)
        if self.rank == 0:
            print(f"vLLM engine: adapter-only sync, {moved:,} bytes of LoRA tensors per update, max_model_len {model_len}")
        return engine

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _broadcast_params(self) -> None:
        for p in self.params:
            self.groups.broadcast(p.data)

    def _all_reduce(self, tensor: torch.Tensor, group: str = "world") -> torch.Tensor:
        """Sum over the workers of `group`, in place; the time blocked in it is not busy time (see Timeline)."""
        before = self.groups.waited
        self.groups.all_reduce(tensor, group)
        self.timeline.waited(self.groups.waited - before)
        return tensor

    def encode_prompt(self, problem: Problem) -> list[int]:
        return encode_prompt(self.tokenizer, problem)

    def take_problems(self, count: int) -> list[Problem]:
        """The next `count` training problems of this worker's stride through the shared train split."""
        n = len(self.problems)
        picked = [self.problems[((self.position + i) * self.world_size + self.rank) % n] for i in range(count)]
        self.position += count
        return picked

    def sampling(self) -> Sampling:
        r = self.config.rollout
        return Sampling(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)

    # ------------------------------------------------------------------------------ rollout + reward
    def score_responses(self, problems: list[Problem], responses: list[list[int]]) -> tuple[list[float], list[bool], int]:
        """(scores, correct, errors) from reward.name / reward.function in the reward processes
        (allsync.evaluation.score_texts: reward.on_error decides what a failed sample does)."""
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        return score_texts(self.reward_pool, self.config.reward, problems, texts, where=f" of worker {self.rank}")

    def rewards(self, problems: list[Problem], responses: list[list[int]],
                group_index: list[int] | None = None) -> tuple[list[float], list[bool], int]:  # fmt: skip
        """The reward's score plus DAPO's overlong shaping and, with reward.length, coef x Kimi-1.5's length
        reward within each group (`group_index`), per response; whether each is correct; reward errors."""
        scores, correct, errors = self.score_responses(problems, responses)
        shaped = torch.tensor(scores, dtype=torch.float64)
        lengths = torch.tensor([len(r) for r in responses])
        overlong, length = self.config.algorithm.overlong, self.config.reward.length
        if overlong is not None and responses:
            shaped += overlong_penalty(lengths, overlong.max_len, overlong.cache_len, overlong.factor).double()
        if length is not None and responses:
            shaped += length.coef * group_length_reward(lengths, torch.tensor(correct), torch.tensor(group_index)).double()
        return shaped.tolist(), correct, errors

    def score(self, rollout: Rollout, problems: list[Problem], n: int) -> list[Sample]:
        rewards, correct, errors = self.rewards([problems[i // n] for i in range(len(rollout))], rollout.response_ids,
                                                [i // n for i in range(len(rollout))])  # fmt: skip
        self.reward_errors += errors
        return [
            Sample(prompt, response, logprobs, reason, reward, ok, rollout.adapter_version)
            for prompt, response, logprobs, reason, reward, ok in zip(
                rollout.prompt_ids, rollout.response_ids, rollout.logprobs, rollout.finish_reasons, rewards, correct
            )
        ]

    def generate_groups(self, count: int) -> GroupBatch:
        """`count` problems x group_size samples; the group metric dynamic sampling filters on is
        correctness (algorithm.filter_metric acc, as DAPO and verl) or the shaped reward (reward)."""
        problems = self.take_problems(count)
        n = self.config.rollout.group_size
        rollout = self.engine.generate([self.encode_prompt(p) for p in problems], n, self.sampling())
        samples = self.score(rollout, problems, n)
        by_acc = self.config.algorithm.filter_metric == "acc"
        metric = torch.tensor([float(s.correct) if by_acc else s.reward for s in samples])
        return GroupBatch(torch.tensor(rollout.group_index), metric, samples)

    def collect(self, groups_wanted: int) -> tuple[list[Sample], dict]:
        """Generate groups; with dynamic sampling keep groups whose filter metric varies and refill (DAPO).
        At algorithm.max_sampling_rounds the groups kept so far are trained on (on_sampling_cap partial),
        or the step fails (error)."""
        a = self.config.algorithm
        base = {"groups_wanted": groups_wanted, "sampling_cap_hits": 0}
        if not a.dynamic_sampling:
            batch = self.generate_groups(groups_wanted)
            return batch.payloads, {**base, "groups_generated": groups_wanted, "sampling_rounds": 1, "groups_kept": groups_wanted,
                                    "generated": list(batch.payloads), "group_index": batch.group_index}  # fmt: skip
        generated: list[Sample] = []

        def round_fn(_round: int) -> GroupBatch:
            if self.groups.expert_parallel:
                self.groups.max_over_ranks(1)  # "I generate another round" (see _serve_generation_rounds)
            batch = self.generate_groups(groups_wanted)
            generated.extend(batch.payloads)
            return batch

        try:
            batch, stats = fill_batch_with_dynamic_sampling(round_fn, groups_wanted, a.max_sampling_rounds)
            rounds, groups_generated = stats.rounds, stats.groups_generated
        except DynamicSamplingExhausted as exc:
            if a.on_sampling_cap == "error":
                raise RuntimeError(f"worker {self.rank}: {exc} (algorithm.on_sampling_cap: error; partial trains on the "
                                   "groups kept)") from exc  # fmt: skip
            batch, rounds, groups_generated = exc.kept, exc.rounds_run, exc.groups_generated
            base["sampling_cap_hits"] = 1
        finally:
            self._serve_generation_rounds()
        return batch.payloads, {**base, "groups_generated": groups_generated, "sampling_rounds": rounds,
                                "groups_kept": batch.num_groups, "generated": generated,
                                "group_index": batch.group_index}  # fmt: skip

    def _serve_generation_rounds(self) -> None:
        """Expert parallelism: a rank whose batch is full keeps joining the generation rounds of ranks that are
        still refilling (their MoE layers need its experts), with an empty prompt list, until every rank is
        done. Each round every rank calls max_over_ranks once: 1 from a rank that generates, 0 from here."""
        if not self.groups.expert_parallel:
            return
        while self.groups.max_over_ranks(0):
            self.engine.generate([], self.config.rollout.group_size, self.sampling())

    def idle_batch(self) -> TrainBatch:
        """One row whose tokens are all masked out: a rank with nothing to train runs it so that its MoE
        layers take part in the other ranks' forward and backward (expert parallelism). Adds nothing."""
        pad = self.tokenizer.pad_token_id
        seqs = build_sequences([[pad]], [[pad]], pad).to(self.device)
        seqs.response_mask.zero_()
        zeros = torch.zeros_like(seqs.response_mask)
        kl = zeros if self.config.algorithm.kl_coef else None
        critic = (zeros, zeros) if self.value_head is not None else (None, None)
        return TrainBatch(seqs, zeros, zeros, *critic, ref_logprobs=kl)

    # ------------------------------------------------------------------------------ the step
    def step(self, step_index: int) -> dict:
        """One all-sync (colocated) step: generate this worker's share, train on it with every worker, sync.
        Returns sums/counts that the controller aggregates over workers."""
        wall0 = time.time()
        if self.value_head is not None:
            metrics = self.window_step()
        else:
            samples, group_index, metrics = self.rollout_phase(self.config.rollout.prompts_per_step // self.world_size)
            metrics.update(self.train_phase(samples, group_index))
        t = time.time()
        shares_model = isinstance(self.engine, TorchEngine)  # its LoRA tensors are the trainer's: nothing to copy
        metrics["sync_bytes"] = self.engine.load_adapter(None if shares_model else self.adapter_tensors(), self.adapter_version)
        self.timeline.record("sync", t)
        metrics.update(self.busy_report(wall0))
        if self.dispatch_stats is not None:  # expert parallelism: what this rank's all-to-alls moved this step
            metrics.update(self.dispatch_stats.take())
        return metrics

    def rollout_phase(self, groups_wanted: int) -> tuple[list[Sample], torch.Tensor, dict]:
        """Generate with the current adapter, score, and (DAPO) keep mixed groups; timed as "generate"."""
        t = time.time()
        samples, ds = self.collect(groups_wanted)
        self.engine.release_memory()  # vLLM on GPUs: its KV cache's memory goes to the trainer
        self.timeline.record("generate", t)
        generated = ds.pop("generated")
        errors, self.reward_errors = self.reward_errors, 0
        group_index = ds.pop("group_index")
        metrics = {
            "samples_generated": len(generated),
            "reward_sum": sum(s.reward for s in generated),
            "correct_sum": sum(s.correct for s in generated),
            "response_tokens": sum(len(s.response_ids) for s in generated),
            "truncated": sum(s.finish_reason == "length" for s in generated),
            "staleness_max": max((self.adapter_version - s.adapter_version for s in samples), default=0),
            "continuing": 0,
            "reward_errors": errors,
            **ds,
        }
        return samples, group_index, metrics

    def train_phase(self, samples: list[Sample], group_index: torch.Tensor) -> dict:
        """Strictly on-policy update: every sample must come from the adapter being trained (staleness 0);
        timed as "train". The adapter version advances by one."""
        t = time.time()
        stale = [s.adapter_version for s in samples if s.adapter_version != self.adapter_version]
        if stale:
            raise RuntimeError(f"worker {self.rank}: samples from adapter version {stale[0]} while training {self.adapter_version}")
        metrics = self.train(samples, group_index)
        self.adapter_version += 1
        self.timeline.record("train", t)
        return metrics

    def receive_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> int:
        """Load LoRA tensors trained elsewhere (a generator of the disaggregated layout); returns bytes received."""
        t = time.time()
        load_lora_state_dict(self.model, tensors)
        self.adapter_version = version
        self.engine.load_adapter(tensors, version)
        self.timeline.record("sync", t)
        return sum(v.numel() * v.element_size() for v in tensors.values())

    def busy_report(self, since: float) -> dict:
        """Wall time since `since` (the step's start) and busy time since the last report (once per step)."""
        return {"wall_seconds": time.time() - since, "busy_seconds": self.timeline.busy_since_last_report()}

    def train(self, samples: list[Sample], group_index: torch.Tensor) -> dict:
        """Group baselines (GRPO / Dr.GRPO): one advantage per sample from its group's rewards."""
        if not samples and self.groups.expert_parallel:  # the forward passes group_batch would run, on an idle row
            idle = self.idle_batch().sequences
            self.current_logprobs(idle)
            self.reference_logprobs(idle)
        return self.update(self.group_batch(samples, group_index) if samples else None, [s.engine_logprobs for s in samples])

    def group_batch(self, samples: list[Sample], group_index: torch.Tensor) -> TrainBatch:
        c = self.config
        advantages = get("advantage", c.algorithm.advantage)(torch.tensor([s.reward for s in samples]), group_index)
        batch = build_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples], self.tokenizer.pad_token_id)
        batch, advantages = batch.to(self.device), advantages.to(self.device)
        if c.algorithm.overlong is not None and c.algorithm.overlong.filter_truncated:
            batch.response_mask = overlong_filter_mask([s.finish_reason for s in samples], batch.response_mask)
        old_logprobs, _ = self.current_logprobs(batch)
        return TrainBatch(batch, old_logprobs, advantages[:, None].expand_as(batch.response_mask).float(),
                          ref_logprobs=self.reference_logprobs(batch))  # fmt: skip

    @torch.no_grad()
    def current_logprobs(self, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The current policy's logprobs (and values, with a critic) of the batch, before any update."""
        return forward_logprobs(self.model, batch, self.config.rollout.temperature, self.value_head)

    @torch.no_grad()
    def reference_logprobs(self, batch: SequenceBatch) -> torch.Tensor | None:
        """The reference policy's logprobs for the KL penalty: the frozen base with every adapter switched off,
        the same forward pass and temperature as the policy's. None when algorithm.kl_coef is 0."""
        if not self.config.algorithm.kl_coef:
            return None
        with adapters_disabled(self.model):
            return forward_logprobs(self.model, batch, self.config.rollout.temperature)[0]

    def update(self, tb: TrainBatch | None, engine_logprobs: list[list[float]]) -> dict:
        """`optim.minibatches` updates on tb's masked tokens. Every worker runs the same collectives whatever
        it holds: one all-reduce of every minibatch's token counts, then per minibatch one all-reduce of the
        flat gradient buffer (with a non-finite-loss flag). Loss shares use the all-reduced counts, so the
        summed gradient is the full batch's. A minibatch with no token on any worker is no optimizer step
        (AdamW would still move the adapter through momentum and weight decay); a non-finite loss on any
        worker or a non-finite gradient norm skips the step on every worker (`nan_steps`)."""
        c = self.config
        minibatches = c.optim.minibatches
        for group in self.optimizer.param_groups:  # linear warm-up over the first optim.warmup_steps RL steps
            group["lr"] = warmup_lr(group["base_lr"], self.adapter_version, c.optim.warmup_steps)
        out = {"loss_sum": 0.0, "clipfrac_high_sum": 0.0, "clipfrac_low_sum": 0.0, "kl_sum": 0.0, "entropy_sum": 0.0,
               "kl_ref_sum": 0.0, "logprob_gap": 0.0, "trained_samples": len(tb) if tb else 0, "trained_tokens": 0,
               "nan_steps": 0, "optimizer_steps": 0, "empty_minibatches": 0, "grad_norm": 0.0}  # fmt: skip
        parts: list[torch.Tensor | None] = [None] * minibatches
        local = torch.zeros(minibatches, 3, dtype=torch.float64)  # per minibatch: policy tokens, sequences, critic tokens (exact past 2^24)
        if tb is not None:
            engine = scatter_response_values(engine_logprobs, tb.sequences)
            out["logprob_gap"] = logprob_gap(engine, tb.old_logprobs, tb.sequences.response_mask)
            if not math.isfinite(out["logprob_gap"]) or out["logprob_gap"] > c.rollout.logprob_gap_warn:
                print(f"warning: worker {self.rank}: engine/trainer logprob gap {out['logprob_gap']:.4f} nats "
                      f"(> {c.rollout.logprob_gap_warn}): check adapter sync and engine kernels")  # fmt: skip
            parts = list(torch.arange(len(tb)).tensor_split(minibatches))  # exactly `minibatches` balanced parts
            local = torch.stack([tb.counts(rows) for rows in parts])
        totals = self._all_reduce(local.clone())
        lockstep = self.groups.expert_parallel  # every rank runs every minibatch's forward and backward
        for m, rows in enumerate(parts):
            if totals[m, 0] == 0 and totals[m, 2] == 0:
                out["empty_minibatches"] += 1
                continue
            self.flat_grad.zero_()
            self.flat_expert_grad.zero_()
            if rows is not None and (local[m, 0] > 0 or local[m, 2] > 0):
                self._backward_minibatch(tb.minibatch(rows), totals[m], out)
            elif lockstep:
                self._backward_minibatch(self.idle_batch(), totals[m], None)
            self._all_reduce(self.flat_grad)  # sum of per-rank shares = the full-batch gradient; [-1] = non-finite losses
            self._all_reduce(self.flat_expert_grad, "edp")  # expert blocks: summed over the ranks holding the same block
            norm = self._total_grad_norm()
            if self.flat_grad[-1] > 0 or not torch.isfinite(norm):  # identical on every rank: all skip together
                out["nan_steps"] += 1
                continue
            torch.nn.utils.clip_grads_with_norm_(self.optimized, c.optim.grad_clip, norm)
            self.optimizer.step()
            out["optimizer_steps"] += 1
            out["grad_norm"] = float(norm)
        self.consecutive_nan = self.consecutive_nan + 1 if out["nan_steps"] else 0
        return out

    def _total_grad_norm(self) -> torch.Tensor:
        """||g|| over every trainable tensor of the model. The replicated part is the same on every rank; each
        expert block's (identical over its EDP group) is counted once per EDP member by the world all-reduce:
            ||g||^2 = ||g_replicated||^2 + (sum over ranks of ||g_block(rank)||^2) / EDP size.
        One all-reduce gives every rank the same bits, so the clip factor cannot differ between ranks."""
        replicated = torch.nn.utils.get_total_norm([p.grad for p in self.params]) if self.params else torch.zeros(())
        if self.layout is None:
            return replicated
        block = self.flat_expert_grad.double().pow(2).sum() / self.layout.edp_size
        sq = self._all_reduce(block.reshape(1))[0] + replicated.double() ** 2
        return sq.sqrt().float()

    def _backward_minibatch(self, mb: TrainBatch, totals: torch.Tensor, out: dict | None) -> None:
        """Loss of this worker's part of a minibatch (its share of the global batch) and its backward into the
        flat gradient buffers; a non-finite loss sets the buffer's flag instead. out None: an idle row
        (expert parallelism), whose backward only serves the other ranks' tokens."""
        c = self.config
        targets = None
        if mb.returns is not None:
            targets = ValueTargets(mb.returns, mb.value_mask, totals[2], c.algorithm.value_coef)
        loss, sums = minibatch_loss(self.model, mb.sequences, mb.old_logprobs, mb.advantages, self.loss_settings,
                                    totals[0], totals[1], norm_length=c.rollout.max_new_tokens, ref_logprobs=mb.ref_logprobs,
                                    value_head=self.value_head, value_targets=targets)  # fmt: skip
        if not torch.isfinite(loss):
            self.flat_grad[-1] = 1.0
            if self.groups.expert_parallel:  # the EP peers wait for this rank's backward all-to-alls
                loss.backward()
            return
        loss.backward()
        if out is None:
            return
        out["loss_sum"] += float(loss.detach())
        out["clipfrac_high_sum"] += sums.clipfrac_high
        out["clipfrac_low_sum"] += sums.clipfrac_low
        out["kl_sum"] += sums.approx_kl
        out["entropy_sum"] += sums.entropy
        out["kl_ref_sum"] += sums.kl_ref
        out["trained_tokens"] += int(mb.sequences.response_mask.sum())

    # ------------------------------------------------------------------------------ PPO / T-PPO windows
    def start_responses(self, count: int) -> list[PartialResponse]:
        """`count` new samples (group_size per problem), taken from `waiting`, topped up from the data."""
        n = self.config.rollout.group_size
        while len(self.waiting) < count:
            (problem,) = self.take_problems(1)
            prompt = self.encode_prompt(problem)
            self.waiting += [PartialResponse(problem, prompt) for _ in range(n)]
        started, self.waiting = self.waiting[:count], self.waiting[count:]
        for r in started:
            r.started_version = self.adapter_version
        return started

    def window_step(self) -> dict:
        """PPO (gae) or T-PPO (egae): generate one window of `rollout.window` tokens (without a window: the
        whole response) for every in-flight response with the current adapter, then update on exactly the
        tokens of this window. Finished responses (eos or max_new_tokens) are scored and leave the pool;
        new samples refill it to prompts_per_step / workers x group_size. Each token is trained once, by the
        adapter that generated it (staleness 0, checked); a continuing response's earlier windows came from
        older adapters, and that context staleness is reported as staleness_max."""
        c = self.config
        pool_size = c.rollout.prompts_per_step // self.world_size * c.rollout.group_size
        window = c.rollout.window or c.rollout.max_new_tokens
        t = time.time()
        if not self.in_flight:
            self.in_flight = self.start_responses(pool_size)
        pool = self.in_flight
        sampling = Sampling(temperature=c.rollout.temperature, top_p=c.rollout.top_p, max_new_tokens=window)
        rollout = self.engine.generate([r.prompt_ids + r.response_ids for r in pool], 1, sampling)
        if rollout.adapter_version != self.adapter_version:
            raise RuntimeError(f"worker {self.rank}: window generated by adapter version {rollout.adapter_version} while training {self.adapter_version}")
        counts, eos = [], []
        for r, tokens, logprobs, reason in zip(pool, rollout.response_ids, rollout.logprobs, rollout.finish_reasons):
            room = c.rollout.max_new_tokens - len(r.response_ids)  # the last window may hold fewer tokens
            r.window_start = len(r.response_ids)
            r.response_ids = r.response_ids + tokens[:room]
            r.engine_logprobs = r.engine_logprobs + logprobs[:room]
            counts.append(min(len(tokens), room))
            eos.append(reason == "stop" and len(tokens) <= room)
        new_ids = list(range(len(pool), len(pool) + pool_size))  # enough new samples to refill any pool
        advance = advance_window([InFlight(i, r.window_start) for i, r in enumerate(pool)], counts, eos, new_ids,
                                 pool_size, window, c.rollout.max_new_tokens)  # fmt: skip
        finished = dict(zip(advance.finished_ids, advance.finish_reasons))
        done = [pool[i] for i in finished]
        rewards, correct, errors = self.rewards([r.problem for r in done], [r.response_ids for r in done])
        self.engine.release_memory()
        self.timeline.record("generate", t)

        t = time.time()
        reward_of = dict(zip(finished, rewards))
        metrics = self.update(self.window_batch(pool, finished, reward_of), [r.engine_logprobs[r.window_start :] for r in pool])
        metrics.update({
            "samples_generated": len(done), "reward_sum": sum(rewards), "correct_sum": sum(correct),
            "response_tokens": sum(len(r.response_ids) for r in done),
            "truncated": sum(reason == "length" for reason in finished.values()),
            "staleness_max": max(self.adapter_version - r.started_version for r in pool),
            "continuing": len(advance.continuing_ids), "groups_generated": 0, "groups_kept": 0, "groups_wanted": 0,
            "sampling_cap_hits": 0, "sampling_rounds": 1, "reward_errors": errors,
        })  # fmt: skip
        self.adapter_version += 1
        self.timeline.record("train", t)
        self.in_flight = [pool[i] for i in advance.continuing_ids] + self.start_responses(len(advance.refilled_ids))
        return metrics

    def window_batch(self, pool: list[PartialResponse], finished: dict[int, str], reward_of: dict[int, float]) -> TrainBatch:
        """Advantages by EGAE over each response so far (reward on the last token of finished ones; a cut
        response bootstraps V(s_l) = V(s_{l-1})), computed with the current critic and whitened over this
        window's tokens of every worker; the policy trains on this window's tokens, the critic on every
        token of finished responses."""
        c = self.config
        seqs = build_sequences([r.prompt_ids for r in pool], [r.response_ids for r in pool], self.tokenizer.pad_token_id).to(self.device)
        old_logprobs, old_values = self.current_logprobs(seqs)
        index, valid = response_positions(seqs.response_mask)
        width = seqs.response_mask.shape[1]
        token_rewards = torch.zeros(valid.shape, device=self.device)
        for i, reward in reward_of.items():
            token_rewards[i, len(pool[i].response_ids) - 1] = reward
        is_finished = torch.tensor([i in finished for i in range(len(pool))], device=self.device)
        advantages, returns = egae(token_rewards, to_response_layout(old_values, index, valid), valid.float(), ~is_finished,
                                   c.algorithm.gamma, c.algorithm.lam)  # fmt: skip
        starts = torch.tensor([r.window_start for r in pool], device=self.device)
        in_window = valid & (torch.arange(valid.shape[1], device=self.device)[None, :] >= starts[:, None])
        policy_mask = to_sequence_layout(in_window.float(), index, valid, width)
        if c.algorithm.overlong is not None and c.algorithm.overlong.filter_truncated:
            policy_mask = overlong_filter_mask([finished.get(i, "continuing") for i in range(len(pool))], policy_mask)
        advantages = to_sequence_layout(advantages, index, valid, width)
        sums = self._all_reduce(whitening_sums(advantages, policy_mask))  # the whole batch's statistics
        return TrainBatch(
            SequenceBatch(seqs.input_ids, seqs.attention_mask, policy_mask), old_logprobs,
            advantages=whiten_advantages(advantages, policy_mask, sums).float(),
            returns=to_sequence_layout(returns, index, valid, width),
            value_mask=seqs.response_mask * is_finished[:, None],
            ref_logprobs=self.reference_logprobs(seqs),
        )  # fmt: skip

    # ------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, problems: list[Problem], samples: int = 1) -> list[dict]:
        """Greedy (samples=1) or temperature-sampled responses to this worker's share of `problems`, scored:
        evals.report.SampleRecord fields per response, problem_id the index in `problems`."""
        ids = list(range(self.rank, len(problems), self.world_size))
        if not ids and not self.groups.expert_parallel:  # under EP the engine keeps this rank in lockstep
            return []
        greedy = samples == 1
        s = Sampling(temperature=1.0 if greedy else self.config.rollout.temperature, top_p=self.config.run.eval_top_p,
                     max_new_tokens=self.config.rollout.max_new_tokens, greedy=greedy)  # fmt: skip
        records = sample_records(self.engine, self.tokenizer, [problems[i] for i in ids], ids, samples, s, self.reward_pool,
                                 self.config.reward, where=f" of worker {self.rank}")  # fmt: skip
        return [asdict(r) for r in records]

    # ------------------------------------------------------------------------------ checkpoints
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's adapter tensors under PEFT names (its expert block only, under expert parallelism)."""
        return lora_state_dict(self.model)

    def full_adapter_tensors(self) -> dict[str, torch.Tensor] | None:
        """The whole adapter, every routed expert included, on rank 0 (None on the others). Under expert
        parallelism the ranks of the first EP group gather their blocks, so each of them must call it."""
        if self.layout is None:
            return self.adapter_tensors() if self.rank == 0 else None
        modules = [(n, m) for n, m in self.model.named_modules() if isinstance(m, LoRAExperts)]
        full = self._gather_expert_blocks([t.detach() for _, m in modules for t in m.factors()])
        if full is None:
            return None
        tensors = {k: v for k, v in self.adapter_tensors().items() if ".mlp.experts." not in k}
        for i, (name, _) in enumerate(modules):
            tensors.update(expert_slots(PEFT_PREFIX + name, full[6 * i : 6 * i + 6]))
        return {k: v.clone() for k, v in tensors.items()}

    def _gather_expert_blocks(self, blocks: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """[E, ...] tensors from every rank's [E/k, ...] blocks of them, gathered over the first EP group in
        one collective: the result on rank 0, None on the others (ranks outside that group do nothing)."""
        if self.rank >= self.layout.ep_size:
            return None
        flat = torch.cat([b.reshape(-1) for b in blocks]) if blocks else torch.zeros(0)
        pieces = [p.split([b.numel() for b in blocks]) for p in self.groups.all_gather(flat.cpu(), "ep")]
        if self.rank != 0:
            return None
        return [torch.cat([piece[i].view(b.shape) for piece in pieces]) for i, b in enumerate(blocks)]

    def _expert_state_ids(self) -> list[int]:
        """Optimizer-state indices (into the flattened param groups) of the routed-expert LoRA tensors."""
        sharded = {id(p) for p in self.expert_params}
        return [i for i, p in enumerate(self.optimized) if id(p) in sharded]

    def _full_optimizer_state(self) -> dict | None:
        """AdamW's state_dict with each expert tensor's moments gathered to [E, ...] (rank 0; None elsewhere)."""
        state = self.optimizer.state_dict()
        if self.layout is None:
            return state if self.rank == 0 else None
        entries = [(i, name) for i in self._expert_state_ids() for name, v in sorted(state["state"].get(i, {}).items())
                   if isinstance(v, torch.Tensor) and v.dim() > 0]  # fmt: skip
        full = self._gather_expert_blocks([state["state"][i][name] for i, name in entries])
        if full is None:
            return None
        for i in {i for i, _ in entries}:  # state_dict() shares the live per-parameter dicts: copy before replacing
            state["state"][i] = dict(state["state"][i])
        for (i, name), tensor in zip(entries, full):
            state["state"][i][name] = tensor
        return state

    def _shard_optimizer_state(self, state: dict) -> dict:
        """The inverse for loading: this rank's rows of each expert tensor's moments (any EP size wrote it)."""
        if self.layout is None:
            return state
        mine = self.layout.experts_of(self.rank)
        for i in self._expert_state_ids():
            for name, v in state["state"].get(i, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    state["state"][i][name] = v[mine.start : mine.stop].clone()
        return state

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The LoRA gradients of the last minibatch, after the all-reduce (what every rank applied)."""
        return [p.grad.detach().clone() for p in self.optimized]

    def save_state(self, directory: str) -> None:
        """This worker's part of a checkpoint (layout in allsync/checkpoint.py): the whole adapter, AdamW state
        and value head from rank 0 (expert blocks gathered: the files do not depend on parallel.expert_parallel);
        RNG states, data position and T-PPO pools from every rank."""
        directory = Path(directory)
        adapter_tensors, optimizer_state = self.full_adapter_tensors(), self._full_optimizer_state()
        if self.rank == 0:
            from moe_lora.adapter_io import Adapter, write_peft_adapter

            lc = self.config.lora
            adapter = Adapter(adapter_tensors, lc.rank, lc.alpha, lc.use_rslora)
            write_peft_adapter(adapter, directory / "adapter", self.config.model.base, overwrite=True)
            tensors, meta = optimizer_state_to_files(optimizer_state)
            if self.value_head is not None:
                tensors.update({VALUE_HEAD_PREFIX + k: v for k, v in self.value_head.state_dict().items()})
            write_state(directory, "trainer", tensors, {"optimizer": meta, "adapter_version": self.adapter_version})
        rng_tensors, rng = rng_state()
        write_state(directory, f"rank{self.rank}", rng_tensors, {
            "rng": rng, "position": self.position, "consecutive_nan": self.consecutive_nan,
            "in_flight": [r.to_json() for r in self.in_flight], "waiting": [r.to_json() for r in self.waiting],
        })  # fmt: skip

    def load_state(self, directory: str) -> None:
        from safetensors.torch import load_file

        directory = Path(directory)
        trainer_tensors, trainer = read_state(directory, "trainer")
        mine_tensors, mine = read_state(directory, f"rank{self.rank}")
        load_lora_state_dict(self.model, load_file(directory / "adapter" / "adapter_model.safetensors"),
                             other_experts=self.layout is not None)  # fmt: skip
        self.optimizer.load_state_dict(self._shard_optimizer_state(optimizer_state_from_files(trainer_tensors, trainer["optimizer"])))
        self.adapter_version = trainer["adapter_version"]
        if self.value_head is not None:
            head = {k[len(VALUE_HEAD_PREFIX) :]: v for k, v in trainer_tensors.items() if k.startswith(VALUE_HEAD_PREFIX)}
            self.value_head.load_state_dict(head)
        self.engine.load_adapter(self.adapter_tensors(), self.adapter_version)
        set_rng_state(mine_tensors, mine["rng"])
        self.position, self.consecutive_nan = mine["position"], mine["consecutive_nan"]
        self.in_flight = [PartialResponse.from_json(r) for r in mine["in_flight"]]
        self.waiting = [PartialResponse.from_json(r) for r in mine["waiting"]]

    def loaded_bytes(self) -> dict:
        """Checkpoint bytes this rank read at load (all, routed experts' share) and the experts it holds."""
        held = self.layout.experts_of(self.rank) if self.layout is not None else range(self.model.config.n_routed_experts)
        return {"bytes": self.model.checkpoint_bytes_read, "expert_bytes": self.model.checkpoint_expert_bytes_read,
                "experts": [held.start, held.stop]}  # fmt: skip

    def expert_memory(self) -> dict:
        """Resident bytes of this rank's routed experts: frozen weights, their LoRA tensors, and AdamW's state
        for those tensors (empty before the first optimizer step)."""
        from quant.modules import FrozenExperts

        frozen = sum(w.nbytes for m in self.model.modules() if isinstance(m, FrozenExperts) for ws in m.weights.values() for w in ws)
        adapters = [p for m in self.model.modules() if isinstance(m, LoRAExperts) for p in m.factors()]
        state = [t for p in adapters for t in self.optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"frozen": frozen, "adapters": nbytes(adapters), "optimizer": nbytes(state)}

    def timeline_events(self) -> list[tuple[str, float, float]]:
        return list(self.timeline.events)

    def shutdown(self) -> None:
        self.groups = Groups(self.rank, 1, self.layout)
        self.reward_pool.close()
        if hasattr(self.engine, "close"):
            self.engine.close()
