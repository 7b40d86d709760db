"""Issue 48: the frozen routed experts' grouped GEMM reading NF4 directly (quant.fused_experts, rollout.frozen_expert_kernel
triton): the fixed-shape decode step without a dequantized copy of every held expert.

On a GPU the checks (tests/quant/fused_experts_cases.py) run here; on CPU in Triton's interpreter, in a fresh
interpreter (tests/interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from quant.formats import quantize_weight
from quant.fused_experts import nf4_stackable, stack_nf4_experts
from tests.interpreted import run_interpreted
from tests.quant import fused_experts_cases as cases

CASES = "tests.quant.fused_experts_cases"


@pytest.fixture(scope="module")
def interpreted(tiny_bf16):
    """On CPU: the checks' tracebacks from one interpreted run (tests/interpreted.py); on a GPU: None."""
    if torch.cuda.is_available():
        return None
    engine = f"engine_decodes_as_the_dequantized_experts({str(tiny_bf16)!r})"
    checks = {"kernel": "kernel_matches_dequantized_matmul()", "blocks": "other_blocks_give_the_same_product()"}
    return run_interpreted(CASES, checks | {"engine": engine})


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_kernel_multiplies_each_experts_rows_by_its_nf4_weight(interpreted):
    if interpreted is None:
        cases.kernel_matches_dequantized_matmul("cuda")
    else:
        assert "kernel" not in interpreted, interpreted["kernel"]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_other_kernel_blocks_give_the_same_product(interpreted):
    if interpreted is None:
        cases.other_blocks_give_the_same_product("cuda")
    else:
        assert "blocks" not in interpreted, interpreted["blocks"]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_fixed_shape_decode_step_samples_with_the_kernel_what_it_samples_without(tiny_bf16, interpreted):
    if interpreted is None:
        cases.engine_decodes_as_the_dequantized_experts(str(tiny_bf16), "cuda")
    else:
        assert "engine" not in interpreted, interpreted["engine"]


def test_only_single_quantized_nf4_experts_of_one_shape_stack():
    w = torch.randn(8, 64)
    assert nf4_stackable([quantize_weight(w, "nf4")] * 2) is None
    assert "stored as fp8" in nf4_stackable([quantize_weight(w, "fp8")])
    assert "double-quantized" in nf4_stackable([quantize_weight(w, "nf4", double_quant=True)])
    assert "differ in shape" in nf4_stackable([quantize_weight(w, "nf4"), quantize_weight(w[:4], "nf4")])
    with pytest.raises(ValueError, match="stack_nf4_experts: the experts' NF4 absmax is double-quantized"):
        stack_nf4_experts([quantize_weight(w, "nf4", double_quant=True)])


def test_frozen_expert_kernel_is_checked_naming_the_key(tiny_bf16):
    from allsync.config import ConfigError, parse_config

    base = {"model": {"base": str(tiny_bf16)}}
    with pytest.raises(ConfigError, match=r"rollout.frozen_expert_kernel = 'cutlass': use dequantize or triton"):
        parse_config({**base, "rollout": {"frozen_expert_kernel": "cutlass"}})
    with pytest.raises(ConfigError, match=r"rollout.frozen_expert_kernel triton without rollout.decode_graphs"):
        parse_config({**base, "rollout": {"frozen_expert_kernel": "triton"}})
    graphed = {  # what rollout.decode_graphs needs, so that the experts' format is what is refused
        "model": {"base": str(tiny_bf16), "compute_dtype": "bfloat16", "quant": {"routed_experts": "fp8"}},
        "parallel": {"device": "cuda"},
        "rollout": {"decode_graphs": True, "frozen_expert_kernel": "triton"},
    }
    with pytest.raises(
        ConfigError, match=r"frozen_expert_kernel triton with model.quant.routed_experts fp8: the kernel"
    ):
        parse_config(graphed)


def test_the_engine_refuses_the_kernel_without_the_fixed_shape_step_or_a_gpu(tiny_bf16, monkeypatch):
    from allsync.engines.torch_engine import TorchEngine
    from tests.allsync.engines.test_decode_graphs import lora_model

    model = lora_model(tiny_bf16, "nf4")
    with pytest.raises(ValueError, match=r"frozen_expert_kernel triton without rollout.decode_graphs"):
        TorchEngine(model, 1, 2, frozen_expert_kernel="triton")
    from allsync.engines import torch_engine

    monkeypatch.setattr(torch_engine, "check_graphable", lambda model: None)  # decode_graphs' own GPU check apart
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"frozen_expert_kernel triton: the model is on cpu"):
        TorchEngine(model, 1, 2, decode_graphs=True, frozen_expert_kernel="triton")
    fp8 = lora_model(tiny_bf16, "fp8")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(
        ValueError, match=r"frozen_expert_kernel triton: model.layers.1.mlp.experts.base.gate: the experts"
    ):
        TorchEngine(fp8, 1, 2, decode_graphs=True, frozen_expert_kernel="triton")
