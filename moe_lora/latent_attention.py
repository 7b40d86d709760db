"""MLA's latent decode attention over a pool of KV slots, each slot reading only its own positions (a Triton kernel).

The torch path (moe_lora.mla_decode.absorbed_attention over SlotLayer.read) reads every slot up to the step's span, the
longest live row's, and an FP8 cache back into the compute dtype first: a decode step of P slots moves
P x span x (stored + 2 x 2 r + 2 x 2 (r + d_rope)) bytes a layer (allsync.plan.fit.kv_step_bytes_per_token). This
kernel reads each slot's stored bytes once, its own positions only, and dequantizes them in registers. For slot b,
head h, the absorbed query q_bh = [q_nope_h W_UK_h ; q_rope_h] (r + d_rope values) and the slot's n_b positions
(its cached ones and the new one, already written):

    score_bhs = scaling (q_bh[:r] . c_bs + q_bh[r:] . k_rope_bs)     c_bs = q_bs,g a_bs,g in an FP8 cache (per group g)
    out_bh    = sum_{s < n_b} softmax_s(score_bh)_s c_bs                                               [r]

Split over positions (flash decoding): program (b, k, j) takes heads [h j, h j + h) and positions
[k c, (k + 1) c) of slot b (h = KernelBlocks.heads), c = ceil(span / splits), stopping at n_b (a program past it
reads nothing). Each keeps a
running maximum m, sum l and weighted sum o (online softmax) and writes o / l and lse = m + log l; the splits combine as

    out_bh = sum_k exp(lse_k - logsumexp_k lse_k) o_k               (an empty split: lse -inf, weight 0)

The cache is read by page: position n of slot b is row n % page of page table[b, n // page] (a paged pool's block
table; an unpaged pool is one page of `capacity` positions per slot, table[b] = [b]).

The grid and every tensor depend on (slots, heads, span) only and the counts are read on the device, so a CUDA graph
captures the step (allsync/engines/graphs.py). Triton's interpreter (TRITON_INTERPRET=1 before the first launch)
runs the same kernel on CPU tensors, which is how the tests here check it against the torch path.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from quant.fused_experts import interpreted, module_setting


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """How the kernel cuts its work: heads per program (BLOCK_H, at least tl.dot's smallest M, 16; each program reads
    and dequantizes its positions once, so a slot's positions are read heads / BLOCK_H times), positions per block
    of the inner loop (BLOCK_N) and warps per program."""

    heads: int = 64  # fastest of 16, 32, 64 on the H200 (BENCHMARKS.md: 57.9 against 126.0 ms at 256 rows of 20,480)
    positions: int = 32
    warps: int = 8

    def __post_init__(self):
        for name in ("heads", "positions", "warps"):
            value = getattr(self, name)
            if value < (16 if name != "warps" else 1) or value & (value - 1):
                raise ValueError(
                    f"KernelBlocks.{name} = {value}: a power of two, at least {16 if name != 'warps' else 1}"
                )


BLOCKS = KernelBlocks()  # what the engine runs (kernel_blocks sets others for a sweep: benchmarks/engine_decode.py)

# Shared memory a program's tiles may take: the H100's and H200's 227 KiB a block, less room for what Triton adds
SHARED_MEMORY_BYTES = 200 * 1024


def heads_per_program(blocks: KernelBlocks, width: int, element_size: int) -> int:
    """blocks.heads, halved (not below 16) while a program's tiles would not fit in shared memory:

        (heads + 2 x positions) x width x element_size <= SHARED_MEMORY_BYTES

    (the query's [heads, width] tile and two stages of the latent's [positions, width]; width the padded r + d_rope).
    On the H200 (2026-11-28) 64 heads ran in bf16 at V3's 512 + 64 (147 KiB) and in float32 at 128 + 32 (123 KiB),
    16 in float32 at 512 + 64 (184 KiB); with 64 in float32 at 512 + 64 (295 KiB) the kernel's test failed (its
    message lost to a time bound; shared memory the likely cause, to be checked on the next GPU)."""
    heads = blocks.heads
    while heads > 16 and (heads + 2 * blocks.positions) * width * element_size > SHARED_MEMORY_BYTES:
        heads //= 2
    return heads


def kernel_blocks(blocks: KernelBlocks):
    """Run the kernel with `blocks` inside the block (the module's BLOCKS restored after)."""
    return module_setting(sys.modules[__name__], "BLOCKS", blocks)


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel; built at first use so that TRITON_INTERPRET, read by triton.jit, is the caller's."""
    import triton
    import triton.language as tl

    @triton.jit
    def latent_decode(
        query,  # [slots, heads, r + d_rope]
        latent,  # [pages, page, r] rows of c (FP8 or the compute dtype), stride_l* in elements
        scales,  # [pages, page, r / group] float32 (FP8 only)
        rope,  # [pages, page, d_rope]
        table,  # [slots, width] int64: the page holding each slot's positions [j page, (j + 1) page)
        counts,  # [slots] int64: positions each slot reads
        out,  # [slots, splits, heads, r] float32
        lse,  # [slots, splits, heads] float32
        heads,
        chunk,
        scaling,
        page,
        stride_tb,
        stride_qb,
        stride_qh,
        stride_lb,
        stride_ls,
        stride_sb,
        stride_ss,
        stride_rb,
        stride_rs,
        RANK: tl.constexpr,
        RANK_P2: tl.constexpr,
        ROPE: tl.constexpr,
        ROPE_P2: tl.constexpr,
        GROUP: tl.constexpr,
        FP8: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        head_block, split = tl.program_id(0), tl.program_id(1)
        slot = tl.program_id(2).to(tl.int64)  # slot x stride passes 2^31 elements beyond ~170 slots of V3's latent
        offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, RANK_P2)
        offs_p = tl.arange(0, ROPE_P2)
        h_ok, r_ok, p_ok = offs_h < heads, offs_r < RANK, offs_p < ROPE
        q_rows = query + slot * stride_qb + offs_h[:, None] * stride_qh
        q_c = tl.load(q_rows + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        q_rope = tl.load(q_rows + RANK + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
        dtype = q_c.dtype  # the compute dtype: what c is read into and the weights are rounded to
        if UPCAST:  # the interpreter's tl.dot mishandles bfloat16: the same products, exact in float32
            q_c, q_rope = q_c.to(tl.float32), q_rope.to(tl.float32)
        start = split * chunk
        stop = tl.minimum(start + chunk, tl.load(counts + slot).to(tl.int32))
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, RANK_P2], tl.float32)
        for first in range(start, stop, BLOCK_N):
            offs_n = first + tl.arange(0, BLOCK_N)
            n_ok = offs_n < stop
            pages = tl.load(table + slot * stride_tb + offs_n // page, mask=n_ok, other=0).to(tl.int64)
            places = offs_n % page
            c = tl.load(
                latent + pages[:, None] * stride_lb + places[:, None] * stride_ls + offs_r[None, :],
                mask=n_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
            if FP8:  # as fp8_dequantize: q (exact in any float) times a rounded to the compute dtype, rounded to it
                scale_rows = scales + pages[:, None] * stride_sb + places[:, None] * stride_ss
                if RANK == RANK_P2:  # the position's RANK / GROUP scales, each spread over its GROUP values
                    offs_g = tl.arange(0, RANK // GROUP)
                    a = tl.load(scale_rows + offs_g[None, :], mask=n_ok[:, None], other=0.0).to(dtype).to(tl.float32)
                    grouped = tl.reshape(c.to(tl.float32), [BLOCK_N, RANK // GROUP, GROUP]) * a[:, :, None]
                    c = tl.reshape(grouped, [BLOCK_N, RANK]).to(dtype)
                else:  # a rank that is not a power of two: one scale read per value
                    a = tl.load(scale_rows + offs_r[None, :] // GROUP, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                    c = (c.to(tl.float32) * a.to(dtype).to(tl.float32)).to(dtype)
            k_rope = tl.load(
                rope + pages[:, None] * stride_rb + places[:, None] * stride_rs + offs_p[None, :],
                mask=n_ok[:, None] & p_ok[None, :],
                other=0.0,
            )
            weights_dtype = dtype
            if UPCAST:
                c, k_rope, weights_dtype = c.to(tl.float32), k_rope.to(tl.float32), tl.float32
            scores = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
            scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
            scores = tl.where(n_ok[None, :], scores * scaling, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            weights = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(weights, 1)
            acc = acc * alpha[:, None] + tl.dot(weights.to(dtype).to(weights_dtype), c, input_precision=PRECISION)
            m = m_new
        row = (slot * SPLITS + split) * heads + offs_h
        tl.store(
            out + row[:, None] * RANK + offs_r[None, :],
            acc / tl.maximum(total, 1e-30)[:, None],
            mask=h_ok[:, None] & r_ok[None, :],
        )
        tl.store(lse + row, m + tl.log(tl.maximum(total, 1e-30)), mask=h_ok)  # an empty split: m = -inf

    return latent_decode


def _block(n: int) -> int:
    """A block of at least n values: the next power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def split_count(span: int, slots: int) -> int:
    """Position splits per slot: enough programs to fill a GPU (about 256 per head block) at blocks of at least 256
    positions, at most 64; a function of (span, slots) only, so a graph's grid is fixed."""
    by_work = max(1, span // 256)
    by_width = max(1, 256 // max(slots, 1))
    return min(64, by_work, by_width)


def latent_decode_attention(
    query: torch.Tensor,
    latent: torch.Tensor,
    scales: torch.Tensor | None,
    rope: torch.Tensor,
    counts: torch.Tensor,
    scaling: float,
    span: int,
    table: torch.Tensor | None = None,
    page: int | None = None,
) -> torch.Tensor:
    """The kernel's attention (module docstring): query [slots, H, r + d_rope] (absorbed); latent [pages, page, r]
    (c: FP8 with `scales` [pages, page, r / group] float32, or the compute dtype with scales None); rope [pages,
    page, d_rope]; counts [slots] (positions each slot reads, at most span); table [slots, width] (int64, the pages
    of each slot) -> [slots, H, r] in query's dtype. Without a table each slot is its own page: latent [slots,
    capacity, r], and so on. The last dimension of each cache tensor must be contiguous."""
    slots, heads, width = query.shape
    if table is None:
        table, page = torch.arange(slots, device=query.device)[:, None], latent.shape[1]
    rank, rope_dim = latent.shape[-1], rope.shape[-1]
    if width != rank + rope_dim:
        raise ValueError(f"latent_decode_attention: query has {width} values a head, the cache {rank} + {rope_dim}")
    if any(t.stride(-1) != 1 for t in (query, latent, rope) + ((scales,) if scales is not None else ())):
        raise ValueError("latent_decode_attention: the last dimension of the query and the cache must be contiguous")
    fp8 = scales is not None
    group = rank // scales.shape[-1] if fp8 else rank
    splits = split_count(span, slots)
    chunk = -(-max(span, 1) // splits)
    out = torch.empty(slots, splits, heads, rank, dtype=torch.float32, device=query.device)
    lse = torch.empty(slots, splits, heads, dtype=torch.float32, device=query.device)
    scale_tensor = scales if fp8 else rope  # any pointer: the FP8 branch is compiled out
    blocks = BLOCKS
    block_heads = heads_per_program(blocks, _block(rank) + _block(rope_dim), query.element_size())
    grid = (-(-heads // block_heads), splits, slots)
    _kernel(interpreted())[grid](
        query,
        latent,
        scale_tensor,
        rope,
        table,
        counts,
        out,
        lse,
        heads,
        chunk,
        float(scaling),
        page,
        table.stride(0),
        query.stride(0),
        query.stride(1),
        latent.stride(0),
        latent.stride(1),
        scale_tensor.stride(0),
        scale_tensor.stride(1),
        rope.stride(0),
        rope.stride(1),
        RANK=rank,
        RANK_P2=_block(rank),
        ROPE=rope_dim,
        ROPE_P2=_block(rope_dim),
        GROUP=group,
        FP8=fp8,
        SPLITS=splits,
        BLOCK_H=block_heads,
        BLOCK_N=blocks.positions,
        num_warps=blocks.warps,  # 8: the [heads, r] float32 accumulator and the [32, r] latent block, fewer registers
        num_stages=2,
        PRECISION="ieee" if query.dtype == torch.float32 or interpreted() else "tf32",  # float32: no TF32 rounding
        UPCAST=interpreted() and query.dtype != torch.float32,
    )
    weights = torch.softmax(lse, dim=1)  # [slots, splits, heads]: an empty split's lse is -inf, its weight 0
    return (weights[..., None] * out).sum(dim=1).to(query.dtype)
