"""A worker's rollout engine and the adapter sync into it.

    engine = build_engine(config, model, tokenizer, device, groups, launcher, model_len)
    moved, gap = sync_adapter(engine, tensors, version, model, tokenizer, tolerance)

rollout.engine torch generates with the training model itself (or, with rollout.engine_formats, a second frozen copy
whose LoRA tensors are the trainer's own: `engine_copy`), so a sync moves nothing. vllm builds a vLLM engine in this
process on the same checkpoint and gives it the LoRA tensors after every update (adapter-only sync), which it must
show it runs (allsync/engines/sync_check.py). With vLLM's experts over every worker (rollout.engine_expert_parallel)
each rank serves the LoRA of the engine's block of experts, from the rank that trains them (`engine_tensors`).
"""

from __future__ import annotations

import torch

from allsync.config import ConfigError, RunConfig
from allsync.engines.engine_experts import exchange_engine_blocks
from allsync.engines.sync_check import check_sync, effect_gap, probe_ids
from allsync.engines.torch_engine import TorchEngine
from allsync.update.forward import forward_logprobs
from allsync.update.sequences import build_sequences
from moe_lora.lora import LoRAConfig, adapter_parameters, adapters_disabled, attach_lora, set_adapter_parameters
from quant.loader import load_frozen_model
from quant.modules import compute_copy_bytes, keep_compute_copies


def dtype_of(name: str) -> torch.dtype:
    """model.compute_dtype's torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def lora_config(config: RunConfig) -> LoRAConfig:
    """The lora section as moe_lora.lora's LoRAConfig."""
    lc = config.lora
    return LoRAConfig(
        lc.rank,
        lc.alpha,
        tuple(lc.targets),
        lc.dropout,
        lc.use_rslora,
        expert_kernel=lc.expert_kernel,
        expert_layout=lc.expert_layout,
    )


