"""LoRA modules around the frozen quantized modules of `quant.modules`.

    LoRALinear:  y = frozen_linear(x, W) + s * (dropout(x) A^T) B^T
    LoRAExperts: every routed expert e gets its own A_e, B_e for gate, up and down (layout per_expert), or
                 (layout shared_outer) the input side is shared by the layer's experts for gate and up and the
                 output side for down: A_gate, A_up [r, in] and B_down [hidden, r] once a layer, B_gate_e,
                 B_up_e and A_down_e per expert,
                     gate_e(x) = W_gate_e x + s B_gate_e (A_gate x),  down_e(h) = W_down_e h + s B_down (A_down_e h);
                 computed per group of routed tokens: one loop step per expert (grouped_lora, the reference) or
                 grouped GEMMs (grouped_gemm, the default on GPUs). The shared factors are the same on every
                 expert-parallel rank (replicated, their gradients summed over all ranks like attention's), so what
                 is trained does not depend on how the experts are split.

A [r, in] starts kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) and B [out, r] at zero,
as in PEFT, so a fresh adapter leaves the model unchanged. Adapters are kept in `dtype` (float32 by
default: the optimizer's copy); their matmuls run in the activation dtype. W + s*B*A is never formed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_lora.grouped_gemm import GroupedGemmLoRAExperts, gmm_forward, grouped_mm_supported
from moe_lora.grouped_lora import ExpertsCall, GroupedLoRAExperts, Routing, factor_map, grouped_forward
from quant.modules import EXPERT_PROJECTIONS, FrozenExperts, FrozenLinear, fixed_shape_call, group_tokens_by_expert


SHARED_OUTER = {("gate", "A"), ("up", "A"), ("down", "B")}  # the factors a shared_outer layer's experts share


def init_lora_a_(a: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """PEFT's init of A [r, in]: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in))."""
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)


