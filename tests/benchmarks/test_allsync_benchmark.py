"""benchmarks/allsync.py: the sync-size formula against a real attached adapter."""

import json

import pytest
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


def test_the_predicted_ratio_from_the_colocated_phases():
    """Two workers that each generate 3 s and train 1 s (sync 0.5 s) take 4.5 s all-sync; disaggregated, one
    generates 6 s and one trains 2 s at the speed of one busy process (1.25x faster here): 4.8 + 0.5 + 1.6 s."""
    from benchmarks.allsync import predicted_ratio

    worker = {"generate_seconds": 2.5, "reward_seconds": 0.5, "train_seconds": 1.0, "sync_seconds": 0.5}
    ratio = predicted_ratio([[worker, worker]], {"speed_all": 100.0, "speed_half": 125.0})
    assert ratio == pytest.approx((6 * 0.8 + 0.5 + 2 * 0.8) / 4.5)