def free_device_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device`: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def keep_compute_copies_within(model, dtype: torch.dtype, device: torch.device) -> int:
    """model.compute_copy: the dequantized copies (quant.modules.keep_compute_copies), refused before they are
    made when they would take more than half of `device`'s free memory."""
    need, free = compute_copy_bytes(model, dtype), free_device_bytes(device)
    if need > free / 2:
        raise ConfigError(
            f"model.compute_copy: a {dtype} copy of the frozen weights needs {need / 2**30:.1f} GiB, more than "
            f"half of the {free / 2**30:.1f} GiB free on {device}; set model.compute_copy: false"
        )
    return keep_compute_copies(model, dtype)


def engine_copy(config: RunConfig, model, device: torch.device):
    """rollout.engine_formats: a second frozen model in those formats (the rest as model.quant) whose LoRA
    tensors are the trainer's own parameters (moe_lora.lora.set_adapter_parameters), so every update reaches it
    with nothing to copy."""
    dtype = dtype_of(config.model.compute_dtype)
    plan = config.model.quant.plan(config.rollout.engine_formats)
    copy = load_frozen_model(config.model.base, plan, compute_dtype=dtype, progress=False, device=device)
    with torch.random.fork_rng(devices=[]):  # its own initial factors are replaced: draw nothing from the run's RNG
        attach_lora(copy, lora_config(config))
    set_adapter_parameters(copy, adapter_parameters(model), "rollout.engine_formats: the trainer's LoRA tensors")
    if config.model.compute_copy:
        keep_compute_copies_within(copy, dtype, device)
    return copy


def engine_context(config: RunConfig, tokenizer, problems, model, max_model_len: int | None) -> int:
    """vLLM's max_model_len: `max_model_len`, or (None) what the producer's requests need for `problems`
    (allsync.tasks.model_len_needed), at least what the sync probe needs; 0 for the torch engine (none)."""
    if config.rollout.engine != "vllm":
        return 0
    wanted = max_model_len or config.producer.model_len(
        config, tokenizer, problems, model.config.max_position_embeddings
    )
    return max(wanted, len(probe_ids(tokenizer)[0]) + 1)


def build_engine(config: RunConfig, model, tokenizer, device, groups, launcher: bool, model_len: int):
    """The engine rollout.engine names, not yet given an adapter. torch: the training model itself (or its
    engine_copy); vllm: a vLLM engine in this process on the same checkpoint, of context `model_len` (engine_context), over every
    worker when rollout.engine_expert_parallel (lockstep through `groups`)."""
    r = config.rollout
    if r.engine == "torch":
        return TorchEngine(
            model if r.engine_formats is None else engine_copy(config, model, device),
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            r.decode_batch,
            lockstep=groups if groups.expert_parallel else None,
            merge_lora=r.merge_lora,
            decode_graphs=r.decode_graphs,
            kv_cache_dtype=r.kv_cache_dtype,
            attention_kernel=r.attention_kernel,
            kv_cache_tokens=r.kv_cache_tokens,
            frozen_expert_kernel=r.frozen_expert_kernel,
            fp8_linear_kernel=r.fp8_linear_kernel,
        )
    from allsync.engines.vllm_engine import VLLMEngine  # refuses what this machine's vLLM cannot run

    lc = config.lora
    return VLLMEngine(
        config.model.base,
        lc.rank,
        lc.alpha,
        lc.use_rslora,
        dtype=config.model.compute_dtype,
        max_model_len=model_len,
        launcher=launcher,
        gpu_memory_utilization=r.gpu_memory_utilization,
        tensor_parallel=r.engine_tensor_parallel,
        lockstep=groups if r.engine_expert_parallel else None,
        lora_targets=lc.targets,
    )


def engine_tensors(engine, tensors: dict, rank: int, world_size: int, layout, groups) -> dict[str, torch.Tensor]:
    """The adapter tensors `engine` serves on this rank from this rank's own `tensors` (PEFT names): those, or with
    the engine's experts sharded over every worker (rollout.engine_expert_parallel) those outside the routed experts
    and the LoRA of the engine's block of experts, from the rank that trains them (allsync/engines/engine_experts.py)."""
    if engine.experts is None:
        return tensors
    k = layout.ep_size if layout is not None else 1
    return exchange_engine_blocks(tensors, rank, world_size, k, engine.num_experts, groups.world, groups.device)


def sync_adapter(engine, tensors, version: int, model, tokenizer, tolerance: float) -> tuple[int, float | None]:
    """The adapter of `version` into the engine; returns (bytes moved, the sync probe's gap or None). The torch
    engine's LoRA tensors are the trainer's own (nothing moves, nothing to check: `tensors` None); an engine with its
    own copy (vLLM) gets `tensors` and must show it runs them (allsync/engines/sync_check.py), or the run stops with
    AdapterSyncError naming the version."""
    if isinstance(engine, TorchEngine):
        return engine.load_adapter(None, version), None
    moved = engine.load_adapter(tensors, version)
    ids, start = probe_ids(tokenizer)
    batch = build_sequences([ids[:start]], [ids[start:]], tokenizer.pad_token_id)
    batch = batch.to(model.get_output_embeddings().weight.device)  # the trainer's device
    scored = batch.response_mask > 0
    with torch.no_grad():
        trainer_with = forward_logprobs(model, batch)[scored]
        with adapters_disabled(model):
            trainer_without = forward_logprobs(model, batch)[scored]
    gap, effect, mismatch = effect_gap(
        engine.score(ids, start), engine.score(ids, start, False), trainer_with, trainer_without
    )
    check_sync(version, engine.sent_checksum, engine.received_checksums, gap, effect, mismatch, tolerance)
    return moved, gap


def take_counters(engine) -> dict[str, int]:
    """The engine's work counters (`engine.counters`: token positions; decode slots and the tokens they produced)
    since the last call, reset to 0."""
    work = {name: getattr(engine, name) for name in engine.counters}
    for name in work:
        setattr(engine, name, 0)
    return work
