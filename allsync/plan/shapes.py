"""Model shapes known by name, for planning a run whose checkpoint is not on this machine: the keys of their
config.json that the plan reads (`allsync plan --shape NAME`)."""

from __future__ import annotations

from quant.layout import FP8_QUANTIZATION_CONFIG

# DeepSeek-V3 and R1 (671B; the same shapes), from the released config.json; stored in FP8 with 128x128 block scales
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    quantization_config=FP8_QUANTIZATION_CONFIG,
)
# Kimi K2 (1.04T, 32B active; Kimi-K2-Instruct's released config.json: DeepSeek-V3's architecture with 384 experts,
# 64 heads, one dense layer, no expert groups), stored in FP8 with 128x128 block scales
KIMI_K2 = dict(
    DEEPSEEK_V3,
    vocab_size=163840,
    num_attention_heads=64,
    first_k_dense_replace=1,
    n_routed_experts=384,
    n_group=1,
    topk_group=1,
    max_position_embeddings=131072,
)
SHAPES = {"deepseek-v3": DEEPSEEK_V3, "deepseek-r1": DEEPSEEK_V3, "kimi-k2": KIMI_K2}


def tiny_spec_fields(config: dict, layers: int, dense_layers: int, experts: int, **overrides) -> dict:
    """moe_lora.tiny.TinySpec's fields for a checkpoint of `layers` layers (`dense_layers` dense) and `experts` routed
    experts with `config`'s per-token shapes (hidden size, attention, MLP widths, experts per token, expert groups)."""
    fields = dict(
        layers=layers,
        dense_layers=dense_layers,
        experts=experts,
        experts_per_token=config["num_experts_per_tok"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        moe_intermediate_size=config["moe_intermediate_size"],
        heads=config["num_attention_heads"],
        q_lora_rank=config["q_lora_rank"],
        kv_lora_rank=config["kv_lora_rank"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        v_head_dim=config["v_head_dim"],
        n_group=config.get("n_group", 1),
        topk_group=config.get("topk_group", 1),
    )
    return {**fields, **overrides}
