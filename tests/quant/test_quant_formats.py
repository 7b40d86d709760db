"""quant.formats: FP8 block dequantization against its definition, per-format error and byte bounds."""

import pytest
import torch

from quant.formats import (
    FORMATS,
    fp8_block_dequantize,
    fp8_block_quantize,
    frozen_linear,
    quantize_weight,
)


def test_fp8_block_dequantize_matches_definition_with_partial_edge_blocks():
    gen = torch.Generator().manual_seed(1)
    out_dim, in_dim = 130, 260  # 2 x 3 blocks; the last row/column of blocks are partial (2 and 4 wide)
    q = (torch.randn(out_dim, in_dim, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=gen) + 0.5
    expected = torch.empty(out_dim, in_dim)
    for i in range(out_dim):
        for j in range(in_dim):
            expected[i, j] = q[i, j].float() * scale_inv[i // 128, j // 128]
    assert torch.equal(fp8_block_dequantize(q, scale_inv), expected)


def full_size_scale_dequantize(q, scale_inv, block=128):
    """The formula fp8_block_dequantize replaced: a full-size float32 scale built with repeat_interleave."""
    out_dim, in_dim = q.shape
    expanded = scale_inv.float().repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    return q.float() * expanded


@pytest.mark.parametrize("shape", [(256, 384), (128, 128), (130, 260), (576, 128), (64, 512), (1, 129), (300, 200)])
def test_fp8_blocked_dequantize_equals_full_size_scale_formula(shape):
    """Whole blocks and partial edge blocks (rows, columns or both): bit-identical to the old formula."""
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    q, scale_inv = fp8_block_quantize(torch.randn(*shape, generator=gen) * 3)
    scale_inv = scale_inv * (torch.rand(scale_inv.shape, generator=gen) + 0.5)  # blocks with unrelated scales
    blocked = fp8_block_dequantize(q, scale_inv)
    assert blocked.dtype == torch.float32 and blocked.shape == shape and blocked.is_contiguous()
    assert torch.equal(blocked, full_size_scale_dequantize(q, scale_inv))
    assert q.dtype == torch.float8_e4m3fn  # the input is left alone (scaling works on a copy)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(256, 384), (130, 260)])
def test_fp8_dequantize_in_a_compute_dtype_is_the_float32_result_rounded_once(shape, dtype, device):
    """W made directly in bf16/fp16 (no float32 copy of W) equals the float32 W converted: bit for bit."""
    gen = torch.Generator().manual_seed(7)
    q, scale_inv = fp8_block_quantize(torch.randn(*shape, generator=gen) * 3)
    scale_inv = scale_inv * (torch.rand(scale_inv.shape, generator=gen) * 1e3 + 1e-3)  # products far from 1
    q, scale_inv = q.to(device), scale_inv.to(device)
    direct = fp8_block_dequantize(q, scale_inv, dtype=dtype)
    assert direct.dtype == dtype and direct.shape == shape and direct.is_contiguous()
    assert torch.equal(direct, fp8_block_dequantize(q, scale_inv).to(dtype))


def test_fp8_dequantize_refuses_scales_of_the_wrong_shape():
    q, scale_inv = fp8_block_quantize(torch.randn(130, 260))
    with pytest.raises(ValueError, match=r"scale_inv has shape \[2, 2\], a \[130, 260\] weight .* needs \[2, 3\]"):
        fp8_block_dequantize(q, scale_inv[:, :2])


def test_fp8_block_quantize_scales_and_error():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=gen)
    w[:128, :128] *= 100  # blocks with very different ranges keep their own scale
    q, scale_inv = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    assert scale_inv[0, 0] == pytest.approx(w[:128, :128].abs().max().item() / 448, rel=1e-6)
    assert scale_inv[2, 1] == pytest.approx(w[256:, 128:].abs().max().item() / 448, rel=1e-6)
    err = (fp8_block_dequantize(q, scale_inv) - w).abs()
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal values
    assert (
        err <= w.abs() * 2**-4 + scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] * 2**-9
    ).all()


def test_fp8_quantize_keeps_the_weights_device():
    """The loader quantizes each tensor where safetensors put it (cuda:N on GPUs): Q and its scales must stay
    there. The meta device checks the placement on a machine without a GPU; CPU stays CPU."""
    for device in ("meta", "cpu"):
        qw = quantize_weight(torch.ones(300, 200, device=device), "fp8")
        assert qw.data.device.type == device and qw.scale.device.type == device


