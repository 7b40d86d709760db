"""allsync plan: the activation trace, the two phases of a worker's memory, the verdict and the command's errors."""

import json

import pytest
import torch

from allsync.cli import main
from allsync.plan.command import parse_size
from allsync.plan.activations import saved_per_layer, trace_saved_bytes
from moe_lora.lora import LoRAConfig, attach_lora
from moe_lora.tiny import TinySpec, make_tiny
from quant.loader import QuantPlan, load_frozen_model

TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense_mlp", "shared_experts", "routed_experts")
SPEC = TinySpec(layers=5, dense_layers=2, experts=8, experts_per_token=2)


def test_the_two_layer_trace_gives_a_deeper_models_saved_bytes(tmp_path):
    """The trace's per-token and per-layer numbers, extrapolated to 2 dense + 3 MoE layers, give what that model's
    forward saves for backward at another token count (no checkpointing: the saved tensors are the peak's). Within
    2%: the trace's MoE layer holds the top-k experts (2), this model 8, and the constant part an expert adds
    (its LoRA factors cast to bf16) is not in the trace."""
    base = make_tiny(tmp_path / "m", SPEC)
    config = json.loads((base / "config.json").read_text())
    saved = trace_saved_bytes(config, 8, TARGETS, "bfloat16")
    model = load_frozen_model(str(base), QuantPlan.uniform("bf16"), compute_dtype=torch.bfloat16, progress=False)
    attach_lora(model, LoRAConfig(8, 16, TARGETS))
    measured = sum(saved_per_layer(model, 48, checkpointing=False).values())
    assert saved.peak(config, 48, checkpointing=False) == pytest.approx(measured, rel=0.02)
    kept = sum(saved_per_layer(model, 48, checkpointing=True).values())  # checkpointing keeps each layer's input
    assert kept == 48 * (5 * saved.layer_input + saved.post)
    assert saved.moe > 0 and saved.dense > 0


def test_sizes_are_parsed_or_refused_naming_the_flag():
    assert parse_size("80GB", "--gpu-memory") == 80e9 and parse_size("141GiB", "--gpu-memory") == 141 * 2**30
    assert parse_size("25GB/s", "--host-link", per_second=True) == 25e9
    with pytest.raises(ValueError, match="--gpu-memory 'eighty'"):
        parse_size("eighty", "--gpu-memory")
    with pytest.raises(ValueError, match="--host-link '25GB': give a rate"):
        parse_size("25GB", "--host-link", per_second=True)


def test_the_671b_plan_on_48_h100s(trace_cache, tmp_path, capsys):
    config = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--config", config, "--shape", "deepseek-v3", "--colocation", "sleep", "--json", str(out)]) == 0
    )
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    parts = plan["per_gpu_bytes"]
    for key in ("routed_experts", "shared_experts", "attention", "dense_mlp", "embeddings", "lora", "lora_grads"):
        assert parts[key] > 0, key
    assert parts["optimizer"] == 2 * parts["lora"] and parts["engine_weights"] > parts["routed_experts"]
    frozen = sum(parts[k] for k in ("routed_experts", "shared_experts", "attention", "dense_mlp", "embeddings"))
    assert frozen / 1e9 == pytest.approx(41.86, abs=0.01)  # tests/allsync/test_plan.py's 42.07 GB less norms/router
    # activation checkpointing at one 21,504-token sequence, offloaded: the 61 layer inputs and the final part wait in
    # host memory; on the GPU one MoE layer recomputed with its input
    assert plan["tokens_per_forward"] == 21504 and 10e9 < parts["activations"] < 15e9
    assert 18e9 < plan["offloaded_activation_bytes"] < 22e9
    assert plan["host_bytes_per_gpu"] == parts["engine_weights"] + plan["offloaded_activation_bytes"]  # sleep, training
    assert plan["train_bytes"] == sum(parts[k] for k in parts if k not in ("engine_weights", "kv_cache"))
    assert plan["layout"] == {
        "gpus": 48,
        "expert_parallel": 16,
        "experts_per_gpu": 16,
        "engine": "vllm",
        "colocation": "sleep",
        "activation_checkpointing": True,
        "activation_offload": True,
        "prompt_tokens": 1024,
        "frozen_formats": "model.quant",
    }
    assert plan["fits"] and plan["total_bytes"] <= 80e9 and "verdict: fits" in text
    assert "parallel.expert_parallel = 16 with rollout.engine vllm" in plan["refused"]  # the loop still refuses it
    assert (
        main(
            [
                "plan",
                "--config",
                config,
                "--shape",
                "deepseek-v3",
                "--gpus",
                "64",
                "--expert-parallel",
                "32",
                "--colocation",
                "sleep",
                "--json",
                str(out),
            ]
        )
        == 2
    )  # 480 prompts do not split over 64 GPUs
    assert "rollout.prompts_per_step = 480 does not split" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "40"], r"--gpus 40 / --expert-parallel 16 \(parallel.expert_parallel\)"),
        (["--expert-parallel", "3", "--gpus", "48"], r"the expert-parallel size must divide"),
        (["--gpu-memory", "lots"], r"--gpu-memory 'lots'"),
    ],
)
def test_a_layout_or_size_the_plan_cannot_use_is_refused_naming_the_flag(trace_cache, args, message, capsys):
    config = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
    assert main(["plan", "--config", config, "--shape", "deepseek-v3", *args]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_a_base_not_on_this_machine_needs_a_shape(capsys):
    config = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"
    assert main(["plan", "--config", config]) == 2
    assert "model.base = '/checkpoints/DeepSeek-V3' has no config.json here: name its shape with --shape" in (
        capsys.readouterr().err
    )
