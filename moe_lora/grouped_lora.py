"""Routed experts with per-expert LoRA as one autograd Function.

Tokens are grouped by expert, each expert's frozen weights are dequantized only while that expert runs,
and W + s*B*A is never formed. For expert e and projection p in (gate, up, down), frozen W [out, in],
adapter A [r, in], B [out, r], scale s, dropout d (keep mask / (1 - p); identity when p = 0):

    proj(u)   = u W^T + s * z B^T,   z = d(u) A^T
    mlp_e(x)  = proj_down( silu(proj_gate(x)) * proj_up(x) )
    out_t     = sum_j w_tj * mlp_{e_tj}(x_t)

Backward of one projection, given dY = dL/dproj(u):

    dB = s * dY^T z        dz = s * dY B        dA = dz^T d(u)        du = dY W + d(dz A)

and through the MLP: dg = dh * u * silu'(g), du = dh * silu(g), silu'(g) = sig(g) (1 + g (1 - sig(g))),
dw_tj = <dout_t, mlp_e(x_t)>. Gate and up read the same x, so they share one dropout mask and their
A's are applied as one stacked [2r, in] matrix (one skinny matmul instead of two, forward and backward).

Saved for backward per routed (token, slot): g, u (2 * intermediate values), y = mlp_e(x) (hidden
values) and z (3r values). Autograd on the frozen base alone keeps g, silu(g), u and y, so LoRA adds no
activation memory: x is gathered again, h = silu(g) * u recomputed, dropout masks redrawn from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from quant.formats import QuantizedWeight
from quant.modules import EXPERT_PROJECTIONS


@dataclass(frozen=True)
class Routing:
    """Assignments (t*k + j) sorted by expert, as `group_tokens_by_expert` returns them."""

    order: torch.Tensor
    counts: list[int]
    top_k: int

    def groups(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(expert, its assignment ids) for every expert that received tokens."""
        start = 0
        for expert, count in enumerate(self.counts):
            if count:
                yield expert, self.order[start : start + count]
            start += count


@dataclass(frozen=True)
class ExpertsCall:
    """Everything about one call that is not a differentiable tensor."""

    weights: dict[str, list[QuantizedWeight]]  # FrozenExperts.weights: projection -> per-expert weight
    routing: Routing
    scale: float
    dropout: float
    seed: int  # dropout masks are drawn from a generator seeded with this, in a fixed order


class DropoutMasks:
    """Dropout keep-masks (already divided by 1 - p) drawn in call order from one seeded generator,
    so backward redraws exactly the masks forward used instead of storing them."""

    def __init__(self, p: float, seed: int, device: torch.device):
        self.p = p
        self.generator = torch.Generator(device=device).manual_seed(seed) if p > 0 else None

    def draw(self, like: torch.Tensor) -> torch.Tensor | None:
        if self.generator is None:
            return None
        keep = torch.empty_like(like).bernoulli_(1.0 - self.p, generator=self.generator)
        return keep.div_(1.0 - self.p)


