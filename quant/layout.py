"""DeepSeek-V3's on-disk tensor layout, derived from config.json alone.

One source of truth for the tensors a checkpoint must hold: `allsync make-tiny` writes exactly these,
the streaming loader checks a checkpoint against them before it loads anything.

Module groups (the unit a quantization format is chosen for):
  attention       MLA projections q_a/q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj
  dense_mlp       the MLP of the first `first_k_dense_replace` layers
  shared_experts  the shared-expert MLP of MoE layers
  routed_experts  mlp.experts.{e}.{gate,up,down}_proj of MoE layers
  embed, lm_head, norm, router   always kept in their checkpoint dtype (never quantized)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

QUANTIZABLE_GROUPS = ("routed_experts", "shared_experts", "attention", "dense_mlp")
KEPT_GROUPS = ("embed", "lm_head", "norm", "router")
FP8_BLOCK = 128
# DeepSeek-V3's own quantization_config (config.json) for its FP8 release.
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "activation_scheme": "dynamic",
}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    group: str

    @property
    def quantizable(self) -> bool:
        """Linear weights of the quantizable groups (2-D); norms inside attention are not."""
        return self.group in QUANTIZABLE_GROUPS and len(self.shape) == 2


def is_moe_layer(config: dict, layer: int) -> bool:
    """V3 rule: layer l is MoE iff l >= first_k_dense_replace and l % moe_layer_freq == 0."""
    return (
        config.get("n_routed_experts") is not None
        and layer >= config.get("first_k_dense_replace", 0)
        and layer % config.get("moe_layer_freq", 1) == 0
    )


def _mlp(prefix: str, hidden: int, inter: int, group: str) -> dict[str, TensorSpec]:
    return {
        f"{prefix}.gate_proj.weight": TensorSpec((inter, hidden), group),
        f"{prefix}.up_proj.weight": TensorSpec((inter, hidden), group),
        f"{prefix}.down_proj.weight": TensorSpec((hidden, inter), group),
    }


def _attention(prefix: str, c: dict) -> dict[str, TensorSpec]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    specs: dict[str, TensorSpec] = {}
    if c.get("q_lora_rank"):
        specs[f"{prefix}.q_a_proj.weight"] = TensorSpec((c["q_lora_rank"], h), "attention")
        specs[f"{prefix}.q_a_layernorm.weight"] = TensorSpec((c["q_lora_rank"],), "attention")
        specs[f"{prefix}.q_b_proj.weight"] = TensorSpec((heads * qk_head, c["q_lora_rank"]), "attention")
    else:
        specs[f"{prefix}.q_proj.weight"] = TensorSpec((heads * qk_head, h), "attention")
    kv = c["kv_lora_rank"]
    specs[f"{prefix}.kv_a_proj_with_mqa.weight"] = TensorSpec((kv + c["qk_rope_head_dim"], h), "attention")
    specs[f"{prefix}.kv_a_layernorm.weight"] = TensorSpec((kv,), "attention")
    specs[f"{prefix}.kv_b_proj.weight"] = TensorSpec(
        (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv), "attention"
    )
    specs[f"{prefix}.o_proj.weight"] = TensorSpec((h, heads * c["v_head_dim"]), "attention")
    return specs


def expected_tensors(config: dict) -> dict[str, TensorSpec]:
    """Every tensor key of a DeepSeek-V3 checkpoint (bf16 layout; FP8 adds `*.weight_scale_inv`)."""
    c, h = config, config["hidden_size"]
    specs = {"model.embed_tokens.weight": TensorSpec((c["vocab_size"], h), "embed")}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        specs[f"{p}.input_layernorm.weight"] = TensorSpec((h,), "norm")
        specs[f"{p}.post_attention_layernorm.weight"] = TensorSpec((h,), "norm")
        specs.update(_attention(f"{p}.self_attn", c))
        if is_moe_layer(c, layer):
            experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
            specs[f"{p}.mlp.gate.weight"] = TensorSpec((experts, h), "router")
            specs[f"{p}.mlp.gate.e_score_correction_bias"] = TensorSpec((experts,), "router")
            for e in range(experts):
                specs.update(_mlp(f"{p}.mlp.experts.{e}", h, inter, "routed_experts"))
            shared = inter * c.get("n_shared_experts", 1)
            specs.update(_mlp(f"{p}.mlp.shared_experts", h, shared, "shared_experts"))
        else:
            specs.update(_mlp(f"{p}.mlp", h, c["intermediate_size"], "dense_mlp"))
    specs["model.norm.weight"] = TensorSpec((h,), "norm")
    specs["lm_head.weight"] = TensorSpec((c["vocab_size"], h), "lm_head")
    return specs


def fp8_scale_shape(shape: tuple[int, int], block: int = FP8_BLOCK) -> tuple[int, int]:
    """One scale per block x block tile, edge tiles partial: (ceil(out/block), ceil(in/block))."""
    return (-(-shape[0] // block), -(-shape[1] // block))


SCALE_SUFFIX = ".weight_scale_inv"


def scale_key(weight_key: str) -> str:
    return weight_key[: -len(".weight")] + SCALE_SUFFIX


_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def parse_expert_key(key: str) -> tuple[int, int, str] | None:
    """`model.layers.L.mlp.experts.E.P_proj.weight` -> (L, E, P), else None."""
    m = _EXPERT_KEY.match(key)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None
