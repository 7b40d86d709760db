"""benchmarks/fp8_linear.py: the rows' 1 x 128 FP8 quantization (on the CPU), the FP8 GEMM with block scales
against the dequantized product (on a GPU with FP8 tensor cores), and the refusal elsewhere."""

import pytest
import torch

from benchmarks.fp8_linear import main
from quant.formats import fp8_block_dequantize, fp8_block_quantize, fp8_rows_quantize, scaled_mm_fp8_blocks


def test_rows_quantized_per_128_columns_come_back_within_e4m3s_precision():
    x = torch.randn(6, 384, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 50.0]).repeat(128)
    x[2, 128:256] = 0  # a block of zeros stays zeros
    q, scales = fp8_rows_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6, 3)
    back = q.float().view(6, 3, 128) * scales[..., None]
    blocks = x.view(6, 3, 128)
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, relative to its block's largest
    assert bool(((back - blocks).abs() <= blocks.abs().amax(-1, keepdim=True) * 2**-4 + 1e-30).all())
    assert bool((back[2, 1] == 0).all()) and bool((scales > 0).all())


CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not CUDA_FP8 or not hasattr(torch.nn.functional, "scaled_mm"), reason="needs FP8 tensor cores")
@pytest.mark.parametrize("rows", [1, 30, 256])
def test_the_fp8_gemm_gives_the_dequantized_product_within_the_rows_rounding(rows):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 7168, device="cuda", generator=gen) * 0.02
    q, scale_inv = fp8_block_quantize(w)
    x = torch.randn(rows, 7168, device="cuda", generator=gen).to(torch.bfloat16)
    want = x.float() @ fp8_block_dequantize(q, scale_inv, dtype=torch.float32).T
    got = scaled_mm_fp8_blocks(x, q, scale_inv)
    assert got.shape == (rows, 1536) and got.dtype == torch.bfloat16
    assert float((got.float() - want).norm() / want.norm()) < 0.05


def test_it_is_refused_without_fp8_tensor_cores_or_with_bad_flags():
    with pytest.raises(SystemExit, match="--rows"):
        main(["--rows", "0"])
    with pytest.raises(SystemExit, match="--repeats"):
        main(["--repeats", "0"])
    if not CUDA_FP8:
        with pytest.raises(SystemExit, match="FP8 tensor cores"):
            main([])
