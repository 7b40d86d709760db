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

The frozen projections stay one matmul per expert on its contiguous rows (each expert is dequantized only
while it runs, as in the loop); only the skinny adapter matmuls, 6 forward and 12 backward per expert in
the loop, become 18 grouped calls in all. Saved for backward: g, u, y, z_g, z_u, z_d per assignment, the
loop's tensors. Dropout is not supported here (RL training refuses it; `LoRAConfig` routes it to the loop).

grouped_mm needs 16-byte aligned strides: rank * element size must be a multiple of 16 (rank % 8 == 0 in
bf16, % 4 in float32). `grouped_mm_supported` says whether a rank and dtype qualify.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lora.grouped_lora import ExpertsCall, Routing, factor_map
from quant.formats import QuantizedWeight
from quant.modules import EXPERT_PROJECTIONS


def grouped_mm_available() -> bool:
    """torch.nn.functional.grouped_mm exists (torch >= 2.9)."""
    return hasattr(F, "grouped_mm")


def grouped_mm_supported(rank: int, dtype: torch.dtype) -> bool:
    """grouped_mm can run this adapter: the function exists and rank * element size is a multiple of 16 bytes."""
    return grouped_mm_available() and (rank * torch.empty((), dtype=dtype).element_size()) % 16 == 0


