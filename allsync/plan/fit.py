"""Will a run fit its GPUs: every part of one worker's memory in the two phases of an all-sync step, and the verdict.

An all-sync worker alternates two phases on the same GPU:

    train      frozen + adapter (+ critic) + activations (+ the engine's resident parts, colocation resident)
    generate   adapter + the engine's weights and buffers + its KV cache (+ frozen, colocation resident)
    frozen     the trainer's frozen model (weights.frozen_bytes); adapter: LoRA + its gradients + AdamW's moments;
               critic (PPO / T-PPO): its adapter (no routed experts) and head, gradients and moments

The torch engine generates with the trainer's own weights (no engine weights); vLLM serves the checkpoint as stored
(its FP8 or bf16 tensors, the worker's block of routed experts), a second copy, and holds beside it
(`engine_extra_bytes`): the absorbed-MLA copies of W_UK / W_UV its latent decode reads, one LoRA slot for every module
it adapts, its own buffers (CUDA graphs, sampler, profile-run activations) and the reserve our memory share leaves
free. Colocation `resident` keeps both copies on the GPU (vLLM's KV cache is released while training); `sleep` keeps
only the phase's own: vLLM's sleep mode (level 1) moves the engine's weights to host memory while the trainer
trains, and the trainer's frozen weights go to host memory while vLLM generates. That costs both copies' bytes twice
over the host link every step, and host memory for the larger of them per GPU. `shared` (modelled, not built): vLLM
reads the trainer's frozen tensors, one copy; vLLM can only serve what the checkpoint stores, so the trainer then
freezes every group in the stored formats (FP8 for DeepSeek-V3) instead of model.quant's.

Activations: `activations.SavedBytes.peak` at the tokens of one forward (optim.max_tokens_per_forward, or one
full-length sequence if that is longer; without a budget a minibatch's sequences at full length) with the run's
activation checkpointing, traced on the expert-parallel path when EP > 1, the larger of the policy's and the critic's
(their graphs are alive one at a time). KV cache: what the generate phase leaves, in tokens of MLA cache
(allsync.engines.vllm_support.mla_kv_bytes_per_token), against what the worker's sequences of a step need at full
length.

The margin: a plan fits when each phase fits in the GPU's memory less `Layout.margin` of it (default 10%: the CUDA
context, NCCL's buffers, the allocator's fragmentation and what this count leaves out); the generate phase must
hold at least one full-length sequence inside it (fewer than all of them at once means generation in waves). The
KV room the step time uses is what the engine really gets: everything the generate phase leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from allsync.plan.activations import RunTraces
from allsync.plan.step_time import DecodeCost
from allsync.plan.weights import (
    FROZEN_PARTS,
    critic_bytes,
    dequantized_values,
    engine_bytes,
    frozen_bytes,
    graphed_expert_bytes,
    held_experts,
    lora_values,
    stored_plan,
    trainer_bytes,
)

COLOCATIONS = ("resident", "sleep", "shared")
DEFAULT_MARGIN = 0.10  # share of the GPU's memory a plan leaves unused (module docstring)
ENGINE_PARTS = ("engine_weights", "engine_mla_absorbed", "engine_lora_slot", "engine_buffers")


@dataclass
class Layout:
    gpus: int
    expert_parallel: int
    gpu_memory_bytes: int
    colocation: str = "resident"
    prompt_tokens: int = 1024  # assumed longest prompt (the config does not say; a flag does)
    host_link_bytes_per_second: float = 25e9  # GPU <-> host, for sleep mode's transfers (a flag; PCIe 4 x16 ~25 GB/s)
    host_memory_bytes: int = 2 * 10**12  # per node (a flag)
    gpus_per_node: int = 8
    margin: float = DEFAULT_MARGIN  # share of gpu_memory_bytes left unused (`--margin`)
    row_tokens: int | None = None  # a trained row at full length when it is not prompt + max_new_tokens (agent turns)

    @property
    def usable_bytes(self) -> int:
        return round(self.gpu_memory_bytes * (1 - self.margin))


@dataclass
class Plan:
    per_gpu_bytes: dict[str, int]
    train_bytes: int
    generate_bytes: int  # with one full-length sequence of KV cache (or all the room there is, if less)
    gpu_memory_bytes: int
    kv_cache_tokens: int  # the KV cache the generate phase leaves room for, in tokens
    sequences: int  # this worker's sequences per step
    sequence_tokens: int  # prompt + rollout.max_new_tokens
    tokens_per_forward: int
    layout: dict
    sleep_seconds: float = 0.0  # host transfers per step (colocation sleep)
    host_bytes_per_gpu: int = 0  # sleep mode's weights and offloaded activations, at the phase that holds most
    offloaded_bytes: int = 0  # optim.activation_offload: one forward's saved tensors in host memory
    problems: list[str] = field(default_factory=list)
    margin_bytes: int = 0  # what the verdict leaves unused

    @property
    def usable_bytes(self) -> int:
        return self.gpu_memory_bytes - self.margin_bytes

    @property
    def train_room_bytes(self) -> int:
        """What the train phase leaves inside the margin (negative: over)."""
        return self.usable_bytes - self.train_bytes

    @property
    def generate_room_bytes(self) -> int:
        """What the generate phase with one full-length sequence leaves inside the margin (negative: over)."""
        return self.usable_bytes - self.generate_bytes

    @property
    def total_bytes(self) -> int:
        return max(self.train_bytes, self.generate_bytes)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def sequences_at_once(self) -> int:
        return min(self.sequences, self.kv_cache_tokens // self.sequence_tokens)

    def to_json(self) -> dict:
        return {
            "per_gpu_bytes": self.per_gpu_bytes,
            "total_bytes": self.total_bytes,
            "train_bytes": self.train_bytes,
            "generate_bytes": self.generate_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "fits": self.fits,
            "problems": self.problems,
            "margin_bytes": self.margin_bytes,
            "train_room_bytes": self.train_room_bytes,
            "generate_room_bytes": self.generate_room_bytes,
            "layout": self.layout,
            "kv_cache_tokens": self.kv_cache_tokens,
            "sequences_at_once": self.sequences_at_once,
            "sequences": self.sequences,
            "sequence_tokens": self.sequence_tokens,
            "tokens_per_forward": self.tokens_per_forward,
            "sleep_seconds_per_step": self.sleep_seconds,
            "host_bytes_per_gpu": self.host_bytes_per_gpu,
            "offloaded_activation_bytes": self.offloaded_bytes,
        }


def decode_cache_is_expanded(model_config: dict, engine: str, kv_cache_dtype: str = "auto") -> bool:
    """The decoder keeps MLA's keys and values expanded: the torch engine where that is no larger than the latent
    (moe_lora.kv_caches.expanded_cache_fits, the engine's own rule: the tiny models) and its cache is not FP8.
    Otherwise (vLLM always, the torch engine at DeepSeek-V3's 128 heads or with rollout.kv_cache_dtype fp8) it keeps
    the latent and attends in latent space."""
    from types import SimpleNamespace

    from moe_lora.kv_caches import expanded_cache_fits

    fits = expanded_cache_fits(SimpleNamespace(**model_config))
    return engine == "torch" and kv_cache_dtype == "auto" and fits


def kv_bytes_per_token(model_config: dict, engine: str = "vllm", kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes per token: MLA's latent (allsync.engines.vllm_support.mla_kv_bytes_per_token), or where the
    decoder keeps them expanded (`decode_cache_is_expanded`) its keys and values, H x (d_nope + d_rope + d_v) per
    layer (bf16); the torch engine's FP8 latent (rollout.kv_cache_dtype fp8) moe_lora.kv_caches.fp8_latent_bytes per
    layer (DeepSeek-V3: 61 x 656)."""
    from allsync.engines.vllm_support import mla_kv_bytes_per_token
    from moe_lora.kv_caches import fp8_latent_bytes

    c = model_config
    if decode_cache_is_expanded(model_config, engine, kv_cache_dtype):
        per_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]
        return c["num_hidden_layers"] * c["num_attention_heads"] * per_head * 2
    if engine == "torch" and kv_cache_dtype == "fp8":
        return c["num_hidden_layers"] * fp8_latent_bytes(c["kv_lora_rank"], c["qk_rope_head_dim"], 2)
    return mla_kv_bytes_per_token(model_config)


SCORE_BYTES_PER_HEAD = 12  # the torch path's bf16 scores a cached position and head: written, masked, softmaxed, read


def kv_step_bytes_per_token(
    model_config: dict, engine: str = "vllm", kv_cache_dtype: str = "auto", attention_kernel: str = "torch"
) -> int:
    """Bytes a decode step moves per cached token: its stored bytes (kv_bytes_per_token), read once, for vLLM, the
    latent kernel (rollout.attention_kernel triton, moe_lora/latent_attention.py: each position read once as stored,
    the scores in registers) and the expanded cache. The torch engine's latent path (moe_lora.mla_decode.
    absorbed_attention) per layer: the latent read by the scores' product (2 (r + d_rope)) and c by the weighted sum
    (2 r), and the H heads' bf16 scores (SCORE_BYTES_PER_HEAD H); an FP8 latent is first read back into the compute
    dtype (FP8LatentLayer.read): the stored bytes + the conversion written and read (2 x 2 r) + the latent written
    (2 (r + d_rope)). DeepSeek-V3: bf16 1,152 + 1,024 + 1,536 = 3,712; FP8 656 + 2,048 + 1,152 + 1,152 + 1,024 +
    1,536 = 7,568 (against 1,152 and 656 stored)."""
    stored = kv_bytes_per_token(model_config, engine, kv_cache_dtype)
    if (
        engine != "torch"
        or attention_kernel == "triton"
        or decode_cache_is_expanded(model_config, engine, kv_cache_dtype)
    ):
        return stored
    c = model_config
    rank, latent = c["kv_lora_rank"], c["kv_lora_rank"] + c["qk_rope_head_dim"]
    reads = 2 * rank + SCORE_BYTES_PER_HEAD * c["num_attention_heads"]
    if kv_cache_dtype != "fp8":
        return stored + c["num_hidden_layers"] * reads
    return stored + c["num_hidden_layers"] * (2 * 2 * rank + 2 * 2 * latent + reads)


def engine_extra_bytes(run, model_config: dict, expert_parallel: int) -> dict[str, int]:
    """What vLLM (0.32, on a GPU) holds per GPU beside its weights and KV cache, by part:

    engine_mla_absorbed  W_UK^T and W_UV in the model dtype (bf16), which vLLM's MLA builds from kv_b_proj for its
                         latent decode and keeps beside it (mla_attention.process_weights_after_loading):
                         layers x H x (d_nope + d_v) x kv_lora_rank x 2 B (V3: 61 x 128 x 256 x 512 x 2 = 2.05 GB)
    engine_lora_slot     max_loras (1) x every module vLLM adapts (our engine leaves LoRAConfig.target_modules
                         unset, so every module it supports gets buffers: attention, dense MLP, shared and the
                         held routed experts) x max_lora_rank (lora.rank) x (in + out) x 2 B (lora_dtype auto:
                         the model's bf16)
    engine_buffers       CUDA graphs, the sampler and the profile run's activations: the estimate
                         allsync.engines.vllm_support.ENGINE_MARGIN_BYTES that memory_share takes out of the
                         engine's share for them
    engine_reserve       the same amount memory_share leaves free outside the engine's share (generate phase)
    """
    from allsync.engines.vllm_support import ENGINE_MARGIN_BYTES
    from moe_lora.lora import DEFAULT_TARGETS

    c = model_config
    absorbed = (
        c["num_hidden_layers"]
        * c["num_attention_heads"]
        * (c["qk_nope_head_dim"] + c["v_head_dim"])
        * c["kv_lora_rank"]
    )
    experts = held_experts(model_config, expert_parallel)
    slot = lora_values(model_config, run.lora.rank, DEFAULT_TARGETS, experts)
    return {
        "engine_mla_absorbed": absorbed * 2,
        "engine_lora_slot": slot * 2,
        "engine_buffers": ENGINE_MARGIN_BYTES,
        "engine_reserve": ENGINE_MARGIN_BYTES,
    }


def paged_problems(rollout, kv_tokens: int, kv_token: int, sequence_tokens: int, problems: list[str]) -> None:
    """rollout.kv_cache_tokens (the torch engine's slots sharing pages) against the generate phase's room and one
    full-length row (moe_lora.kv_caches.SlotKVCache admits one when its pages and one more are free)."""
    from moe_lora.kv_caches import KV_PAGE_TOKENS

    tokens = rollout.kv_cache_tokens
    if tokens > kv_tokens:
        problems.append(
            f"rollout.kv_cache_tokens {tokens:,} ({tokens * kv_token / 1e9:.1f} GB) is more than the generate phase "
            f"leaves: room for {kv_tokens:,} tokens"
        )
    if tokens < sequence_tokens + KV_PAGE_TOKENS:
        problems.append(
            f"rollout.kv_cache_tokens {tokens:,} cannot admit one row of {sequence_tokens:,} tokens (prompt + "
            f"rollout.max_new_tokens) and the page the engine keeps free"
        )


def tokens_per_forward(run, sequences: int, sequence_tokens: int) -> int:
    """The tokens of one training forward: optim.max_tokens_per_forward (a longer sequence is a forward of its own),
    or without a budget a minibatch's sequences at full length."""
    budget = run.optim.max_tokens_per_forward
    if budget:
        return max(budget, sequence_tokens)
    return max(sequences // run.optim.minibatches, 1) * sequence_tokens


def engine_expert_parallel(run, layout: Layout) -> int:
    """vLLM's expert-parallel group on `layout`: every GPU with rollout.engine_expert_parallel (one engine over all
    the workers, the busiest holding ceil(n_routed_experts / GPUs) experts: allsync/engines/engine_experts.py), else
    the trainer's (the checker refuses vLLM at a trainer EP above 1 without it, so 1 wherever the loop runs it)."""
    r = run.rollout
    if r.engine == "vllm" and r.engine_expert_parallel and layout.colocation != "shared":
        return layout.gpus
    return layout.expert_parallel


def plan_run(run, model_config: dict, layout: Layout, traces: RunTraces) -> Plan:
    """The Plan of `run` (a RunConfig) on `layout` for the checkpoint `model_config`; `traces`: the run's activation
    traces (the expert-parallel path's when layout.expert_parallel > 1, and the critic's)."""
    experts_total = model_config["n_routed_experts"]
    ep = layout.expert_parallel
    r = run.rollout
    vllm = r.engine == "vllm"
    shared = layout.colocation == "shared" and vllm
    per_gpu = trainer_bytes(run, model_config, ep, stored_plan(model_config) if shared else None)
    per_gpu.update(critic_bytes(run, model_config))
    resident = sum(per_gpu.values())

    sequences = r.prompts_per_step // layout.gpus * r.group_size
    sequence_tokens = layout.row_tokens or layout.prompt_tokens + r.max_new_tokens
    tokens = tokens_per_forward(run, sequences, sequence_tokens)
    per_gpu["activations"], offloaded = traces.activations(model_config, tokens, run.optim, ep)
    engine = {name: 0 for name in ENGINE_PARTS}
    reserve = 0
    if vllm:
        engine_ep = engine_expert_parallel(run, layout)
        extra = engine_extra_bytes(run, model_config, engine_ep)
        reserve = extra.pop("engine_reserve")
        engine.update(extra)
        engine["engine_weights"] = 0 if shared else sum(engine_bytes(model_config, engine_ep).values())
    per_gpu.update(engine)

    kv_token = kv_bytes_per_token(model_config, r.engine, r.kv_cache_dtype)
    frozen = sum(per_gpu[name] for name in FROZEN_PARTS)
    engine_total = sum(engine.values())
    sleeping = layout.colocation == "sleep" and vllm
    asleep = engine["engine_buffers"]  # what stays of vLLM in sleep mode: its buffers; the rest is in host memory
    train = resident + per_gpu["activations"] + (asleep if sleeping else engine_total)
    # the graphed decode step's bf16 expert stacks: generation's only (plan.weights.graphed_expert_bytes)
    per_gpu["decode_graph_experts"] = graphed_expert_bytes(run, model_config, ep)
    generate_base = resident - (frozen if sleeping else 0) + engine_total + reserve + per_gpu["decode_graph_experts"]
    kv_tokens = max(layout.usable_bytes - generate_base, 0) // kv_token  # inside the margin, as every phase
    per_gpu["kv_cache"] = min(sequences * sequence_tokens, kv_tokens) * kv_token

    usable = layout.usable_bytes
    margin = f"the GPU's {layout.gpu_memory_bytes / 1e9:.1f} GB less the {layout.margin:.0%} margin"
    problems = []
    if train > usable:
        problems.append(
            f"the train phase needs {train / 1e9:.1f} GB (activations {per_gpu['activations'] / 1e9:.1f} GB at "
            f"{tokens:,} tokens per forward), {(train - usable) / 1e9:.1f} GB more than {margin}"
        )
    generate = generate_base + sequence_tokens * kv_token
    if generate > usable:
        problems.append(
            f"the generate phase with one sequence of {sequence_tokens:,} tokens "
            f"({'an agent row at full length' if layout.row_tokens else 'prompt + rollout.max_new_tokens'}) "
            f"needs {generate / 1e9:.1f} GB, {(generate - usable) / 1e9:.1f} GB more than {margin}"
        )
    if not vllm and r.kv_cache_tokens is not None:
        paged_problems(r, kv_tokens, kv_token, sequence_tokens, problems)
    elif not vllm and r.decode_batch_size * sequence_tokens > kv_tokens:
        problems.append(
            f"rollout.decode_batch {r.decode_batch_size} x {sequence_tokens:,} tokens of KV cache (the torch engine's "
            f"KV slots at full length) need {r.decode_batch_size * sequence_tokens * kv_token / 1e9:.1f} GB; the "
            f"generate phase leaves room for {kv_tokens:,} tokens ({kv_tokens // sequence_tokens} sequences)"
        )
    host_bytes = max(engine_total - asleep + offloaded, frozen) if sleeping else offloaded
    node_gpus = min(layout.gpus, layout.gpus_per_node)
    if host_bytes * node_gpus > layout.host_memory_bytes:
        problems.append(
            f"host memory: {node_gpus} GPUs x {host_bytes / 1e9:.1f} GB (sleep mode's weights, offloaded activations) "
            f"= {host_bytes * node_gpus / 1e9:.0f} GB, more than the node's {layout.host_memory_bytes / 1e9:.0f} GB"
        )
    return Plan(
        per_gpu_bytes=per_gpu,
        train_bytes=train,
        generate_bytes=generate,
        gpu_memory_bytes=layout.gpu_memory_bytes,
        kv_cache_tokens=kv_tokens,
        sequences=sequences,
        sequence_tokens=sequence_tokens,
        tokens_per_forward=tokens,
        layout={
            "gpus": layout.gpus,
            "expert_parallel": ep,
            "experts_per_gpu": experts_total // ep,
            "engine": r.engine,
            "colocation": layout.colocation,
            "activation_checkpointing": run.optim.activation_checkpointing,
            "activation_offload": run.optim.activation_offload,
            "prompt_tokens": layout.prompt_tokens,
            "frozen_formats": "as stored (shared with vLLM)" if shared else "model.quant",
            "margin": layout.margin,
        },
        sleep_seconds=2 * (engine_total - asleep + frozen) / layout.host_link_bytes_per_second if sleeping else 0.0,
        host_bytes_per_gpu=host_bytes,
        offloaded_bytes=offloaded,
        problems=problems,
        margin_bytes=layout.gpu_memory_bytes - usable,
    )


def format_plan(plan: Plan) -> str:
    """The table `allsync plan` prints: every part per GPU, the two phases, the verdict."""
    gb = lambda n: f"{n / 1e9:9.2f} GB" if n >= 1e9 else f"{n / 1e6:9.2f} MB"  # noqa: E731 - tiny models in MB
    rows = [f"{name:<18}{gb(n)}" for name, n in plan.per_gpu_bytes.items()]
    lay = plan.layout
    lines = [
        f"per GPU, {lay['gpus']} GPUs, expert parallelism {lay['expert_parallel']} ({lay['experts_per_gpu']} experts "
        f"per GPU), engine {lay['engine']}, colocation {lay['colocation']}:",
        *rows,
        f"{'train phase':<18}{gb(plan.train_bytes)}  (resident + activations at {plan.tokens_per_forward:,} tokens "
        f"per forward{', checkpointed' if lay['activation_checkpointing'] else ''}"
        f"{', offloaded' if lay['activation_offload'] else ''})",
        f"{'generate phase':<18}{gb(plan.generate_bytes)}  (with one sequence of KV cache"
        f"{', and the 2 GiB the engine leaves free' if plan.per_gpu_bytes.get('engine_buffers') else ''})",
        f"room inside the {lay['margin']:.0%} margin ({plan.margin_bytes / 1e9:.1f} GB): train phase "
        f"{plan.train_room_bytes / 1e9:.1f} GB, generate phase {plan.generate_room_bytes / 1e9:.1f} GB",
        f"KV cache room: {plan.kv_cache_tokens:,} tokens = {plan.sequences_at_once} of this GPU's {plan.sequences} "
        f"sequences of {plan.sequence_tokens:,} tokens at once (prompts assumed {lay['prompt_tokens']:,} tokens)",
    ]
    if plan.offloaded_bytes:
        lines.append(
            f"activation offload: {plan.offloaded_bytes / 1e9:.1f} GB of one forward's activations in host memory"
        )
    if plan.sleep_seconds:
        lines.append(f"sleep mode: {plan.sleep_seconds:.1f} s of host transfers per step")
    if plan.host_bytes_per_gpu:
        lines.append(f"host memory per GPU: {plan.host_bytes_per_gpu / 1e9:.1f} GB")
    verdict = "fits" if plan.fits else "does not fit: " + "; ".join(plan.problems)
    lines.append(
        f"verdict: {verdict} ({plan.total_bytes / 1e9:.1f} of {plan.usable_bytes / 1e9:.1f} GB: "
        f"{plan.gpu_memory_bytes / 1e9:.1f} GB less the {lay['margin']:.0%} margin)"
    )
    return "\n".join(lines)


def graphed_roofline_inputs(model_config: dict, plans: dict, hw) -> tuple[dict, dict]:
    """(weights_seconds, kv_seconds) of fit_graphed for the measured model (`model_config`, one GPU holding every
    expert, its weights in `plans`: name -> QuantPlan) on `hw`, FP8 latent slots: the plan's roofline, as
    step_time.DecodeCost prices a fixed-shape step (torch_decode.fit_graphed's inputs)."""
    bandwidth = hw.hbm_bytes_per_second * hw.decode_bandwidth_efficiency
    weights = {}
    for name, plan in plans.items():
        parts = frozen_bytes(model_config, plan)
        routed_bytes, fmt = parts.get("routed_experts", 0), plan.format_of("routed_experts")
        routed, other = dequantized_values(model_config, plan)
        for kernel in ("dequantize", "triton"):
            cost = DecodeCost(
                model_config,
                hw,
                routed_bytes=routed_bytes,
                other_bytes=sum(parts.values()) - routed_bytes,
                kv_bytes_per_token=0,
                expert_parallel=1,
                routed_format=fmt,
                fixed_shapes=True,
                routed_params=routed,
                other_params=other,
                experts_read_once=kernel == "triton" and fmt == "nf4",
            )  # fmt: the NF4 kernel reads NF4 experts only
            weights[(name, kernel)] = cost.fixed_shape_weight_bytes() / bandwidth
    kv = {a: kv_step_bytes_per_token(model_config, "torch", "fp8", a) / bandwidth for a in ("torch", "triton")}
    return weights, kv