@pytest.mark.parametrize(
    "fmt, max_rel_rms, max_bytes_per_param",
    [("bf16", 0.004, 2.0), ("fp8", 0.035, 1.001), ("int8", 0.012, 1.02), ("nf4", 0.11, 0.5625)],
)
def test_formats_error_and_bytes(fmt, max_rel_rms, max_bytes_per_param):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(3))
    qw = quantize_weight(w, fmt)
    rel_rms = ((qw.dequantize(torch.float32) - w).norm() / w.norm()).item()
    assert rel_rms <= max_rel_rms
    assert qw.nbytes / qw.numel <= max_bytes_per_param + 1e-9


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8", "nf4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_into_a_slice_of_a_stack_writes_the_same_values(fmt, dtype, device):
    """QuantizedWeight.dequantize(out=): written in place into a slice of a stacked buffer (quant.fixed_shape_experts
    stacks every expert so, without a temporary for FP8, and for NF4 on CUDA), bit for bit what dequantize returns,
    the rest of the buffer untouched."""
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(5))
    qw = quantize_weight(w.to(device), fmt)
    stack = torch.full((3, 512, 128), 7.0, dtype=dtype, device=device)
    written = qw.dequantize(dtype, out=stack[1, 256:])
    assert written.data_ptr() == stack[1, 256:].data_ptr()
    assert torch.equal(stack[1, 256:], qw.dequantize(dtype))
    assert bool((stack[0] == 7).all()) and bool((stack[1, :256] == 7).all()) and bool((stack[2] == 7).all())


def test_nf4_double_quant_is_smaller():
    w = torch.randn(256, 512)
    single, double = quantize_weight(w, "nf4"), quantize_weight(w, "nf4", double_quant=True)
    assert double.nbytes < single.nbytes
    assert single.nbytes / single.numel == pytest.approx(0.5 + 4 / 64)  # packed 4 bits + one fp32 absmax per 64
    assert torch.allclose(single.dequantize(torch.float32), double.dequantize(torch.float32), atol=0.05)


def nf4_by_definition(qw) -> torch.Tensor:
    """bitsandbytes' NF4 layout read by its definition: the flattened weight's value i in the high nibble of byte
    i / 2 when i is even, the low one when odd, times the absmax of block i / blocksize, rounded to the stored dtype."""
    state, packed = qw.nf4_state, qw.data.reshape(-1)
    nibbles = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1).long()
    values = state.code[nibbles] * state.absmax.repeat_interleave(state.blocksize)[: nibbles.numel()]
    return values.to(state.dtype).float().view(qw.shape)


@pytest.mark.parametrize("shape", [(64, 16), (4, 96), (32, 48), (3, 96), (16, 64)])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_weights_whose_rows_are_not_whole_blocks_dequantize_to_what_was_stored(shape, double_quant):
    """bitsandbytes 0.50.2's CPU dequantize_4bit, given a 2-D weight, takes the wrong absmax for rows whose length is
    not a multiple of the 64-value block ([64, 16]: up to 1.5 off); QuantizedWeight.dequantize reads the weight as one
    row (quant.formats.flat_state), which gives the stored values (the rehearsal's shrunk 671B experts are [64, 16])."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    qw = quantize_weight(w, "nf4", double_quant=double_quant)
    back = qw.dequantize(torch.float32)
    assert float((back - w).abs().max()) <= 0.2 * float(w.abs().max())  # NF4's error, not a wrong block's
    if not double_quant:
        assert torch.equal(back, nf4_by_definition(qw))


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown quantization format 'nf5'.*bf16, fp8, nf4, int8"):
        quantize_weight(torch.randn(4, 4), "nf5")


@pytest.mark.parametrize("fmt", FORMATS)
def test_frozen_linear_gradient_and_saved_memory(fmt):
    qw = quantize_weight(torch.randn(384, 256), fmt)
    x = torch.randn(8, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = frozen_linear(x, qw)
    g = torch.randn_like(y)
    y.backward(g)
    w = qw.dequantize(torch.float32)
    assert torch.allclose(y, x @ w.T, atol=1e-5)
    assert torch.allclose(x.grad, g @ w, atol=1e-5)
    assert sum(saved) == 0  # nothing saved for backward: the weight is dequantized again there


def test_kept_compute_copies_give_the_same_forward_and_backward(tiny_bf16):
    """model.compute_copy (issue 24): every frozen weight dequantized once and kept. The same logits and input
    gradients bit for bit (the copy is what dequantize() returned at every call), for nf4, int8 and bf16 weights."""
    from quant.loader import QuantPlan, load_frozen_model
    from quant.modules import compute_copy_bytes, frozen_weights, keep_compute_copies

    plan = QuantPlan(routed_experts="nf4", shared_experts="int8", attention="bf16", dense_mlp="nf4")
    plain, copied = (load_frozen_model(tiny_bf16, plan, compute_dtype=torch.float32, progress=False) for _ in range(2))
    expected = compute_copy_bytes(copied, torch.float32)
    assert keep_compute_copies(copied, torch.float32) == expected == sum(w.numel * 4 for w in frozen_weights(copied))
    assert all(w.compute_copy is not None for w in frozen_weights(copied))
    ids = torch.randint(3, 200, (2, 9))
    outs = []
    for model in (plain, copied):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds).logits
        logits.square().sum().backward()
        outs.append((logits.detach(), embeds.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # bf16 weights asked in bf16: dequantize() already returns the stored tensor, nothing to keep
    assert compute_copy_bytes(copied, torch.bfloat16) == sum(
        w.numel * 2 for w in frozen_weights(copied) if w.fmt != "bf16"
    )
