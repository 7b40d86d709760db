"""vLLM's decode step priced from published DeepSeek-V3 serving runs: the plan's roofline (step_time.DecodeCost) times
the factor those runs measure against it (`vllm_decode_factor`), divided by the share of no-LoRA decode that LoRA on
the routed experts keeps.

    vLLM step(B, C) = roofline(B, C) x F / EXPERT_LORA_DECODE_SHARE   (LoRA on routed experts)
                    = roofline(B, C) x F                              (otherwise)

A published run's factor is its decode step (batch per GPU / output tokens per second per GPU) over the roofline of
the same step (DeepSeek-V3's FP8 weights, its EP group's share of the routed experts, the batch's bf16 latent KV
cache, the same GPU's peaks: an H800 has the H100's HBM and bf16 FLOP/s): below 1 where the run is faster than the
roofline (which prices decode FLOPs at the training forward's measured share of the peak and the expert exchange
serially, where the runs overlap two micro-batches). F is the largest (slowest) factor of the runs whose batch and
context are stated, without MTP (`published_factors`: 0.58-0.73, F = 0.73, LMSYS's 96 H100;
tests/allsync/test_plan_vllm_decode.py recomputes them): a conservative reading, as the runs that state them are
SGLang's, DeepSeek's and RTP-LLM's engines, and vLLM's own figure (llm-d's wide EP on H200) states neither.

The expert-LoRA share: no vLLM source gives one. SGLang's Triton MoE-LoRA backend (the same design as vLLM's
fused_moe_lora Triton kernels) keeps 62-65% of no-LoRA decode; its fast path 78-89% on Kimi-K2.5 (DeepSeek-V3's
architecture) at batch 16-128; the plan takes the low end (`allsync plan --expert-lora-share` for another).
Speculative decoding with V3's MTP layer is not priced: at RL's batch sizes its published gain shrinks to +14-18%
(below), and the loop does not run it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedDecode:
    source: str  # where the figure is, with the words that state it
    gpu: str  # the plan's preset with the same HBM bandwidth and bf16 peak (an H800 is an H100's)
    expert_parallel: int
    batch_per_gpu: int | None  # None: not stated
    context_tokens: int | None  # KV cache per sequence, None: not stated
    tokens_per_second_per_gpu: float  # output tokens
    mtp: bool | None  # speculative decoding with MTP on (None: not stated)

    @property
    def stated(self) -> bool:
        """Batch and context both stated: a factor can be taken against the roofline."""
        return self.batch_per_gpu is not None and self.context_tokens is not None


PUBLISHED = (
    PublishedDecode(
        "vLLM blog 2025-12-17 (blog.vllm.ai/2025/12/17/large-scale-serving.html) and llm-d 0.3 (2025-10-10): "
        "'a sustained throughput of 2.2k tokens/s per H200 GPU in production-like, multi-node deployments' (wide "
        "EP; llm-d's wide-EP guide decodes at DP 16); batch and lengths only in charts",
        "h200",
        16,
        None,
        None,
        2200.0,
        None,
    ),
    PublishedDecode(
        "DeepSeek, Open Source Week day 6 (github.com/deepseek-ai/open-infra-index, 202502OpenSourceWeek/"
        "day_6_one_more_thing_deepseekV3R1_inference_system_overview.md): decode EP144 on H800, 'the average kvcache "
        "length per output token was 4,989 tokens', '~14.8k tokens/s output' per node of 8; batch 128 a GPU as "
        "LMSYS's table (below) gives it",
        "h100",
        144,
        128,
        4989,
        14800 / 8,
        None,
    ),
    PublishedDecode(
        "LMSYS/SGLang, 2025-05-05 (lmsys.org/blog/2025-05-05-large-scale-ep/): 96 H100, decode EP72, 'achieved "
        "22,282 tokens/sec per node for 2K inputs', batch 256",
        "h100",
        72,
        256,
        2000,
        22282 / 8,
        False,
    ),
    PublishedDecode(
        "LMSYS/SGLang, same blog: 'Under simulated MTP conditions ... 17,373 tokens/sec per node for 4K inputs' "
        "(60% acceptance assumed), batch 128",
        "h100",
        72,
        128,
        4000,
        17373 / 8,
        True,
    ),
    PublishedDecode(
        "DeepSeek's profile data as LMSYS tabulates it (same blog): 16 nodes of H800, batch 128, KV 4,096, 18,598 "
        "tokens/s per node",
        "h100",
        128,
        128,
        4096,
        18598 / 8,
        None,
    ),
    PublishedDecode(
        "RTP-LLM's DeepSeek tech report (github.com/alibaba/rtp-llm, docs/RTP-LLM-DeepSeek-Replay-Tech-Report.md): "
        "decode on 144 H800 at EP144, 4K input / 2K output, 'at 13200 concurrency ... 1850 TPS per GPU' (91.7 a GPU; "
        "context 4,096 + half the output)",
        "h100",
        144,
        13200 // 144,
        4096 + 1000,
        1850.0,
        None,
    ),
)

# vLLM MTP (github.com/vllm-project/vllm/pull/12755, R1, k=1): 81-82.3% acceptance, 1.63x at QPS 1, 1.18x at QPS 2,
# less toward QPS 8; SGLang at 128 H200 under full load (lmsys.org/blog/2025-07-17-mtp/): +14.2%. Not priced.
EXPERT_LORA_DECODE_SHARES = {
    # github.com/sgl-project/sglang/pull/27329: 'The default `triton` LoRA backend ... sustains only ~62-65% of the
    # no-LoRA ceiling' (Qwen3.5-35B-A3B-FP8, Kimi-K2.5-NVFP4)
    "sglang triton moe-lora": 0.62,
    # github.com/sgl-project/sglang/pull/28953: Kimi-K2.5-NVFP4 on 2 x 8 GB300, EP8, rank 16: 78% / 85% / 89% / 89%
    # of base at batch 16 / 32 / 64 / 128
    "sglang fast path, batch 16": 0.78,
    "sglang fast path, batch 128": 0.89,
}
EXPERT_LORA_DECODE_SHARE = EXPERT_LORA_DECODE_SHARES["sglang triton moe-lora"]


def roofline_step_seconds(point: PublishedDecode) -> float:
    """The plan's roofline of `point`'s decode step: DeepSeek-V3 as released (FP8), n_routed_experts / EP experts
    a GPU, batch_per_gpu sequences of context_tokens each, vLLM's latent KV cache."""
    from allsync.plan.fit import kv_step_bytes_per_token
    from allsync.plan.hardware import GPUS
    from allsync.plan.shapes import DEEPSEEK_V3
    from allsync.plan.step_time import DecodeCost, decode_attention_flops_per_token
    from allsync.plan.weights import engine_bytes, stored_plan

    weights = engine_bytes(DEEPSEEK_V3, point.expert_parallel)
    routed = weights.get("routed_experts", 0)
    cost = DecodeCost(
        DEEPSEEK_V3,
        GPUS[point.gpu],
        routed,
        sum(weights.values()) - routed,
        kv_step_bytes_per_token(DEEPSEEK_V3, "vllm"),
        point.expert_parallel,
        stored_plan(DEEPSEEK_V3).format_of("routed_experts"),
        decode_attention_flops_per_token(DEEPSEEK_V3, latent=True),
    )
    return cost.decode_step_seconds(point.batch_per_gpu, point.batch_per_gpu * point.context_tokens)