def spans(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows, in the sorted-assignment layout."""
    out, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            out.append((expert, start, start + count))
        start += count
    return out


def group_offsets(routing: Routing, device: torch.device) -> torch.Tensor:
    """o_e = rows of experts 0..e (int32, as grouped_mm takes them); built from host counts, no device sync."""
    return torch.tensor(routing.counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def frozen_rows(xs: torch.Tensor, weights: list[QuantizedWeight], groups, out_features: int) -> torch.Tensor:
    """Row block of expert e: xs[rows] @ W_e^T, each W_e dequantized only for its own matmul."""
    out = xs.new_empty(xs.shape[0], out_features)
    for expert, start, end in groups:
        torch.matmul(xs[start:end], weights[expert].dequantize(xs.dtype).t(), out=out[start:end])
    return out


def frozen_rows_backward(dys: torch.Tensor, weights: list[QuantizedWeight], groups, in_features: int) -> torch.Tensor:
    """Row block of expert e: dys[rows] @ W_e (the input gradient of frozen_rows)."""
    out = dys.new_empty(dys.shape[0], in_features)
    for expert, start, end in groups:
        torch.matmul(dys[start:end], weights[expert].dequantize(dys.dtype), out=out[start:end])
    return out


class _Adapters:
    """The six factor stacks in the compute dtype: A [E, r, in], B [E, out, r]."""

    def __init__(self, lora, dtype: torch.dtype):
        factors = factor_map([t.to(dtype) for t in lora])
        (self.a_gate, self.b_gate), (self.a_up, self.b_up), (self.a_down, self.b_down) = (factors[p] for p in EXPERT_PROJECTIONS)


def _gmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of group e of x [N, K] times w_e [K, M]; or, with x [K, N] and w [N, M], group e's slice of the
    summed N (then the result is [E, K, M])."""
    return F.grouped_mm(x, w, offs=offsets)


def sorted_forward(xs, ad: _Adapters, call: ExpertsCall, groups, offsets):
    """[g, u, y, z_gate, z_up, z_down] for the sorted assignments xs [N, hidden]."""
    s, w = call.scale, call.weights
    z_gate = _gmm(xs, ad.a_gate.transpose(-2, -1), offsets)
    z_up = _gmm(xs, ad.a_up.transpose(-2, -1), offsets)
    g = frozen_rows(xs, w["gate"], groups, ad.b_gate.shape[1]).add_(_gmm(z_gate, ad.b_gate.transpose(-2, -1), offsets), alpha=s)
    u = frozen_rows(xs, w["up"], groups, ad.b_up.shape[1]).add_(_gmm(z_up, ad.b_up.transpose(-2, -1), offsets), alpha=s)
    h = F.silu(g) * u
    z_down = _gmm(h, ad.a_down.transpose(-2, -1), offsets)
    y = frozen_rows(h, w["down"], groups, ad.b_down.shape[1]).add_(_gmm(z_down, ad.b_down.transpose(-2, -1), offsets), alpha=s)
    return [g, u, y, z_gate, z_up, z_down]


def gmm_forward(x, top_k_weights, lora, call: ExpertsCall, keep_saved: bool):
    """out [T, H] and, when keep_saved, the six sorted tensors backward needs."""
    if call.dropout:
        raise ValueError("the grouped_mm expert kernel has no dropout; the loop kernel (grouped_lora) has")
    routing = call.routing
    tokens = routing.order // routing.top_k
    offsets, groups = group_offsets(routing, x.device), spans(routing.counts)
    saved = sorted_forward(x.index_select(0, tokens), _Adapters(lora, x.dtype), call, groups, offsets)
    weighted = saved[2] * top_k_weights.reshape(-1)[routing.order, None].to(x.dtype)
    out = torch.zeros_like(x).index_add_(0, tokens, weighted)
    return out, (saved if keep_saved else [])


class GroupedGemmLoRAExperts(torch.autograd.Function):
    """apply(x [T,H], top_k_weights [T,k], a_gate, b_gate, a_up, b_up, a_down, b_down, call) -> [T,H];
    the same contract as GroupedLoRAExperts, with call.dropout == 0."""

    @staticmethod
    def forward(ctx, x, top_k_weights, *args):
        *lora, call = args
        out, saved = gmm_forward(x, top_k_weights, lora, call, keep_saved=True)
        ctx.call = call
        ctx.save_for_backward(x, top_k_weights, *lora, *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        call: ExpertsCall = ctx.call
        x, top_k_weights, *rest = ctx.saved_tensors
        lora, (g, u, y, z_gate, z_up, z_down) = rest[:6], rest[6:]
        routing, s, w = call.routing, call.scale, call.weights
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens = routing.order // routing.top_k
        offsets, groups = group_offsets(routing, x.device), spans(routing.counts)
        ad = _Adapters(lora, x.dtype)

        d_out = dout.index_select(0, tokens)
        flat_w = top_k_weights.reshape(-1)
        dw = None
        if need_w:
            dw = torch.zeros_like(flat_w)
            dw[routing.order] = (d_out * y).sum(-1).to(dw.dtype)
        dy = d_out.mul_(flat_w[routing.order, None].to(d_out.dtype))

        dz_down = _gmm(dy, ad.b_down, offsets).mul_(s)
        dh = frozen_rows_backward(dy, w["down"], groups, ad.a_down.shape[2]).add_(_gmm(dz_down, ad.a_down, offsets))
        act = F.silu(g)
        sig = torch.sigmoid(g)
        dg = dh * u * sig * (1 + g * (1 - sig))
        du = dh * act
        dz_gate = _gmm(dg, ad.b_gate, offsets).mul_(s)
        dz_up = _gmm(du, ad.b_up, offsets).mul_(s)

        xs = x.index_select(0, tokens)
        h = act * u  # the same ops as forward, so h matches forward's bit for bit
        grads = [
            _gmm(dz_gate.t(), xs, offsets),
            _gmm(dg.t(), z_gate, offsets).mul_(s),
            _gmm(dz_up.t(), xs, offsets),
            _gmm(du.t(), z_up, offsets).mul_(s),
            _gmm(dz_down.t(), h, offsets),
            _gmm(dy.t(), z_down, offsets).mul_(s),
        ]
        idle = [e for e, count in enumerate(routing.counts) if count == 0]
        if idle:  # an expert no row reached gets an exact zero, whatever a kernel does with an empty group
            for gr in grads:
                gr[idle] = 0
        lora_grads = [gr.to(t.dtype) if ctx.needs_input_grad[2 + i] else None for i, (gr, t) in enumerate(zip(grads, lora))]
        dx = None
        if need_x:
            dxs = frozen_rows_backward(dg, w["gate"], groups, x.shape[1])
            dxs.add_(frozen_rows_backward(du, w["up"], groups, x.shape[1]))
            dxs.add_(_gmm(dz_gate, ad.a_gate, offsets)).add_(_gmm(dz_up, ad.a_up, offsets))
            dx = torch.zeros_like(x).index_add_(0, tokens, dxs)
        return dx, None if dw is None else dw.view_as(top_k_weights), *lora_grads, None
