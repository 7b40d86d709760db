"""allsync.plan's bytes per worker against what the loader and LoRA really allocate: the tiny checkpoints loaded
in every format at expert-parallel sizes 1, 2 and 4, and two real-size DeepSeek-V3 layers measured on an H200."""

import json
from pathlib import Path

import pytest
import torch

from allsync.plan.weights import frozen_bytes, lora_values, trainer_bytes, weight_bytes
from moe_lora.lora import LoRAConfig, attach_lora
from quant.checkpoint_io import read_config
from quant.loader import QuantPlan, byte_report, load_frozen_model

ROOT = Path(__file__).parents[2]
GROUP_OF_ROW = {
    "embed": "embeddings",
    "lm_head": "embeddings",
    "norm": "norms_and_router",
    "router": "norms_and_router",
}
PLANS = {
    "bf16": QuantPlan.uniform("bf16"),
    "fp8": QuantPlan.uniform("fp8"),
    "nf4 experts": QuantPlan("nf4", "bf16", "bf16", "bf16"),
    "nf4 double quant, int8 rest": QuantPlan("nf4", "int8", "int8", "int8", double_quant=True),
}
TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense_mlp", "shared_experts", "routed_experts")


def measured_by_group(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in byte_report(model):
        group = GROUP_OF_ROW.get(row.group, row.group)
        out[group] = out.get(group, 0) + row.bytes
    return out


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_predicted_bytes_are_the_loaded_models(tiny_fp8, plan_name, ep):
    """Every group's bytes as loaded (byte_report over the tensors the loader placed), the LoRA values attach_lora
    makes: equal to the prediction (the issue asks for 5%)."""
    config, plan = read_config(tiny_fp8), PLANS[plan_name]
    held = config["n_routed_experts"] // ep
    experts = range(held, 2 * held) if ep > 1 else None  # the second rank's block
    model = load_frozen_model(tiny_fp8, plan, compute_dtype=torch.float32, progress=False, experts=experts)
    assert frozen_bytes(config, plan, "float32", experts) == measured_by_group(model)
    attach_lora(model, LoRAConfig(4, 8.0, TARGETS))
    made = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_values(config, 4, TARGETS, experts) == made


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_predicted_lora_values_of_shared_outer_are_the_models(tiny_fp8, ep):
    """lora.expert_layout shared_outer: the values attach_lora makes (per expert: B of gate/up, A of down; once a
    layer: A of gate/up and B of down) are the plan's, fewer than per_expert's, split as routed_lora_values says."""
    from allsync.plan.weights import routed_lora_values
    from moe_lora.lora_layers import LoRAExperts

    config = read_config(tiny_fp8)
    held = config["n_routed_experts"] // ep
    experts = range(held, 2 * held) if ep > 1 else None
    model = load_frozen_model(tiny_fp8, PLANS["bf16"], compute_dtype=torch.float32, progress=False, experts=experts)
    attach_lora(model, LoRAConfig(4, 8.0, TARGETS, expert_layout="shared_outer"))
    made = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_values(config, 4, TARGETS, experts, "shared_outer") == made < lora_values(config, 4, TARGETS, experts)
    per_expert, shared = routed_lora_values(config, 4, experts, "shared_outer")
    modules = [m for m in model.modules() if isinstance(m, LoRAExperts)]
    assert per_expert == sum(p.numel() for m in modules for p in m.per_expert_parameters())
    assert shared == sum(p.numel() for m in modules for p in m.shared_parameters().values())


def test_weight_bytes_by_format():
    assert weight_bytes((256, 128), "bf16") == 65536
    assert weight_bytes((256, 130), "fp8") == 256 * 130 + 4 * 2 * 2  # partial edge tiles have their own scale
    assert weight_bytes((256, 128), "nf4") == 16384 + 4 * 512
    assert weight_bytes((256, 128), "nf4", double_quant=True) == 16384 + 512 + 4 * 2 + 4
    assert weight_bytes((256, 128), "int8") == 32768 + 4 * 256


def test_predictions_against_the_h200_measurement():
    """Two real-size DeepSeek-V3 layers on an H200 (benchmarks/v3_layer_memory.py, 2026-11-26): the frozen model in
    both plans, one rank's share at expert-parallel size 16, LoRA and AdamW, within 1% of torch.cuda.memory_allocated."""
    from benchmarks.v3_layer_memory import EP16_EXPERTS, PLANS as MEASURED_PLANS, v3_config

    measured = json.loads((ROOT / "benchmarks" / "measured" / "v3_layer_memory_h200.json").read_text())
    config = v3_config(measured["shape"], 21504)
    values = lora_values(config, measured["rank"], tuple(measured["targets"]))
    for p in measured["plans"]:
        plan = MEASURED_PLANS[p["plan"]]
        predicted = {
            "frozen": sum(frozen_bytes(config, plan).values()),
            "frozen_ep16_shard": sum(frozen_bytes(config, plan, experts=EP16_EXPERTS).values()),
            "lora": 4 * values,
            "adamw": 8 * values,
        }
        for key, bytes_ in predicted.items():
            assert bytes_ == pytest.approx(p[key]["measured"], rel=0.01), (p["plan"], key)


def test_trainer_bytes_of_a_run_config(tiny_fp8):
    from allsync.config import parse_config

    run = parse_config({"model": {"base": str(tiny_fp8)}, "parallel": {"workers_per_node": 2, "expert_parallel": 2}})
    config = read_config(tiny_fp8)
    out = trainer_bytes(run, config, run.parallel.expert_parallel)
    held = config["n_routed_experts"] // 2
    assert (
        out["routed_experts"] == frozen_bytes(config, run.model.quant.plan(), "float32", range(held))["routed_experts"]
    )
    assert out["optimizer"] == 2 * out["lora"] == 2 * out["lora_grads"] > 0
