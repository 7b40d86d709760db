"""Issue 48: MLA's latent decode attention as a Triton kernel (moe_lora.latent_attention, rollout.attention_kernel
triton): each KV slot reads its own positions as stored, the FP8 latent dequantized in registers.

On a GPU the checks (tests/moe_lora/latent_attention_cases.py) run here; on CPU they run in Triton's interpreter,
in a subprocess started with TRITON_INTERPRET=1 (Triton reads it when it is first imported, which this process may
have done already): the same kernel source, its products in float32 where the interpreter cannot multiply bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from allsync.config import ConfigError, parse_config
from allsync.engines.torch_engine import TorchEngine
from tests.allsync.engines.test_decode_graphs import lora_model
from tests.interpreted import run_interpreted
from tests.moe_lora import latent_attention_cases as cases

CASES = "tests.moe_lora.latent_attention_cases"


@pytest.fixture(scope="module")
def interpreted(tiny_bf16):
    """On CPU: the checks' tracebacks from one interpreted run (tests/interpreted.py); on a GPU: None."""
    if torch.cuda.is_available():
        return None
    return run_interpreted(
        CASES,
        {
            "kernel": "kernel_matches_reference()",
            "blocks": "other_blocks_give_the_same_attention()",
            "engine": f"engine_decodes_as_the_torch_path({str(tiny_bf16)!r})",
        },
    )


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_kernel_matches_softmax_attention_over_each_slots_own_positions(interpreted):
    if interpreted is None:
        cases.kernel_matches_reference("cuda")
    else:
        assert "kernel" not in interpreted, interpreted["kernel"]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_other_kernel_blocks_give_the_same_attention(interpreted):
    if interpreted is None:
        cases.other_blocks_give_the_same_attention("cuda")
    else:
        assert "blocks" not in interpreted, interpreted["blocks"]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_engine_decodes_with_the_kernel_what_it_decodes_without(tiny_bf16, interpreted):
    if interpreted is None:
        cases.engine_decodes_as_the_torch_path(str(tiny_bf16), "cuda")
    else:
        assert "engine" not in interpreted, interpreted["engine"]


def test_attention_kernel_is_checked_naming_the_key(tiny_bf16, monkeypatch):
    base = {"model": {"base": str(tiny_bf16)}}
    with pytest.raises(ConfigError, match=r"rollout.attention_kernel = 'flash': use torch or triton"):
        parse_config({**base, "rollout": {"attention_kernel": "flash"}})
    with pytest.raises(ConfigError, match=r"rollout.attention_kernel triton with rollout.engine vllm"):
        parse_config({**base, "rollout": {"attention_kernel": "triton", "engine": "vllm"}})
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ConfigError, match=r"rollout.attention_kernel triton with parallel.device cpu"):
            parse_config({**base, "rollout": {"attention_kernel": "triton"}})
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter: accepted (slowly)
        assert parse_config({**base, "rollout": {"attention_kernel": "triton"}}).rollout.attention_kernel == "triton"


def test_the_engine_refuses_the_kernel_where_its_slots_hold_no_latent(tiny_bf16, monkeypatch):
    """The tiny model's 4 heads keep expanded keys and values (no larger than the latent): the kernel has no latent to
    read unless the cache is FP8; on CPU without the interpreter it cannot run at all."""
    model = lora_model(tiny_bf16, "nf4")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"rollout.attention_kernel triton: deepseek_v3 keeps its KV slots expanded"):
        TorchEngine(model, eos_id=1, pad_id=2, attention_kernel="triton")
    assert TorchEngine(model, 1, 2, kv_cache_dtype="fp8", attention_kernel="triton").attention_kernel
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"rollout.attention_kernel triton: the model is on cpu"):
        TorchEngine(model, 1, 2, kv_cache_dtype="fp8", attention_kernel="triton")


def test_heads_a_program_shrink_until_the_tiles_fit_in_shared_memory():
    from moe_lora.latent_attention import KernelBlocks, heads_per_program

    v3 = 512 + 64  # the padded latent and rotary widths of DeepSeek-V3
    assert heads_per_program(KernelBlocks(), v3, 2) == 64  # bf16: the cut measured fastest on the H200
    assert heads_per_program(KernelBlocks(), v3, 4) == 16  # float32: 64 heads failed on the H200, 16 ran
    assert heads_per_program(KernelBlocks(64, 64, 8), 128 + 32, 4) == 64  # ran on the H200 (other_blocks_...)
    assert heads_per_program(KernelBlocks(16, 32, 8), v3, 4) == 16  # never below 16, tl.dot's smallest M
