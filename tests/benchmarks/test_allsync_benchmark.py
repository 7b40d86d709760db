"""benchmarks/allsync.py: the sync-size formula against a real attached adapter."""

import json

import torch

from benchmarks.allsync import DEEPSEEK_V3, sync_sizes
from moe_lora.lora import DEFAULT_TARGETS, LoRAConfig, attach_lora, lora_state_dict
from quant.loader import QuantPlan, load_frozen_model


def test_adapter_bytes_equal_an_attached_adapter(tiny_bf16):
    model = load_frozen_model(tiny_bf16, QuantPlan.uniform("bf16"), compute_dtype=torch.float32, progress=False)
    attach_lora(model, LoRAConfig(rank=4, alpha=8))
    lora_values = sum(t.numel() for t in lora_state_dict(model).values())
    config = json.loads((tiny_bf16 / "config.json").read_text())
    assert sync_sizes(config, list(DEFAULT_TARGETS), 4, bytes_per_value=1)["adapter_bytes"] == lora_values


def test_deepseek_v3_full_weights_are_671b_parameters():
    full = sync_sizes(DEEPSEEK_V3, list(DEFAULT_TARGETS), 32, bytes_per_value=1)["merged_bytes"]
    assert 670e9 < full < 672e9  # 671B without the MTP layer
