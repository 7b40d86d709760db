"""Routed experts in fixed shapes: a no-grad forward whose tensors' shapes depend on the token count only and which
never reads the routing on the host, so that a decode step can be captured as a CUDA graph
(allsync/engines/graphs.py).

The other kernels (moe_lora.grouped_lora, moe_lora.grouped_gemm, FrozenExperts.local_forward) read each expert's
token count on the host to slice its rows and dequantize only the experts routed to: one host round per MoE layer and
one per routed expert, which a captured graph cannot contain. Here, for the N = T k assignments a = t k + j sorted by
expert (`order`, stable) over the E experts held:

    o_e   = #{a : e_a <= e}        (searchsorted of the sorted expert ids against 0..E-1: grouped_mm's int32 offsets,
                                     computed on the device)
    xs    = x[order // k]          (each sorted assignment's token)
    gu    = gmm(xs, [W_gate; W_up]^T) + s [gmm(z, B_gate^T) ; gmm(z', B_up^T)],   [z ; z'] = gmm(xs, [A_gate; A_up]^T)
    h     = silu(gu[:, :I]) * gu[:, I:]
    y     = gmm(h, W_down^T) + s gmm(gmm(h, A_down^T), B_down^T)
    out_t = sum_j w_tj y_(t k + j)  (y put back in assignment order first)

with gmm(X, W)[rows of e] = X[rows of e] W_e (torch.nn.functional.grouped_mm). The LoRA terms are those of
moe_lora.lora_layers.LoRAExperts (per_expert or shared_outer: a shared factor arrives expanded over the experts), and
without an adapter (FrozenExperts, or adapters disabled) only the frozen terms remain.

Under expert parallelism (moe_lora.expert_parallel.ExpertDispatch.fixed_shape) every rank gathers every rank's
tokens and routing (all-to-alls of equal splits), computes its experts' share of each token's output here (the
assignments to other ranks' experts sort last, past grouped_mm's last offset: no product is computed for them) and
sends each rank its tokens' shares back, summed there.

The price of not reading the routing: every expert held is dequantized at every call, the transient is
[E, 2I, H] + [E, H, I] in the compute dtype and the frozen bytes read are all E experts'. Under expert parallelism a
decode step reaches nearly every expert of a rank anyway (48 ranks: 5-6 experts each, 32+ rows x 8 assignments);
on one GPU holding all 256 a decode step of B rows reaches about 256 (1 - (1 - 8/256)^B) of them (64% at B = 32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quant.formats import QuantizedWeight
from quant.fused_experts import nf4_grouped_mm


def expert_offsets(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """grouped_mm's offsets [E] (int32) for assignments sorted by expert: o_e = #{a : e_a <= e}, on the device."""
    bounds = torch.arange(num_experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, bounds, right=True).to(torch.int32)


def dequantized(weights: list[list[QuantizedWeight]], dtype: torch.dtype) -> torch.Tensor:
    """Every expert's frozen weights of the given projections, dequantized to `dtype` and stacked along the output:
    [E, sum of their out, in] (gate and up: [E, 2I, H]), each weight dequantized in place in one buffer (no
    temporary: QuantizedWeight.dequantize(out=))."""
    first = [w[0] for w in weights]
    rows = sum(w.shape[0] for w in first)
    out = torch.empty(len(weights[0]), rows, first[0].shape[1], dtype=dtype, device=first[0].data.device)
    for e, experts in enumerate(zip(*weights)):
        start = 0
        for w in experts:
            w.dequantize(dtype, out=out[e, start : start + w.shape[0]])
            start += w.shape[0]
    return out


def _gmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of group e of x [N, K] times w_e^T (w [E, M, K]): [N, M]."""
    return F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def fixed_shape_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: dict[str, list[QuantizedWeight]],
    factors: list[torch.Tensor] | None = None,
    scale: float = 0.0,
    first_expert: int = 0,
    fused: dict | None = None,
) -> torch.Tensor:
    """out [T, H] of the routed experts held (module docstring) for x [T, H] routed to top_k_index [T, k] with weights
    top_k_weights [T, k]; factors: [A_gate, B_gate, A_up, B_up, A_down, B_down], each [E, ...], or None for the
    frozen experts alone. The experts held are first_expert .. first_expert + E - 1 (expert parallelism: every rank's
    tokens, gathered); an assignment to another expert contributes nothing: it sorts after every held expert's, past
    grouped_mm's last offset, so no product is computed for it, and its row of the output is dropped. fused:
    the experts' NF4 per projection (quant.fused_experts.StackedNF4), multiplied without a dequantized copy by
    quant.fused_experts.nf4_grouped_mm (the same W rounded to bfloat16; None: dequantize, then grouped_mm)."""
    tokens, k = top_k_index.shape
    dtype = x.dtype
    held = len(weights["gate"])
    local = top_k_index.reshape(-1) - first_expert
    here = (local >= 0) & (local < held)
    flat = torch.where(here, local, held)  # the others sort last
    order = torch.argsort(flat, stable=True)
    offsets = expert_offsets(flat[order], held)
    xs = x.index_select(0, order // k)
    inter = weights["gate"][0].shape[0]
    if fused is not None:
        gu = torch.cat([nf4_grouped_mm(xs, fused["gate"], offsets), nf4_grouped_mm(xs, fused["up"], offsets)], dim=1)
    else:
        gate_up = dequantized([weights["gate"], weights["up"]], dtype)  # [E, 2I, H]
        gu = _gmm(xs, gate_up, offsets)
        del gate_up
    if factors is not None:
        a_gate, b_gate, a_up, b_up, a_down, b_down = (f.to(dtype) for f in factors)
        z = _gmm(xs, torch.cat([a_gate, a_up], dim=1), offsets)  # [N, 2r]
        rank = a_gate.shape[1]
        gu[:, :inter] += scale * _gmm(z[:, :rank].contiguous(), b_gate.contiguous(), offsets)
        gu[:, inter:] += scale * _gmm(z[:, rank:].contiguous(), b_up.contiguous(), offsets)
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    del gu
    y = (
        nf4_grouped_mm(h, fused["down"], offsets)
        if fused is not None
        else _gmm(h, dequantized([weights["down"]], dtype), offsets)
    )
    if factors is not None:
        y += scale * _gmm(_gmm(h, a_down.contiguous(), offsets), b_down.contiguous(), offsets)
    in_assignment_order = torch.empty_like(y).index_copy_(0, order, y)
    mine = torch.where(here[:, None], in_assignment_order, 0)  # rows past the last offset hold no value
    return (mine.view(tokens, k, -1) * top_k_weights[..., None].to(dtype)).sum(1)
