"""Frozen weight formats: bf16, fp8 (DeepSeek-V3's 128x128 block scales), nf4 and int8 (bitsandbytes).

A `QuantizedWeight` is one frozen 2-D weight [out, in] in one format. It knows its bytes and how to
dequantize itself; `frozen_linear` multiplies by it without ever keeping the dequantized copy alive
for backward (the weight is dequantized again in backward), so activation memory never holds
full-precision copies of frozen weights.

Formats:
  bf16  W stored as is.
  fp8   W ~= Q * s[i // 128, j // 128], Q float8_e4m3fn, s float32 (`weight_scale_inv`), edge blocks partial.
  nf4   bitsandbytes 4-bit NormalFloat, one absmax per 64 values (optionally double-quantized).
  int8  bitsandbytes row-wise absmax int8: W ~= Q * s_row / 127.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from quant.layout import FP8_BLOCK, fp8_scale_shape

FORMATS = ("bf16", "fp8", "nf4", "int8")
NF4_BLOCKSIZE = 64
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def check_format(name: str, where: str = "format") -> str:
    if name not in FORMATS:
        raise ValueError(f"unknown quantization format {name!r} for {where}; valid formats: {', '.join(FORMATS)}")
    return name


@functools.cache
def _bnb_functional():
    # once per process: Logger.setLevel clears every logger's level cache, which cost 10% of a default step
    # when it ran on each dequantization.
    # bitsandbytes warns on import that its optional hub-downloaded CPU kernel is absent; the
    # built-in CPU path it falls back to is the one we use, so the warning is noise here.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes.functional as bnb_functional
    return bnb_functional


# ----------------------------------------------------------------------------------------- fp8 blocks
EXACT_FP8_DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
)  # hold every e4m3 value, and a float32 product rounds to them


def fp8_whole_blocks(shape, block: int = FP8_BLOCK) -> bool:
    """A weight of this shape is whole block x block tiles (DeepSeek-V3's are)."""
    return shape[0] % block == 0 and shape[1] % block == 0


def fp8_block_dequantize(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """W[i, j] = float(Q[i, j]) * scale_inv[i // block, j // block], computed in float32 and rounded once to `dtype`.

    Partial edge blocks use their own scale; scale_inv has shape (ceil(out/block), ceil(in/block)).
    Computed blockwise, without a full-size scale tensor: Q [R, C] (zero-padded to whole blocks) is
    converted to `dtype` (exact: e4m3's values are bf16/fp16/fp32 values), viewed as [R/b, b, C/b, b] and
    multiplied in place by the float32 scale_inv[:, None, :, None] (the product in float32, stored in `dtype`):
    the same values as the float32 result converted to `dtype`, with no float32 copy of W in between. `out`
    (contiguous [R, C] in `dtype`, whole blocks only): converted and scaled there.
    """
    if dtype not in EXACT_FP8_DTYPES:
        return fp8_block_dequantize(q, scale_inv, block).to(dtype)
    out_dim, in_dim = q.shape
    rows, cols = fp8_scale_shape((out_dim, in_dim), block)
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(
            f"scale_inv has shape {list(scale_inv.shape)}, a [{out_dim}, {in_dim}] weight in {block}x{block} blocks needs [{rows}, {cols}]"
        )
    whole = fp8_whole_blocks(q.shape, block)
    if out is not None:
        if not whole or out.shape != q.shape or out.dtype != dtype:
            raise ValueError(f"fp8_block_dequantize: out must be [{out_dim}, {in_dim}] {dtype} of whole blocks")
        w = out.copy_(q)
    elif whole:
        w = q.to(dtype, copy=True)  # a copy of our own, so scaling it in place is safe
    else:
        w = torch.zeros(rows * block, cols * block, dtype=dtype, device=q.device)
        w[:out_dim, :in_dim] = q
    w.view(rows, block, cols, block).mul_(scale_inv.float()[:, None, :, None])
    return w[:out_dim, :in_dim].contiguous()


def fp8_block_quantize(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 tile: scale_inv = max|W_tile| / 448, Q = round_e4m3(W_tile / scale_inv).

    Returns (Q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)]).
    """
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.view(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * block, cols * block)[:out_dim, :in_dim].contiguous(), scale_inv


# ----------------------------------------------------------------------------------------- the weight
@dataclass(eq=False)
class QuantizedWeight:
    """One frozen weight [out, in] in `fmt`; `data` and `scale` are what it costs in memory."""

    fmt: str
    shape: tuple[int, int]
    data: torch.Tensor
    scale: torch.Tensor | None = None  # fp8: scale_inv blocks; int8: row absmax; nf4: absmax (float32)
    nf4_state: Any = field(default=None, repr=False)  # bitsandbytes QuantState (nf4 only)
    # the dequantized weight in one compute dtype, kept when the model is small enough (`keep_compute_copy`):
    # the weight is frozen, so the copy is never stale and dequantize() returns it instead of recomputing it
    compute_copy: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes held by this weight alone (nf4's constant code tables are shared by all weights)."""
        total = self.data.numel() * self.data.element_size()
        if self.nf4_state is not None:
            st = self.nf4_state
            total += st.absmax.numel() * st.absmax.element_size()
            if st.nested:
                total += st.state2.absmax.numel() * st.state2.absmax.element_size() + 4  # + float32 offset
        elif self.scale is not None:
            total += self.scale.numel() * self.scale.element_size()
        return total

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
        """W in `dtype` (the kept compute copy when it has that dtype: the same values, computed once); with `out`
        (contiguous, W's shape and `dtype`) written there: an FP8 or NF4 weight dequantized in place, without a
        temporary (quant.fixed_shape_experts stacks the experts so)."""
        if out is not None and self.compute_copy is None:
            if self.fmt == "fp8" and dtype in EXACT_FP8_DTYPES and fp8_whole_blocks(self.shape):
                return fp8_block_dequantize(self.data, self.scale, dtype=dtype, out=out)
            if self.fmt == "nf4" and self.nf4_state.dtype == dtype and self.data.is_cuda:  # bitsandbytes 0.50.2: no
                # CPU kernel of dequantize_4bit.out
                _bnb_functional().dequantize_4bit(self.data, flat_state(self.nf4_state), out=out.view(-1))
                return out
        if out is not None:
            return out.copy_(self.dequantize(dtype))
        if self.compute_copy is not None and self.compute_copy.dtype == dtype:
            return self.compute_copy
        if self.fmt == "bf16":
            return self.data.to(dtype)
        if self.fmt == "fp8":
            return fp8_block_dequantize(self.data, self.scale, dtype=dtype)
        if self.fmt == "nf4":
            return _bnb_functional().dequantize_4bit(self.data, flat_state(self.nf4_state)).view(self.shape).to(dtype)
        if self.fmt == "int8":
            return (self.data.float() * (self.scale[:, None] / 127.0)).to(dtype)
        raise AssertionError(self.fmt)


def flat_state(state):
    """The QuantState of an NF4 weight as one row of all its values. bitsandbytes quantizes the flattened weight in
    blocks of `blocksize` consecutive values, and its CUDA dequantize reads it so; its CPU dequantize (0.50.2) walks
    a 2-D weight row by row and takes the wrong absmax for every row whose length is not a multiple of the block
    size (a [64, 16] weight came back up to 1.5 off, against NF4's 0.36; tests/quant/test_quant_formats.py). Read
    as one row, both give the stored values."""
    flat = copy.copy(state)
    flat.shape = torch.Size([math.prod(state.shape)])
    return flat


def keep_compute_copy(weight: QuantizedWeight, dtype: torch.dtype) -> int:
    """Keep W dequantized to `dtype` beside its stored format; returns the bytes the copy takes."""
    weight.compute_copy = None
    weight.compute_copy = weight.dequantize(dtype).contiguous()
    if weight.compute_copy.data_ptr() == weight.data.data_ptr():  # bf16 stored, bf16 asked: nothing to keep
        weight.compute_copy = None
        return 0
    return weight.compute_copy.numel() * weight.compute_copy.element_size()


_SHARED_TABLES: dict[tuple, torch.Tensor] = {}


def _shared_table(table: torch.Tensor) -> torch.Tensor:
    """bitsandbytes gives every QuantState its own copy of a constant lookup table (16 or 256 floats);
    one copy per distinct table is enough."""
    key = (table.dtype, table.device, tuple(table.flatten().tolist()))
    return _SHARED_TABLES.setdefault(key, table)


def quantize_weight(w: torch.Tensor, fmt: str, double_quant: bool = False) -> QuantizedWeight:
    """Convert a floating weight [out, in] to `fmt` (for fp8, computes fresh 128x128 block scales)."""
    check_format(fmt)
    shape = (int(w.shape[0]), int(w.shape[1]))
    if fmt == "bf16":
        # copy: `w` may share a checkpoint shard's memory map, which must not stay alive through it
        return QuantizedWeight("bf16", shape, w.to(torch.bfloat16, copy=True).contiguous())
    if fmt == "fp8":
        q, scale_inv = fp8_block_quantize(w)
        return QuantizedWeight("fp8", shape, q, scale_inv)
    bnb = _bnb_functional()
    if fmt == "nf4":
        packed, state = bnb.quantize_4bit(
            w.to(torch.bfloat16).contiguous(),
            blocksize=NF4_BLOCKSIZE,
            quant_type="nf4",
            compress_statistics=double_quant,
        )
        state.code = _shared_table(state.code)
        if state.nested:
            state.state2.code = _shared_table(state.state2.code)
        return QuantizedWeight("nf4", shape, packed, None, state)
    # bitsandbytes' CUDA kernel takes float16 only (int8's 8 bits lose nothing to float16's 11); its CPU one any float
    source = w.half() if w.is_cuda else w.float()
    q, row_absmax, _ = bnb.int8_vectorwise_quant(source.contiguous())
    return QuantizedWeight("int8", shape, q, row_absmax)


def from_fp8_checkpoint(
    q: torch.Tensor, scale_inv: torch.Tensor, fmt: str, double_quant: bool = False
) -> QuantizedWeight:
    """An FP8 checkpoint tensor to `fmt`: kept as stored for fp8, otherwise dequantized (this one tensor only)."""
    if fmt == "fp8":
        shape = (int(q.shape[0]), int(q.shape[1]))
        return QuantizedWeight("fp8", shape, q.clone(memory_format=torch.contiguous_format), scale_inv.float().clone())
    return quantize_weight(fp8_block_dequantize(q, scale_inv), fmt, double_quant)


def checkpoint_weight(
    tensor: torch.Tensor, scale_inv: torch.Tensor | None, fmt: str, double_quant: bool = False
) -> QuantizedWeight:
    """One checkpoint weight in `fmt`, converted the way the loader converts it: an FP8 tensor (given its
    scale_inv) through `from_fp8_checkpoint`, a floating one through `quantize_weight`."""
    if scale_inv is None:
        return quantize_weight(tensor, fmt, double_quant)
    return from_fp8_checkpoint(tensor, scale_inv, fmt, double_quant)


# ----------------------------------------------------------------------------------------- matmul
class _FrozenLinearFn(torch.autograd.Function):
    """y = x W^T. Backward: dx = dy W (W dequantized again; nothing full-size saved for backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        ctx.weight = weight
        return torch.nn.functional.linear(x, weight.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        w = ctx.weight.dequantize(grad_out.dtype)
        return grad_out @ w, None


def frozen_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """y = x W^T: without a gradient to x, an FP8 weight inside `fp8_gemm_linears` multiplies as DeepSeek's FP8 GEMM
    (`fp8_gemm`); otherwise W dequantized to x's dtype (dequantized again in backward)."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        if FP8_GEMM_LINEARS and weight.fmt == "fp8":
            return fp8_gemm(x, weight)
        return torch.nn.functional.linear(x, weight.dequantize(x.dtype))
    return _FrozenLinearFn.apply(x, weight)


# ----------------------------------------------------------------------------------------- FP8 GEMM
FP8_GEMM_LINEARS = False  # frozen_linear's FP8 weights multiply as FP8 GEMMs (fp8_gemm_linears sets it)


@contextlib.contextmanager
def fp8_gemm_linears(enabled: bool = True):
    """Inside the block, frozen_linear multiplies FP8 weights by `fp8_gemm` where no gradient flows to x (the torch
    engine's forwards with rollout.fp8_linear_kernel scaled_mm); the setting before is restored after."""
    global FP8_GEMM_LINEARS
    before, FP8_GEMM_LINEARS = FP8_GEMM_LINEARS, enabled
    try:
        yield
    finally:
        FP8_GEMM_LINEARS = before


def fp8_rows_quantize(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3(x / a) [M, K], a [M, ceil(K / block)] float32), a[m, b] = max_{k in block b} |x[m, k]| / 448
    (1e-12 / 448 for a block of zeros; the last block partial when K is not whole blocks)."""
    rows, cols = x.shape
    blocks = -(-cols // block)
    grouped = torch.nn.functional.pad(x.float(), (0, blocks * block - cols)).view(rows, blocks, block)
    scales = grouped.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (grouped / scales[..., None]).to(FP8_DTYPE).view(rows, blocks * block)[:, :cols]
    return q, scales


def block_scaled_fp8_gemm_on(device: torch.device | str | None = None) -> bool:
    """The GPU `device` (None: the current one) has FP8 tensor cores (compute capability 8.9+) and this torch's
    torch.nn.functional.scaled_mm takes 128 x 128 block scales."""
    return hasattr(getattr(torch.nn.functional, "ScalingType", None), "BlockWise128x128") and (
        torch.cuda.get_device_capability(device) >= (8, 9)
    )


def fp8_gemm_on_tensor_cores(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """`fp8_gemm` runs torch's FP8 GEMM for x and this weight: x on a GPU with it (`block_scaled_fp8_gemm_on`) in
    bf16 or fp16, W of whole 128 x 128 blocks."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and fp8_whole_blocks(weight.shape)
        and block_scaled_fp8_gemm_on(x.device)
    )


