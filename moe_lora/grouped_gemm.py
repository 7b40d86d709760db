"""Routed-expert LoRA with grouped GEMMs: every expert's adapter matmuls in one call per projection.

The same function as `moe_lora.grouped_lora.GroupedLoRAExperts` (the per-expert loop, kept as the reference
this is tested against), computed in the layout grouped GEMMs want: the N = T*k routed (token, slot)
assignments sorted by expert, so expert e owns rows [o_{e-1}, o_e) with o = cumsum(counts) (int32).
With gmm(X, W)[rows of e] = X[rows of e] @ W_e (`torch.nn.functional.grouped_mm`) and xs = x[token of
each sorted assignment]:

    z_g = gmm(xs, A_g^T)      g = base_gate(xs) + s * gmm(z_g, B_g^T)      (same for up)
    h   = silu(g) * u         z_d = gmm(h, A_d^T)     y = base_down(h) + s * gmm(z_d, B_d^T)
    out = index_add over tokens of w * y

Backward, dy = w * dout[token]:

    dz_d = s * gmm(dy, B_d)           dh = base_down^T(dy) + gmm(dz_d, A_d)
    dg = dh * u * silu'(g)            du = dh * silu(g)
    dz_g = s * gmm(dg, B_g)           dx = base_gate^T(dg) + base_up^T(du) + gmm(dz_g, A_g) + gmm(dz_u, A_u)
    dA_g = gmm_K(dz_g^T, xs)          dB_g = s * gmm_K(dg^T, z_g)        (gmm_K: groups along the summed N)

The frozen projections stay one matmul per expert on its contiguous rows, accumulated in place into the
adapter's output (each expert is dequantized only while it runs, as in the loop); the skinny adapter
matmuls, 6 forward and 12 backward per expert in the loop, become grouped calls (A_gate and A_up stacked
as one [E, 2r, in] factor). The rows are processed in chunks of consecutive experts of at most
min(T, 4 N / E) rows (`chunk_rows`: about 4 average experts; under expert parallelism N and E are the rank's; a
forward that keeps nothing for backward, generation's, takes chunks of up to min(T, 1024) rows: `call_chunks`),
so the temporaries stay near the loop's (in the CPU benchmark at 256 experts, chunks of T rows peaked 12%
above the loop's step memory, chunks of 4 N / E = T/8 rows 0.7%). Saved for backward: g, u, y, z_gate_up, z_down per assignment, the loop's
tensors. Dropout is not supported here (RL training refuses it; `LoRAConfig` routes it to the loop).

grouped_mm needs 16-byte aligned strides: rank * element size must be a multiple of 16 (rank % 8 == 0 in
bf16, % 4 in float32). `grouped_mm_supported` says whether a rank and dtype qualify.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from moe_lora.grouped_lora import ExpertsCall, experts_call_grads, factor_map, save_experts_call, saved_experts_call
from quant.formats import QuantizedWeight
from quant.modules import EXPERT_PROJECTIONS


def grouped_mm_available() -> bool:
    """torch.nn.functional.grouped_mm exists (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


def grouped_mm_supported(dtype: torch.dtype, *sizes: int) -> bool:
    """grouped_mm can run these matrices: the function exists and every size (the rank, hidden, moe_intermediate)
    times the element size is a multiple of 16 bytes (the strides grouped_mm needs)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return grouped_mm_available() and all(size * elem % 16 == 0 for size in sizes)


@dataclass(frozen=True)
class Chunk:
    """Experts [first, end) and their sorted rows [start, stop); groups: (expert, first row, end row) of each
    expert with rows (absolute rows); offsets: grouped_mm's int32 cumulative row counts, relative to start."""

    first: int
    end: int
    start: int
    stop: int
    groups: list[tuple[int, int, int]]
    offsets: torch.Tensor


def chunk_spans(counts: list[int], max_rows: int) -> list[tuple[int, int, int, int]]:
    """(first expert, end expert, first row, end row) of each chunk: consecutive experts packed while their
    rows fit in max_rows (an expert with more rows is a chunk of its own); chunks with no rows left out."""
    spans, first, start = [], 0, 0
    while first < len(counts):
        end, rows = first + 1, counts[first]
        while end < len(counts) and rows + counts[end] <= max_rows:
            rows += counts[end]
            end += 1
        if rows:
            spans.append((first, end, start, start + rows))
        first, start = end, start + rows
    return spans


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for the work queued there (pinned + non_blocking on CUDA)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def chunks(counts: list[int], max_rows: int, device: torch.device) -> list[Chunk]:
    """The chunks of `chunk_spans`, each with its groups and int32 offsets. Every chunk's offsets come from the
    host counts in one host-to-device copy that does not wait for the device."""
    spans = chunk_spans(counts, max_rows)
    local = [list(accumulate(counts[first:end])) for first, end, _, _ in spans]
    offsets = to_device_async(torch.tensor([o for part in local for o in part], dtype=torch.int32), device)
    out, at = [], 0
    for (first, end, start, stop), part in zip(spans, local):
        starts = [start + o - c for o, c in zip(part, counts[first:end])]
        groups = [(e, row, row + counts[e]) for e, row in zip(range(first, end), starts) if counts[e]]
        out.append(Chunk(first, end, start, stop, groups, offsets[at : at + len(part)]))
        at += len(part)
    return out


def add_frozen_rows_(out: torch.Tensor, xs: torch.Tensor, weights: list[QuantizedWeight], chunk: Chunk) -> torch.Tensor:
    """out[rows of e] += xs[rows of e] @ W_e^T for each expert of the chunk (rows relative to the chunk)."""
    for expert, start, stop in chunk.groups:
        rows = slice(start - chunk.start, stop - chunk.start)
        out[rows].addmm_(xs[rows], weights[expert].dequantize(xs.dtype).t())
    return out


def add_frozen_rows_backward_(
    out: torch.Tensor, dys: torch.Tensor, weights: list[QuantizedWeight], chunk: Chunk
) -> torch.Tensor:
    """out[rows of e] += dys[rows of e] @ W_e (the input gradient of add_frozen_rows_)."""
    for expert, start, stop in chunk.groups:
        rows = slice(start - chunk.start, stop - chunk.start)
        out[rows].addmm_(dys[rows], weights[expert].dequantize(dys.dtype))
    return out


class _Adapters:
    """One chunk's factors in the compute dtype: A_gate_up [e, 2r, in] (A_gate stacked on A_up), B_gate,
    B_up [e, inter, r], A_down [e, r, inter], B_down [e, hidden, r]."""

    def __init__(self, lora, chunk: Chunk, dtype: torch.dtype):
        (a_g, b_g), (a_u, b_u), (a_d, b_d) = (factor_map(lora)[p] for p in EXPERT_PROJECTIONS)
        part = slice(chunk.first, chunk.end)
        self.a_gate_up = torch.cat([a_g[part], a_u[part]], dim=1).to(dtype)
        # contiguous: a shared_outer factor arrives expanded over the experts (stride 0), which grouped_mm refuses
        self.b_gate, self.b_up = b_g[part].to(dtype).contiguous(), b_u[part].to(dtype).contiguous()
        self.a_down, self.b_down = a_d[part].to(dtype).contiguous(), b_d[part].to(dtype).contiguous()


def _gmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of group e of x [N, K] times w_e [K, M]; or, with x [K, N] and w [N, M], group e's slice of the
    summed N (then the result is [E, K, M])."""
    return F.grouped_mm(x, w, offs=offsets)


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-2, -1)


def chunk_forward(
    x, weighted_out, tokens, flat_w, ad: _Adapters, call: ExpertsCall, chunk: Chunk
) -> list[torch.Tensor]:
    """Adds the chunk's w * y to weighted_out; returns [g, u, y, z_gate_up, z_down] of its rows."""
    s, w, offs, r = call.scale, call.weights, chunk.offsets, ad.b_gate.shape[2]
    xs = x.index_select(0, tokens)
    z_gu = _gmm(xs, _t(ad.a_gate_up), offs)
    g = add_frozen_rows_(_gmm(z_gu[:, :r], _t(ad.b_gate), offs).mul_(s), xs, w["gate"], chunk)
    u = add_frozen_rows_(_gmm(z_gu[:, r:], _t(ad.b_up), offs).mul_(s), xs, w["up"], chunk)
    del xs
    h = F.silu(g) * u
    z_down = _gmm(h, _t(ad.a_down), offs)
    y = add_frozen_rows_(_gmm(z_down, _t(ad.b_down), offs).mul_(s), h, w["down"], chunk)
    weighted_out.index_add_(0, tokens, y * flat_w[:, None].to(y.dtype))
    return [g, u, y, z_gu, z_down]


CHUNK_EXPERTS = 4  # a chunk holds about this many average experts' rows


def chunk_rows(tokens: int, rows: int, experts: int) -> int:
    """Most rows of a chunk: min(T, ceil(4 N / E)) for N routed rows over E experts (T tokens in, the rank's
    received rows under expert parallelism). A chunk's temporaries are then about those of 4 experts of the
    loop, and never larger than the layer's [T, hidden] input."""
    return max(1, min(tokens, -(-CHUNK_EXPERTS * rows // max(experts, 1))))


def sorted_tokens(call: ExpertsCall, top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each sorted assignment, its routing weight)."""
    return call.routing.order // call.routing.top_k, top_k_weights.reshape(-1)[call.routing.order]


NO_GRAD_CHUNK_ROWS = 1024  # a forward that keeps nothing for backward: chunks of at least min(T, this) rows


def call_chunks(call: ExpertsCall, x: torch.Tensor, keep_saved: bool = True) -> list[Chunk]:
    """The call's chunks: of at most `chunk_rows` rows when the forward keeps its tensors for backward, else of at
    most max(chunk_rows, min(T, NO_GRAD_CHUNK_ROWS)) rows: nothing outlives a chunk, so a decode step of T <= 1024
    rows over E experts makes about k chunks instead of E / 4, while a long prefill's temporaries stay bounded."""
    counts = call.routing.counts
    most = chunk_rows(x.shape[0], sum(counts), len(counts))
    if not keep_saved:
        most = max(most, min(x.shape[0], NO_GRAD_CHUNK_ROWS))
    return chunks(counts, most, x.device)


def gmm_forward(x, top_k_weights, lora, call: ExpertsCall, keep_saved: bool):
    """(out [T, H], the chunks, and when keep_saved the five tensors per chunk that backward needs)."""
    if call.dropout:
        raise ValueError("the grouped_mm expert kernel has no dropout; the loop kernel (grouped_lora) has")
    (tokens, flat_w), parts = sorted_tokens(call, top_k_weights), call_chunks(call, x, keep_saved)
    out, saved = torch.zeros_like(x), []
    for c in parts:
        rows = slice(c.start, c.stop)
        tensors = chunk_forward(x, out, tokens[rows], flat_w[rows], _Adapters(lora, c, x.dtype), call, c)
        if keep_saved:
            saved += tensors
    return out, parts, saved


def chunk_backward(
    x, dout, tokens, flat_w, saved, ad: _Adapters, call: ExpertsCall, chunk: Chunk, need_x: bool, need_w: bool
):
    """(dL/d routing weight of each row or None, [dA_gate_up, dB_gate, dB_up, dA_down, dB_down] of the chunk's
    experts, dL/d xs or None) from the chunk's saved [g, u, y, z_gate_up, z_down]."""
    g, u, y, z_gu, z_down = saved
    s, w, offs, r = call.scale, call.weights, chunk.offsets, ad.b_gate.shape[2]
    d_out = dout.index_select(0, tokens)
    dw = (d_out * y).sum(-1) if need_w else None
    dy = d_out.mul_(flat_w[:, None].to(d_out.dtype))
    dz_down = _gmm(dy, ad.b_down, offs).mul_(s)
    dh = add_frozen_rows_backward_(_gmm(dz_down, ad.a_down, offs), dy, w["down"], chunk)
    act = F.silu(g)
    h = act * u  # the same ops as forward, so h matches forward's bit for bit
    grad_b_down = _gmm(dy.t(), z_down, offs).mul_(s)
    grad_a_down = _gmm(dz_down.t(), h, offs)
    del d_out, dy, h
    sig = torch.sigmoid(g)
    dg = dh * u * sig * (1 + g * (1 - sig))
    du = dh * act
    del dh, act, sig
    dz_gu = torch.cat([_gmm(dg, ad.b_gate, offs), _gmm(du, ad.b_up, offs)], dim=1).mul_(s)
    grad_b_gate = _gmm(dg.t(), z_gu[:, :r], offs).mul_(s)
    grad_b_up = _gmm(du.t(), z_gu[:, r:], offs).mul_(s)
    xs = x.index_select(0, tokens)
    grad_a_gate_up = _gmm(dz_gu.t(), xs, offs)
    del xs
    dxs = None
    if need_x:
        dxs = add_frozen_rows_backward_(_gmm(dz_gu, ad.a_gate_up, offs), dg, w["gate"], chunk)
        add_frozen_rows_backward_(dxs, du, w["up"], chunk)
    return dw, [grad_a_gate_up, grad_b_gate, grad_b_up, grad_a_down, grad_b_down], dxs


class GroupedGemmLoRAExperts(torch.autograd.Function):
    """apply(x [T,H], top_k_weights [T,k], a_gate, b_gate, a_up, b_up, a_down, b_down, call) -> [T,H];
    the same contract as GroupedLoRAExperts, with call.dropout == 0."""

    @staticmethod
    def forward(ctx, x, top_k_weights, *args):
        *lora, call = args
        out, ctx.parts, saved = gmm_forward(x, top_k_weights, lora, call, keep_saved=True)
        save_experts_call(ctx, x, top_k_weights, lora, saved, call)
        return out

    @staticmethod
    def backward(ctx, dout):
        call, x, top_k_weights, lora, saved, need_x, need_w = saved_experts_call(ctx)
        (tokens, flat_w), parts = sorted_tokens(call, top_k_weights), ctx.parts
        grads = [torch.zeros_like(t) for t in lora]  # experts no row reached keep exact zeros
        (ga_g, gb_g), (ga_u, gb_u), (ga_d, gb_d) = (factor_map(grads)[p] for p in EXPERT_PROJECTIONS)
        dx = torch.zeros_like(x) if need_x else None
        dw = torch.zeros_like(flat_w) if need_w else None
        for i, c in enumerate(parts):
            rows, part, r = slice(c.start, c.stop), slice(c.first, c.end), lora[0].shape[1]
            dw_c, (a_gu, b_g, b_u, a_d, b_d), dxs = chunk_backward(
                x,
                dout,
                tokens[rows],
                flat_w[rows],
                saved[5 * i : 5 * i + 5],
                _Adapters(lora, c, x.dtype),
                call,
                c,
                need_x,
                need_w,
            )
            ga_g[part].copy_(a_gu[:, :r])
            ga_u[part].copy_(a_gu[:, r:])
            gb_g[part].copy_(b_g)
            gb_u[part].copy_(b_u)
            ga_d[part].copy_(a_d)
            gb_d[part].copy_(b_d)
            for idle in (e for e in range(c.first, c.end) if call.routing.counts[e] == 0):
                for g in (
                    grads
                ):  # an expert no row reached inside a chunk: exact zeros, whatever a kernel does with an empty group
                    g[idle].zero_()
            if need_w:
                dw[rows] = dw_c.to(dw.dtype)
            if need_x:
                dx.index_add_(0, tokens[rows], dxs)
        if need_w:
            dw = torch.zeros_like(dw).index_put_((call.routing.order,), dw)
        return experts_call_grads(ctx, dx, dw, top_k_weights, grads)
