"""Will a run fit its GPUs: every part of one worker's memory in the two phases of an all-sync step, and the verdict.

An all-sync worker alternates two phases on the same GPU:

    train      frozen + adapter + activations (+ the engine's weights, colocation resident)
    generate   adapter + the engine's weights + its KV cache (+ frozen, colocation resident)
    frozen     the trainer's frozen model (weights.frozen_bytes); adapter: LoRA + its gradients + AdamW's moments

The torch engine generates with the trainer's own weights (no engine weights); vLLM serves the checkpoint as stored
(its FP8 or bf16 tensors, the worker's block of routed experts), a second copy. Colocation `resident` keeps both
copies on the GPU; `sleep` keeps only the phase's own: vLLM's sleep mode (level 1) moves the engine's weights to host
memory while the trainer trains, and the trainer's frozen weights go to host memory while vLLM generates. That costs
both copies' bytes twice over the host link every step, and host memory for the larger of them per GPU. `shared`
(modelled, not built): vLLM reads the trainer's frozen tensors, one copy; vLLM can only serve what the checkpoint
stores, so the trainer then freezes every group in the stored formats (FP8 for DeepSeek-V3) instead of model.quant's.

Activations: `activations.SavedBytes.peak` at the tokens of one forward (optim.max_tokens_per_forward, or one
full-length sequence if that is longer; without a budget a minibatch's sequences at full length) with the run's activation checkpointing. KV cache: what the generate phase
leaves, in tokens of MLA cache (allsync.engines.vllm_support.mla_kv_bytes_per_token), against what the worker's
sequences of a step need at full length. The run fits when the train phase fits and the generate phase holds at
least one full-length sequence; fewer than all of them at once means generation in waves, not a failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from allsync.plan.activations import SavedBytes
from allsync.plan.weights import FROZEN_PARTS, engine_bytes, stored_plan, trainer_bytes

COLOCATIONS = ("resident", "sleep", "shared")


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
            "layout": self.layout,
            "kv_cache_tokens": self.kv_cache_tokens,
            "sequences_at_once": self.sequences_at_once,
            "sequences": self.sequences,
            "tokens_per_forward": self.tokens_per_forward,
            "sleep_seconds_per_step": self.sleep_seconds,
            "host_bytes_per_gpu": self.host_bytes_per_gpu,
            "offloaded_activation_bytes": self.offloaded_bytes,
        }


def kv_bytes_per_token(model_config: dict) -> int:
    from allsync.engines.vllm_support import mla_kv_bytes_per_token

    return mla_kv_bytes_per_token(model_config)


def tokens_per_forward(run, sequences: int, sequence_tokens: int) -> int:
    """The tokens of one training forward: optim.max_tokens_per_forward (a longer sequence is a forward of its own),
    or without a budget a minibatch's sequences at full length."""
    budget = run.optim.max_tokens_per_forward
    if budget:
        return max(budget, sequence_tokens)
    return max(sequences // run.optim.minibatches, 1) * sequence_tokens


def plan_run(run, model_config: dict, layout: Layout, saved: SavedBytes) -> Plan:
    """The Plan of `run` (a RunConfig) on `layout` for the checkpoint `model_config`; `saved`: the activation trace."""
    experts_total = model_config["n_routed_experts"]
    ep = layout.expert_parallel
    r = run.rollout
    shared = layout.colocation == "shared" and r.engine == "vllm"
    per_gpu = trainer_bytes(run, model_config, ep, stored_plan(model_config) if shared else None)
    resident = sum(per_gpu.values())

    sequences = r.prompts_per_step // layout.gpus * r.group_size
    sequence_tokens = layout.prompt_tokens + r.max_new_tokens
    tokens = tokens_per_forward(run, sequences, sequence_tokens)
    o = run.optim
    per_gpu["activations"] = saved.peak(model_config, tokens, o.activation_checkpointing, o.activation_offload)
    offloaded = saved.offloaded(model_config, tokens, o.activation_checkpointing) if o.activation_offload else 0
    engine = sum(engine_bytes(model_config, ep).values())
    per_gpu["engine_weights"] = engine if r.engine == "vllm" and not shared else 0

    kv_token = kv_bytes_per_token(model_config)
    frozen = sum(per_gpu[name] for name in FROZEN_PARTS)
    sleeping = layout.colocation == "sleep" and r.engine == "vllm"
    train = resident + per_gpu["activations"] + (0 if sleeping else per_gpu["engine_weights"])
    generate_base = resident - (frozen if sleeping else 0) + per_gpu["engine_weights"]
    kv_tokens = max(layout.gpu_memory_bytes - generate_base, 0) // kv_token
    per_gpu["kv_cache"] = min(sequences * sequence_tokens, kv_tokens) * kv_token

    problems = []
    if train > layout.gpu_memory_bytes:
        problems.append(
            f"the train phase needs {train / 1e9:.1f} GB (activations {per_gpu['activations'] / 1e9:.1f} GB at "
            f"{tokens:,} tokens per forward), {(train - layout.gpu_memory_bytes) / 1e9:.1f} GB more than the GPU's "
            f"{layout.gpu_memory_bytes / 1e9:.0f} GB"
        )
    if kv_tokens < sequence_tokens:
        short = generate_base + sequence_tokens * kv_token - layout.gpu_memory_bytes
        problems.append(
            f"the generate phase leaves room for {kv_tokens:,} tokens of KV cache, less than one sequence of "
            f"{sequence_tokens:,} (prompt + rollout.max_new_tokens); it needs {short / 1e9:.1f} GB more"
        )
    host_bytes = max(per_gpu["engine_weights"] + offloaded, frozen) if sleeping else offloaded
    node_gpus = min(layout.gpus, layout.gpus_per_node)
    if host_bytes * node_gpus > layout.host_memory_bytes:
        problems.append(
            f"host memory: {node_gpus} GPUs x {host_bytes / 1e9:.1f} GB (sleep mode's weights, offloaded activations) "
            f"= {host_bytes * node_gpus / 1e9:.0f} GB, more than the node's {layout.host_memory_bytes / 1e9:.0f} GB"
        )
    return Plan(
        per_gpu_bytes=per_gpu,
        train_bytes=train,
        generate_bytes=generate_base + min(sequence_tokens, kv_tokens) * kv_token,
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
        },
        sleep_seconds=2 * (per_gpu["engine_weights"] + frozen) / layout.host_link_bytes_per_second if sleeping else 0.0,
        host_bytes_per_gpu=host_bytes,
        offloaded_bytes=offloaded,
        problems=problems,
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
        f"{'generate phase':<18}{gb(plan.generate_bytes)}  (with one sequence of KV cache)",
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
    lines.append(f"verdict: {verdict} ({plan.total_bytes / 1e9:.1f} of {plan.gpu_memory_bytes / 1e9:.0f} GB)")
    return "\n".join(lines)