class LoRALinear(nn.Module):
    """A FrozenLinear plus a trainable low-rank update: y = x W^T + (s * dropout(x) A^T) B^T.

    s multiplies the rank-r factor, not the [..., out] product: r values per token instead of out (the same
    numbers bit for bit when s is a power of two, as alpha / r usually is), and the product is added in place."""

    def __init__(self, base: FrozenLinear, rank: int, scale: float, dropout: float = 0.0, dtype=torch.float32):
        super().__init__()
        self.base, self.rank, self.scale = base, rank, scale
        device = base.weight_q.data.device
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=dtype, device=device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # False: the frozen base alone (the reference policy; see moe_lora.lora.adapters_disabled)
        self.merged: torch.Tensor | None = None  # W + s B A, formed for generation (moe_lora.lora.lora_merged)
        init_lora_a_(self.lora_A.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.base(x)
        if self.merged is not None and not torch.is_grad_enabled():
            return F.linear(x, self.merged)
        z = F.linear(self.dropout(x), self.lora_A.to(x.dtype)).mul_(
            self.scale
        )  # s on the [.., r] factor, not the output
        return self.base(x).add_(F.linear(z, self.lora_B.to(x.dtype)))

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


def expert_shapes(base: FrozenExperts) -> dict[str, tuple[int, int]]:
    """(out, in) of each expert projection."""
    h, i = base.hidden_size, base.intermediate_size
    return {"gate": (i, h), "up": (i, h), "down": (h, i)}


class LoRAExperts(nn.Module):
    """FrozenExperts plus per-expert LoRA on gate, up and down; same forward signature (drops into
    transformers' DeepseekV3MoE).

    lora_A[p]: [E, r, in], lora_B[p]: [E, out, r]: one 3-D parameter per projection, so the optimizer
    sees 6 tensors per layer instead of 6 * E. Under layout shared_outer the shared factors (SHARED_OUTER) are
    [1, r, in] / [1, out, r]; `factors()` hands the kernels every factor as [E, ...], a shared one as a view of its
    one copy expanded over the experts (no copy), and autograd sums the experts' gradients into it.
    """

    group = "routed_experts"
    kernels = ("auto", "loop", "grouped_mm")
    layouts = ("per_expert", "shared_outer")

    def __init__(
        self,
        base: FrozenExperts,
        rank: int,
        scale: float,
        dropout: float = 0.0,
        dtype=torch.float32,
        kernel: str = "auto",
        layout: str = "per_expert",
    ):
        super().__init__()
        if kernel not in self.kernels:
            raise ValueError(f"unknown routed-expert kernel {kernel!r}; valid: {', '.join(self.kernels)}")
        if layout not in self.layouts:
            raise ValueError(f"unknown routed-expert LoRA layout {layout!r}; valid: {', '.join(self.layouts)}")
        self.base, self.rank, self.scale, self.dropout, self.kernel = base, rank, scale, dropout, kernel
        self.layout = layout
        device = base.weights["gate"][0].data.device
        self.enabled = True  # False: the frozen experts alone (see moe_lora.lora.adapters_disabled)
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for p, (out_f, in_f) in expert_shapes(base).items():
            a_count, b_count = (self.copies(p, side) for side in "AB")
            self.lora_A[p] = nn.Parameter(torch.empty(a_count, rank, in_f, dtype=dtype, device=device))
            self.lora_B[p] = nn.Parameter(torch.zeros(b_count, out_f, rank, dtype=dtype, device=device))
            for a in self.lora_A[p].data:  # per expert: kaiming on the 3-D tensor would use fan_in = r * in
                init_lora_a_(a)

    def shared(self, projection: str, side: str) -> bool:
        """Whether `side` (A or B) of `projection` is one tensor for all the layer's experts."""
        return self.layout == "shared_outer" and (projection, side) in SHARED_OUTER

    def copies(self, projection: str, side: str) -> int:
        """How many copies of the factor the module holds: 1 if shared, else one per expert held."""
        return 1 if self.shared(projection, side) else self.base.num_experts

    def adapter_parameters(self) -> list[nn.Parameter]:
        """[A_gate, B_gate, A_up, B_up, A_down, B_down] as held (a shared factor's leading size is 1)."""
        return [t for p in EXPERT_PROJECTIONS for t in (self.lora_A[p], self.lora_B[p])]

    def per_expert_parameters(self) -> list[nn.Parameter]:
        """The factors held per expert (under expert parallelism: this rank's experts' only)."""
        return [
            t
            for p in EXPERT_PROJECTIONS
            for side, t in zip("AB", (self.lora_A[p], self.lora_B[p]))
            if not self.shared(p, side)
        ]

    def shared_parameters(self) -> dict[tuple[str, str], nn.Parameter]:
        """(projection, side) -> the factor the layer's experts share (empty for per_expert)."""
        return {
            (p, side): getattr(self, f"lora_{side}")[p]
            for p in EXPERT_PROJECTIONS
            for side in "AB"
            if self.shared(p, side)
        }

    @property
    def num_experts(self) -> int:
        return self.base.num_experts

    def factors(self) -> list[torch.Tensor]:
        """[A_gate, B_gate, A_up, B_up, A_down, B_down], each [E, ...] (E: the experts held): a shared factor
        expanded over the experts (a view)."""
        n = self.num_experts
        return [t.expand(n, *t.shape[1:]) for t in self.adapter_parameters()]

    @property
    def first_expert(self) -> int:
        return self.base.first_expert

    def uses_grouped_mm(self, x: torch.Tensor, dropout: float) -> bool:
        """grouped_mm when asked, or under `auto` on a GPU in bfloat16 (what torch's CUDA grouped_mm takes)
        when the rank, hidden and moe_intermediate strides are 16-byte aligned and there is no dropout;
        otherwise the per-expert loop. Asked for with sizes it cannot run: ValueError naming them."""
        hidden, inter = expert_shapes(self.base)["down"]
        aligned = grouped_mm_supported(x.dtype, self.rank, hidden, inter)
        if self.kernel == "auto":
            return x.is_cuda and x.dtype == torch.bfloat16 and dropout == 0 and aligned
        if self.kernel == "grouped_mm" and not aligned:
            raise ValueError(
                f"the grouped_mm expert kernel needs rank {self.rank}, hidden {hidden} and moe_intermediate "
                f"{inter} to be multiples of 16 bytes in {x.dtype}; use kernel loop"
            )
        return self.kernel == "grouped_mm"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.base.fixed_shapes and not torch.is_grad_enabled():  # a decode step for CUDA graphs
            factors = self.factors() if self.enabled else None
            return fixed_shape_call(self.base, hidden_states, top_k_index, top_k_weights, factors, self.scale)
        dispatch = self.base.dispatch  # expert parallelism: tokens go to their experts' ranks and come back
        if dispatch is not None:
            return dispatch(hidden_states, top_k_index, top_k_weights, self.local_forward)
        return self.local_forward(hidden_states, top_k_index, top_k_weights)

    def local_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts held here on tokens routed to them (top_k_index: local expert ids)."""
        if not self.enabled:
            return self.base.local_forward(hidden_states, top_k_index, top_k_weights)
        with torch.no_grad():
            order, counts = group_tokens_by_expert(top_k_index, self.num_experts)
        p = self.dropout if self.training else 0.0
        # One draw from the global generator: reproducible under manual_seed and under activation
        # checkpointing, which replays the global RNG state on recompute.
        seed = int(torch.randint(0, 2**62, (1,)).item()) if p > 0 else 0
        call = ExpertsCall(self.base.weights, Routing(order, counts, top_k_index.shape[-1]), self.scale, p, seed)
        factors = self.factors()
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, top_k_weights, *factors))
        if self.uses_grouped_mm(hidden_states, p):
            if needs_grad:
                return GroupedGemmLoRAExperts.apply(hidden_states, top_k_weights, *factors, call)
            return gmm_forward(hidden_states, top_k_weights, factors, call, keep_saved=False)[0]
        if needs_grad:
            return GroupedLoRAExperts.apply(hidden_states, top_k_weights, *factors, call)
        return grouped_forward(hidden_states, top_k_weights, factor_map(factors), call, keep_saved=False)[0]

    def extra_repr(self) -> str:
        return (
            f"{self.num_experts} experts, rank={self.rank}, scale={self.scale:g}, dropout={self.dropout:g}, "
            f"kernel={self.kernel}, layout={self.layout}"
        )
