"""The frozen routed experts' grouped GEMM reading NF4 directly (a Triton kernel; rollout.frozen_expert_kernel triton).

quant.fixed_shape_experts dequantizes every held expert to the compute dtype at every call and multiplies with
torch's grouped_mm: per call the NF4 bytes are read, a bf16 copy written and read back (DeepSeek-V3 at 16 experts a
GPU: 23 GB of NF4 and 163 GB of copies a decode step). This kernel reads each expert's NF4 bytes once and
dequantizes them in registers. For the assignments sorted by expert (rows [o_{e-1}, o_e) of x belong to expert e,
o the int32 offsets grouped_mm takes) and one projection W_e [N, K] stored as bitsandbytes stores NF4 (the
flattened weight's element i = n K + k in the high nibble of byte i / 2 when i is even, the low one when odd; one
float32 absmax per 64 consecutive elements; the 16-value NF4 code table):

    W_e[n, k] = bf16(code[nibble_e(i)] x absmax_e[i / 64])          (what QuantizedWeight.dequantize gives, then
                                                                      rounded to the compute dtype)
    y[a, n]   = sum_k x[a, k] W_e[n, k]                              for the rows a of expert e

Program (j, e) computes columns [j B_N, (j + 1) B_N) of expert e's rows, B_M at a time (up to B_M rows an expert take
one pass over the weight tile; more rows re-read and dequantize it again), K in blocks of B_K (B_N, B_K, warps, pipeline
stages and B_M: ExpertBlocks). On a GPU each dequantized value is rounded to bfloat16 by the conversion instruction;
Triton's interpreter truncates there, so it rounds by hand (the same values). Where K and B_K are whole absmax blocks
(DeepSeek-V3's are) a tile row's scales are read once a block, B_K / 64 of them, not once a byte. With K even
(DeepSeek-V3's 7,168 and 2,048) each byte is read once and gives two columns: the high nibbles multiply the rows' even
columns and the low ones the odd, two products of B_K / 2 each (the same sums, in another order). The grid (N / B_N, E)
and every tensor depend on (rows, E, N, K) only and the offsets are read on the device, so a CUDA graph captures it. The
experts' bytes must be one tensor a projection: `stack_nf4_experts` copies them into [E, ...] buffers once and leaves
each QuantizedWeight a view of its row (the same values; the other kernels read them as before). Triton's interpreter
(TRITON_INTERPRET=1 before Triton is imported) runs the kernel on CPU tensors, which is how the tests check it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass

import torch

from quant.formats import QuantizedWeight


@dataclass(frozen=True)
class ExpertBlocks:
    """How the kernel cuts its work: output columns a program (B_N), weight columns a step of the inner loop (B_K),
    warps a program, the software pipeline's stages, and an expert's rows a pass over its weight tile (B_M: an
    expert with more rows reads and dequantizes the tile again for each B_M; a decode step at 671B's EP 16 gives each
    held expert about 64) (what benchmarks/engine_decode.py --expert-blocks sweeps)."""

    columns: int = 64
    depth: int = 64
    warps: int = 4
    stages: int = 3
    rows: int = 16  # tl.dot's smallest M

    def __post_init__(self):
        for name, least in (("columns", 16), ("depth", 32), ("warps", 1), ("stages", 1), ("rows", 16)):
            value = getattr(self, name)
            if value < least or (name != "stages" and value & (value - 1)):
                kind = "a power of two, " if name != "stages" else ""
                raise ValueError(f"ExpertBlocks.{name} = {value}: {kind}at least {least}")


BLOCKS = ExpertBlocks()  # what the engine runs (expert_blocks sets others for a sweep)


@contextlib.contextmanager
def module_setting(module, name: str, value):
    """`module.name` set to `value` inside the block, restored after (a kernel's cuts for a sweep)."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield value
    finally:
        setattr(module, name, before)


def expert_blocks(blocks: ExpertBlocks):
    """Run the kernel with `blocks` inside the block (the module's BLOCKS restored after)."""
    return module_setting(sys.modules[__name__], "BLOCKS", blocks)


def interpreted() -> bool:
    """Triton runs its interpreter (CPU tensors) rather than compiling for a GPU: TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class StackedNF4:
    """One projection's experts as one tensor each: packed [E, N K / 2] uint8, absmax [E, N K / blocksize] float32,
    the shared code table [16] float32; (N, K) the weight's shape; dtype the dtype the stored values dequantize to."""

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: tuple[int, int]
    blocksize: int
    dtype: torch.dtype


def nf4_stackable(weights: list[QuantizedWeight]) -> str | None:
    """Why these experts' weights cannot be stacked for the kernel (None: they can): NF4 without double quantization,
    every expert the same shape and block size."""
    if any(w.fmt != "nf4" for w in weights):
        return f"the experts are stored as {weights[0].fmt if weights[0].fmt != 'nf4' else 'mixed formats'}, not nf4"
    if any(w.nf4_state.nested for w in weights):
        return "the experts' NF4 absmax is double-quantized (model.quant.double_quant)"
    first = weights[0]
    if any(w.shape != first.shape or w.nf4_state.blocksize != first.nf4_state.blocksize for w in weights):
        return "the experts differ in shape or block size"
    return None


def stack_nf4_experts(weights: list[QuantizedWeight]) -> StackedNF4:
    """The experts' NF4 bytes and absmax copied into [E, ...] buffers (one expert at a time), each QuantizedWeight
    then a view of its row: the memory held stays the same once the old tensors are freed."""
    why = nf4_stackable(weights)
    if why is not None:
        raise ValueError(f"stack_nf4_experts: {why}")
    first = weights[0]
    packed = torch.empty(len(weights), first.data.numel(), dtype=first.data.dtype, device=first.data.device)
    absmax = torch.empty(len(weights), first.nf4_state.absmax.numel(), dtype=torch.float32, device=first.data.device)
    for e, w in enumerate(weights):
        packed[e] = w.data.reshape(-1)
        absmax[e] = w.nf4_state.absmax.reshape(-1)
        w.data = packed[e].view(w.data.shape)
        w.nf4_state.absmax = absmax[e]
    state = first.nf4_state
    return StackedNF4(packed, absmax, state.code.float(), first.shape, state.blocksize, state.dtype)


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel, built at first use (TRITON_INTERPRET is read when Triton is imported)."""
    import triton
    import triton.language as tl

    @triton.jit
    def nf4_grouped_matmul(
        x,  # [A, K] in the compute dtype, rows sorted by expert
        packed,  # [E, N K / 2] uint8
        absmax,  # [E, N K / QBLOCK] float32
        code,  # [16] float32
        offsets,  # [E] int32: o_e = rows of experts <= e
        out,  # [A, N] in the compute dtype
        N,
        K,
        stride_xa,
        stride_pe,
        stride_ae,
        stride_oa,
        QBLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        PAIRED: tl.constexpr,
        ROW_ABSMAX: tl.constexpr,
        ROUND_BY_HAND: tl.constexpr,
    ):
        column_block, expert = tl.program_id(0), tl.program_id(1)
        first = tl.load(offsets + expert - 1, mask=expert > 0, other=0)
        last = tl.load(offsets + expert)
        offs_n = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        packed_e = packed + expert.to(tl.int64) * stride_pe
        absmax_e = absmax + expert.to(tl.int64) * stride_ae
        for m0 in range(first, last, BLOCK_M):
            offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            m_ok = offs_m < last
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if PAIRED:  # K even: byte j of row n holds columns 2 j (high nibble) and 2 j + 1 (low), one absmax block
                for k0 in range(0, K, BLOCK_K):
                    offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # the row's bytes [k0 / 2, (k0 + B_K) / 2)
                    j_ok = offs_j < K // 2
                    w_ok = n_ok[:, None] & j_ok[None, :]
                    pair = offs_n[:, None].to(tl.int64) * (K // 2) + offs_j[None, :]  # [B_N, B_K / 2]: byte index
                    byte = tl.load(packed_e + pair, mask=w_ok, other=0).to(tl.int32)
                    if ROW_ABSMAX:  # K and B_K whole absmax blocks: a tile row's B_K / QBLOCK scales, each spread
                        block = tl.arange(0, BLOCK_K // QBLOCK)  # over its QBLOCK / 2 bytes (one load a block)
                        first_block = (offs_n[:, None].to(tl.int64) * K + k0) // QBLOCK
                        a_ok = n_ok[:, None] & (k0 + block[None, :] * QBLOCK < K)
                        a_rows = tl.load(absmax_e + first_block + block[None, :], mask=a_ok, other=0.0)
                        a = tl.broadcast_to(a_rows[:, :, None], (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK // 2))
                        a = tl.reshape(a, (BLOCK_N, BLOCK_K // 2))
                    else:
                        a = tl.load(absmax_e + (2 * pair) // QBLOCK, mask=w_ok, other=0.0)
                    high = tl.load(code + (byte >> 4)) * a
                    low = tl.load(code + (byte & 15)) * a
                    if ROUND_BY_HAND:  # each rounded to bfloat16 as below
                        bits = high.to(tl.uint32, bitcast=True)
                        high = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                        bits = low.to(tl.uint32, bitcast=True)
                        low = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                    else:  # a GPU's conversion rounds to nearest, ties to even: the same values, one instruction
                        high, low = high.to(tl.bfloat16), low.to(tl.bfloat16)
                    x_rows = x + offs_m[:, None] * stride_xa + 2 * offs_j[None, :]
                    x_ok = m_ok[:, None] & j_ok[None, :]
                    even = tl.load(x_rows, mask=x_ok, other=0.0)
                    odd = tl.load(x_rows + 1, mask=x_ok, other=0.0)
                    if UPCAST:
                        even, odd = even.to(tl.float32), odd.to(tl.float32)
                    else:
                        high, low = high.to(even.dtype), low.to(even.dtype)
                    acc += tl.dot(even, tl.trans(high), input_precision=PRECISION)
                    acc += tl.dot(odd, tl.trans(low), input_precision=PRECISION)
            else:  # K odd: element i's byte is i / 2, its nibble by the parity of i
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = offs_k < K
                    xt = tl.load(
                        x + offs_m[:, None] * stride_xa + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
                    )
                    element = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [B_N, B_K]: i = n K + k
                    w_ok = n_ok[:, None] & k_ok[None, :]
                    byte = tl.load(packed_e + (element >> 1), mask=w_ok, other=0).to(tl.int32)
                    nibble = tl.where((element & 1) == 0, byte >> 4, byte & 15)
                    a = tl.load(absmax_e + element // QBLOCK, mask=w_ok, other=0.0)
                    # rounded to the nearest bfloat16 (ties to even), as dequantize_4bit gives it (the stored
                    # dtype), kept in float32; in the interpreter written out (not a jitted helper: the interpreter
                    # cannot call one defined here) because its conversion truncates
                    w = tl.load(code + nibble) * a
                    if ROUND_BY_HAND:
                        bits = w.to(tl.uint32, bitcast=True)
                        w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                    else:
                        w = w.to(tl.bfloat16)
                    if UPCAST:  # the interpreter's tl.dot mishandles bfloat16: the same products, exact in float32
                        xt = xt.to(tl.float32)
                    else:
                        w = w.to(xt.dtype)  # exact: w is a bfloat16 value
                    acc += tl.dot(xt, tl.trans(w), input_precision=PRECISION)
            tl.store(
                out + offs_m[:, None] * stride_oa + offs_n[None, :],
                acc.to(out.dtype.element_ty),
                mask=m_ok[:, None] & n_ok[None, :],
            )

    return nf4_grouped_matmul


def nf4_grouped_mm(x: torch.Tensor, stacked: StackedNF4, offsets: torch.Tensor) -> torch.Tensor:
    """x [A, K] (rows sorted by expert, `offsets` [E] int32 as grouped_mm's) -> [A, N] in x's dtype: each expert's
    rows times its W^T, W read from its NF4 bytes (module docstring). Rows past the last offset are left unwritten
    (grouped_mm leaves them undefined too)."""
    if stacked.dtype != torch.bfloat16:
        raise ValueError(f"nf4_grouped_mm: the experts dequantize to {stacked.dtype}; the kernel rounds to bfloat16")
    rows, k = x.shape
    n, k_weight = stacked.shape
    if k != k_weight:
        raise ValueError(f"nf4_grouped_mm: x has {k} columns, the experts' weights {k_weight}")
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    experts = stacked.packed.shape[0]
    blocks = BLOCKS
    grid = (-(-n // blocks.columns), experts)
    paired = k % 2 == 0 and stacked.blocksize % 2 == 0
    _kernel(interpreted())[grid](
        x,
        stacked.packed,
        stacked.absmax,
        stacked.code,
        offsets,
        out,
        n,
        k,
        x.stride(0),
        stacked.packed.stride(0),
        stacked.absmax.stride(0),
        out.stride(0),
        QBLOCK=stacked.blocksize,
        BLOCK_M=blocks.rows,
        BLOCK_N=blocks.columns,
        BLOCK_K=blocks.depth,
        UPCAST=interpreted() and x.dtype != torch.float32,
        PRECISION="ieee" if x.dtype == torch.float32 or interpreted() else "tf32",
        PAIRED=paired,
        ROW_ABSMAX=paired and k % stacked.blocksize == 0 and blocks.depth % stacked.blocksize == 0,
        ROUND_BY_HAND=interpreted(),
        num_warps=blocks.warps,
        num_stages=blocks.stages,
    )
    return out