def published_factor(point: PublishedDecode) -> float:
    """`point`'s decode step over the plan's roofline of it: (batch / tokens per second) / roofline."""
    return point.batch_per_gpu / point.tokens_per_second_per_gpu / roofline_step_seconds(point)


@functools.cache
def published_factors() -> tuple[tuple[PublishedDecode, float], ...]:
    """(point, factor) of every published run whose batch and context are stated, MTP's apart (the loop does not run
    speculative decoding)."""
    return tuple((p, published_factor(p)) for p in PUBLISHED if p.stated and p.mtp is not True)


@functools.cache
def vllm_decode_factor() -> float:
    """F (module docstring): the largest factor of the stated runs."""
    return max(factor for _, factor in published_factors())


def factor_and_share(hw) -> tuple[float, float]:
    """(F, S) on `hw` (a Hardware): its vllm_decode_factor or the published runs', its expert_lora_decode_share or
    EXPERT_LORA_DECODE_SHARE."""
    factor = hw.vllm_decode_factor if hw.vllm_decode_factor is not None else vllm_decode_factor()
    share = hw.expert_lora_decode_share if hw.expert_lora_decode_share is not None else EXPERT_LORA_DECODE_SHARE
    return factor, share


def vllm_step_factor(hw, routed_expert_lora: bool) -> float:
    """vLLM's decode step over the plan's roofline on `hw`: F, over S where the routed experts carry LoRA."""
    factor, share = factor_and_share(hw)
    return factor / share if routed_expert_lora else factor