def fp8_gemm(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [..., K] times W^T, W [N, K] in FP8 with 128 x 128 scales s, as DeepSeek-V3 multiplies in FP8: the rows
    quantized per 1 x 128 block (`fp8_rows_quantize`: x8, a), then

        y[m, n] = sum_k (x8[m, k] a[m, k / 128]) (Q[n, k] s[n / 128, k / 128])     accumulated in float32,
                                                                                  rounded once to x's dtype

    On FP8 tensor cores (`fp8_gemm_on_tensor_cores`) one torch.nn.functional.scaled_mm reading W as stored (rows
    padded to a multiple of 4, the scales laid out as cuBLAS wants them); elsewhere (CPU, partial blocks) the same
    sum of both factors dequantized to float32: the same numbers, none of the speed. The rows' rounding to e4m3 is a
    relative error of a few percent in y against x W^T (BENCHMARKS.md): a sampler/trainer mismatch."""
    flat = x.reshape(-1, x.shape[-1])
    if fp8_gemm_on_tensor_cores(x, weight):
        y = scaled_mm_fp8_blocks(flat, weight.data, weight.scale)
    else:
        x8, scales = fp8_rows_quantize(flat)
        rows, cols = flat.shape
        padded = torch.nn.functional.pad(x8.float(), (0, scales.shape[1] * FP8_BLOCK - cols))
        xq = padded.view(rows, -1, FP8_BLOCK).mul_(scales[..., None]).view(rows, -1)[:, :cols]
        y = torch.nn.functional.linear(xq, weight.dequantize(torch.float32)).to(x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def scaled_mm_fp8_blocks(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16) times (Q s)^T by torch.nn.functional.scaled_mm with 1 x 128 row scales and the weight's
    128 x 128 ones as stored (fp8_gemm's numbers)."""
    F = torch.nn.functional
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % 4)) if rows % 4 else x
    x8, scales = fp8_rows_quantize(padded)
    k_blocks = scale_inv.shape[1]
    s = F.pad(scale_inv, (0, -k_blocks % 4)) if k_blocks % 4 else scale_inv
    out = F.scaled_mm(
        x8,
        q.t(),
        scales.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        s.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )
    return out[:rows]
