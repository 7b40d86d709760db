"""Checks of quant.fused_experts' kernel, run by tests/quant/test_fused_experts.py: on a GPU in the test process, on
CPU in a fresh interpreter with TRITON_INTERPRET=1 (tests/interpreted.py)."""

from __future__ import annotations

import torch

from quant.fixed_shape_experts import expert_offsets
from quant.formats import quantize_weight
from quant.fused_experts import nf4_grouped_mm, stack_nf4_experts


def kernel_matches_dequantized_matmul(device: str = "cpu") -> None:
    """Experts of DeepSeek-like and odd shapes (rows that are not whole 64-value blocks, N and K not multiples of the
    tiles, K even, read a byte a pair of columns, and odd, a nibble at a time), an expert with no rows, one with more rows than a tile, rows past the last offset: each expert's rows
    times its dequantized W^T, float32 to float32 rounding, bfloat16 within its output rounding; stacking leaves every
    weight's dequantized values unchanged."""
    gen = torch.Generator().manual_seed(0)
    cases = ((4, 40, 96, [3, 0, 20, 5]), (3, 128, 64, [17, 1, 40]), (2, 64, 16, [5, 5]), (2, 64, 33, [4, 9]))
    for experts, n, k, counts in cases:  # K even: each byte's two nibbles as a pair of columns; K = 33: one by one
        check_experts(experts, n, k, counts, gen, device)


def check_experts(experts: int, n: int, k: int, counts: list[int], gen, device: str) -> None:
    """nf4_grouped_mm of `experts` random NF4 weights [n, k] against each expert's rows times its dequantized W^T."""
    weights = [quantize_weight(torch.randn(n, k, generator=gen).to(device), "nf4") for _ in range(experts)]
    before = [w.dequantize(torch.float32) for w in weights]
    stacked = stack_nf4_experts(weights)
    assert all(torch.equal(w.dequantize(torch.float32), b) for w, b in zip(weights, before))
    assert stacked.packed.shape == (experts, n * k // 2) and stacked.absmax.shape == (experts, n * k // 64)
    owner = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts)).to(device)
    rows = len(owner)
    x = torch.randn(rows + 2, k, generator=gen).to(device)  # the last two rows belong to no expert here
    offsets = expert_offsets(owner, experts)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        out = nf4_grouped_mm(x.to(dtype), stacked, offsets)
        want = torch.cat(
            [x[:rows][owner == e].to(dtype).float() @ before[e].to(dtype).float().T for e in range(experts)]
        )
        assert out.shape == (rows + 2, n) and out.dtype == dtype
        error = float((out[:rows].float() - want).abs().max() / want.abs().max())
        assert error < tolerance, (experts, n, k, dtype, error)


def other_blocks_give_the_same_product(device: str = "cpu") -> None:
    """ExpertBlocks (columns a program, depth a step, warps, stages, rows a pass; what benchmarks/engine_decode.py
    sweeps): steps of one, two and four absmax blocks, a last step past K (its blocks masked), columns past N, an
    expert's rows in one pass or two; each against the dequantized product; refused when not a power of two or too
    small."""
    from quant.fused_experts import ExpertBlocks, expert_blocks

    gen = torch.Generator().manual_seed(2)
    for blocks, (n, k) in (
        (ExpertBlocks(32, 128, 4, 2), (48, 256)),
        (ExpertBlocks(16, 256, 8, 1), (40, 192)),
        (ExpertBlocks(128, 64, 4, 3), (72, 128)),
        (ExpertBlocks(64, 64, 4, 3, rows=32), (64, 128)),  # an expert's 19 rows in one pass, not two
    ):
        with expert_blocks(blocks):
            check_experts(3, n, k, [6, 0, 19], gen, device)
    for bad in ({"columns": 24}, {"depth": 16}, {"warps": 3}, {"stages": 0}, {"rows": 8}, {"rows": 48}):
        try:
            ExpertBlocks(**bad)
        except ValueError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"ExpertBlocks({bad}) was accepted")


def engine_decodes_as_the_dequantized_experts(checkpoint: str, device: str = "cpu") -> None:
    """The torch engine's fixed-shape decode (allsync.engines.slots.FixedShapeStep) of 12 rows in 3 slots with the
    routed experts' NF4 stacked (quant.modules.stack_frozen_experts: the kernel) and without (dequantized, then
    grouped_mm): the same tokens and finish reasons, logprobs within float32 noise."""
    from allsync.engines.slots import FixedShapeStep, decode_in_slots
    from quant.modules import stack_frozen_experts
    from tests.allsync.engines.test_rollout_trainer import FLOAT32_NOISE, assert_same_rows
    from tests.moe_lora.latent_attention_cases import twelve_rows

    model, rows, seeds, sampling, stop_tokens = twelve_rows(checkpoint, device)
    eos = stop_tokens[0]

    def decoded():
        out = decode_in_slots(model, rows, seeds, sampling, eos, 2, 3, True, fixed_step=FixedShapeStep)
        return out.tokens, out.logprobs, out.reasons

    dequantized = decoded()
    assert len({len(t) for t in dequantized[0]}) >= 3
    assert stack_frozen_experts(model) == 2  # the tiny model's two MoE layers
    assert_same_rows(decoded(), dequantized, **FLOAT32_NOISE)