def _dropped(u: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return u if keep is None else u * keep


def _add_input_grad_(du: torch.Tensor, dz: torch.Tensor, a: torch.Tensor, keep: torch.Tensor | None) -> None:
    """du += d(dz A), the LoRA path's share of dL/du."""
    if keep is None:
        du.addmm_(dz, a)
    else:
        du.add_((dz @ a).mul_(keep))


@dataclass
class ExpertLoRA:
    """One expert's frozen weights and adapter factors, factors cast to the compute dtype."""

    w_gate: QuantizedWeight
    w_up: QuantizedWeight
    w_down: QuantizedWeight
    a_gate_up: torch.Tensor  # [2r, hidden]: A_gate stacked on A_up
    b_gate: torch.Tensor  # [intermediate, r]
    b_up: torch.Tensor
    a_down: torch.Tensor  # [r, intermediate]
    b_down: torch.Tensor  # [hidden, r]

    @classmethod
    def of(cls, call: ExpertsCall, factors: dict[str, tuple], expert: int, dtype: torch.dtype) -> "ExpertLoRA":
        (a_g, b_g), (a_u, b_u), (a_d, b_d) = (factors[p] for p in EXPERT_PROJECTIONS)
        w = call.weights
        return cls(
            w["gate"][expert],
            w["up"][expert],
            w["down"][expert],
            torch.cat([a_g[expert], a_u[expert]]).to(dtype),
            b_g[expert].to(dtype),
            b_u[expert].to(dtype),
            a_d[expert].to(dtype),
            b_d[expert].to(dtype),
        )


@dataclass
class ExpertGrads:
    """dL/d(factors) of one expert in the compute dtype; dx is None when the input needs no gradient."""

    a_gate_up: torch.Tensor
    b_gate: torch.Tensor
    b_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    dx: torch.Tensor | None


def expert_forward(x: torch.Tensor, ex: ExpertLoRA, s: float, masks: DropoutMasks) -> list[torch.Tensor]:
    """[g, u, y, z_gate_up, z_down] of one expert on its tokens x [n, hidden]; masks drawn for x, then h."""
    r = ex.b_gate.shape[1]
    z_gu = _dropped(x, masks.draw(x)) @ ex.a_gate_up.t()
    g = F.linear(x, ex.w_gate.dequantize(x.dtype)).addmm_(z_gu[:, :r], ex.b_gate.t(), alpha=s)
    u = F.linear(x, ex.w_up.dequantize(x.dtype)).addmm_(z_gu[:, r:], ex.b_up.t(), alpha=s)
    h = F.silu(g) * u
    z_down = _dropped(h, masks.draw(h)) @ ex.a_down.t()
    y = F.linear(h, ex.w_down.dequantize(h.dtype)).addmm_(z_down, ex.b_down.t(), alpha=s)
    return [g, u, y, z_gu, z_down]


def expert_backward(dy, x, saved, ex: ExpertLoRA, s: float, masks: DropoutMasks, need_x: bool) -> ExpertGrads:
    """Gradients of one expert given dy = dL/dmlp_e(x) [n, hidden]; masks redrawn in forward's order."""
    g, u, _, z_gu, z_down = saved
    r = ex.b_gate.shape[1]
    keep_x = masks.draw(x)
    act = F.silu(g)  # the same op as forward, so h matches forward's bit for bit
    h = act * u
    keep_h = masks.draw(h)

    dz_down = (dy @ ex.b_down).mul_(s)
    dh = dy @ ex.w_down.dequantize(dy.dtype)
    _add_input_grad_(dh, dz_down, ex.a_down, keep_h)
    sig = torch.sigmoid(g)
    dg = dh * u * sig * (1 + g * (1 - sig))
    du = dh * act

    dz_gu = torch.cat([dg @ ex.b_gate, du @ ex.b_up], dim=1).mul_(s)
    dx = None
    if need_x:
        dx = dg @ ex.w_gate.dequantize(dg.dtype)
        dx.addmm_(du, ex.w_up.dequantize(du.dtype))
        _add_input_grad_(dx, dz_gu, ex.a_gate_up, keep_x)
    return ExpertGrads(
        a_gate_up=dz_gu.t() @ _dropped(x, keep_x),
        b_gate=(dg.t() @ z_gu[:, :r]).mul_(s),
        b_up=(du.t() @ z_gu[:, r:]).mul_(s),
        a_down=dz_down.t() @ _dropped(h, keep_h),
        b_down=(dy.t() @ z_down).mul_(s),
        dx=dx,
    )


def factor_map(tensors) -> dict[str, tuple]:
    """(a_gate, b_gate, a_up, b_up, a_down, b_down) -> {projection: (A, B)}."""
    return {p: (tensors[2 * i], tensors[2 * i + 1]) for i, p in enumerate(EXPERT_PROJECTIONS)}


def grouped_forward(x, top_k_weights, factors: dict[str, tuple], call: ExpertsCall, keep_saved: bool):
    """out [T, H] and, when keep_saved, the 5 tensors per routed expert that backward needs."""
    out = torch.zeros_like(x)
    flat_w = top_k_weights.reshape(-1)
    masks = DropoutMasks(call.dropout, call.seed, x.device)
    saved: list[torch.Tensor] = []
    for expert, rows in call.routing.groups():
        tokens = rows // call.routing.top_k
        tensors = expert_forward(
            x.index_select(0, tokens), ExpertLoRA.of(call, factors, expert, x.dtype), call.scale, masks
        )
        out.index_add_(0, tokens, tensors[2] * flat_w[rows, None].to(x.dtype))
        if keep_saved:
            saved += tensors
    return out, saved


def _store_grads(grads: dict[str, tuple], expert: int, eg: ExpertGrads, r: int) -> None:
    (ga_g, gb_g), (ga_u, gb_u), (ga_d, gb_d) = (grads[p] for p in EXPERT_PROJECTIONS)
    ga_g[expert].copy_(eg.a_gate_up[:r])
    ga_u[expert].copy_(eg.a_gate_up[r:])
    gb_g[expert].copy_(eg.b_gate)
    gb_u[expert].copy_(eg.b_up)
    ga_d[expert].copy_(eg.a_down)
    gb_d[expert].copy_(eg.b_down)


def save_experts_call(ctx, x, top_k_weights, lora, saved, call: ExpertsCall) -> None:
    """What the backward of an experts autograd Function reads: the call, then x, the weights, the six
    factors and the kernel's saved tensors."""
    ctx.call = call
    ctx.save_for_backward(x, top_k_weights, *lora, *saved)


def saved_experts_call(ctx):
    """(call, x, top_k_weights, six factors, the kernel's saved tensors, need dx, need d weights)."""
    x, top_k_weights, *rest = ctx.saved_tensors
    return ctx.call, x, top_k_weights, rest[:6], rest[6:], ctx.needs_input_grad[0], ctx.needs_input_grad[1]


def experts_call_grads(ctx, dx, flat_dw, top_k_weights, lora_grads) -> tuple:
    """backward's return: dx, d weights [T, k], the factor gradients autograd asked for, None for the call."""
    lora_grads = [g if ctx.needs_input_grad[2 + i] else None for i, g in enumerate(lora_grads)]
    return dx, None if flat_dw is None else flat_dw.view_as(top_k_weights), *lora_grads, None


class GroupedLoRAExperts(torch.autograd.Function):
    """apply(x [T,H], top_k_weights [T,k], a_gate, b_gate, a_up, b_up, a_down, b_down, call) -> [T,H].

    A: [E, r, in], B: [E, out, r] (any float dtype; the matmuls run in x's dtype)."""

    @staticmethod
    def forward(ctx, x, top_k_weights, *args):
        *lora, call = args
        out, saved = grouped_forward(x, top_k_weights, factor_map(lora), call, keep_saved=True)
        save_experts_call(ctx, x, top_k_weights, lora, saved, call)
        return out

    @staticmethod
    def backward(ctx, dout):
        call, x, top_k_weights, lora, saved, need_x, need_w = saved_experts_call(ctx)
        lora_grads = [torch.zeros_like(t) for t in lora]
        dx = torch.zeros_like(x) if need_x else None
        flat_w = top_k_weights.reshape(-1)
        dw = torch.zeros_like(flat_w) if need_w else None
        masks = DropoutMasks(call.dropout, call.seed, x.device)
        factors, grads, r = factor_map(lora), factor_map(lora_grads), lora[0].shape[1]
        for i, (expert, rows) in enumerate(call.routing.groups()):
            tensors = saved[5 * i : 5 * i + 5]
            tokens = rows // call.routing.top_k
            d_out = dout.index_select(0, tokens)
            if need_w:
                dw[rows] = (d_out * tensors[2]).sum(-1).to(dw.dtype)
            ex = ExpertLoRA.of(call, factors, expert, x.dtype)
            dy = d_out.mul_(flat_w[rows, None].to(d_out.dtype))
            eg = expert_backward(dy, x.index_select(0, tokens), tensors, ex, call.scale, masks, need_x)
            _store_grads(grads, expert, eg, r)
            if need_x:
                dx.index_add_(0, tokens, eg.dx)
        return experts_call_grads(ctx, dx, dw, top_k_weights, lora_grads)
