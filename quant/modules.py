"""Frozen modules that replace transformers' nn.Linear and DeepseekV3Experts with quantized weights."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from quant.fixed_shape_experts import fixed_shape_experts
from quant.fused_experts import nf4_stackable, stack_nf4_experts
from quant.formats import QuantizedWeight, frozen_linear, keep_compute_copy

EXPERT_PROJECTIONS = ("gate", "up", "down")


class FrozenLinear(nn.Module):
    """y = x W^T with W a QuantizedWeight (no bias: DeepSeek-V3 has attention_bias false)."""

    def __init__(self, group: str, in_features: int, out_features: int):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        self.weight_q: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight_q)

    def extra_repr(self) -> str:
        fmt = self.weight_q.fmt if self.weight_q is not None else "unloaded"
        return f"{self.in_features} -> {self.out_features}, group={self.group}, format={fmt}"


def group_tokens_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Sort the T*k (token, slot) assignments by expert.

    Assignment a = t*k + j goes to expert top_k_index[t, j]. Returns `order` (assignments sorted by
    expert, stable) and `counts[e]`, so expert e's assignments are order[sum(counts[:e]) : sum(counts[:e+1])]
    and their tokens are order // k. An id of num_experts (the expert-parallel dispatch's padding) is no expert: it
    sorts last and no count holds it.
    """
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()[:num_experts]
    return order, counts


class FrozenExperts(nn.Module):
    """DeepSeek routed experts, each expert's gate/up/down a QuantizedWeight (per-expert, as on disk).

    y_t = sum_{j<k} w_tj * down_e( silu(gate_e(x_t)) * up_e(x_t) ),  e = top_k_index[t, j].
    Tokens are grouped by expert; only the routed experts' weights are dequantized, one expert at a time.
    Same call signature as transformers' DeepseekV3Experts.

    Under expert parallelism the module holds experts [first_expert, first_expert + num_experts) of the
    model, and `dispatch` (moe_lora.expert_parallel.ExpertDispatch) sends each routed token to the rank that
    owns its expert; `local_forward` then runs on the tokens this rank received (local expert ids).
    """

    group = "routed_experts"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, first_expert: int = 0):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.first_expert = first_expert
        self.dispatch = None  # None: every expert is here and top_k_index holds local ids
        self.fixed_shapes = False  # no-grad calls take quant.fixed_shape_experts (inside `fixed_shapes`)
        # quant.modules.stack_frozen_experts: each projection's NF4 experts as one tensor, which the fixed-shape
        # forward multiplies with quant.fused_experts.nf4_grouped_mm instead of dequantizing them (None: it does)
        self.stacked: dict | None = None
        self.weights: dict[str, list[QuantizedWeight | None]] = {p: [None] * num_experts for p in EXPERT_PROJECTIONS}

    def set_weight(self, expert: int, projection: str, weight: QuantizedWeight) -> None:
        self.weights[projection][expert] = weight

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        hidden = nn.functional.silu(frozen_linear(x, w["gate"][expert])) * frozen_linear(x, w["up"][expert])
        return frozen_linear(hidden, w["down"][expert])

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.fixed_shapes and not torch.is_grad_enabled():
            return fixed_shape_call(self, hidden_states, top_k_index, top_k_weights, None, 0.0)
        if self.dispatch is not None:
            return self.dispatch(hidden_states, top_k_index, top_k_weights, self.local_forward)
        return self.local_forward(hidden_states, top_k_index, top_k_weights)

    def local_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # One output buffer, accumulated in place (index_add_): autograd records each add and passes the
        # output gradient through unchanged, so backward to the input needs no copy of the buffer.
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        with torch.no_grad():
            order, counts = group_tokens_by_expert(top_k_index, self.num_experts)
        flat_weights = top_k_weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            assignments = order[start : start + count]
            start += count
            tokens = assignments // k
            y = self.expert_mlp(expert, hidden_states[tokens]) * flat_weights[assignments, None].to(hidden_states.dtype)
            out.index_add_(0, tokens, y)
        return out

    def extra_repr(self) -> str:
        fmts = {w.fmt for ws in self.weights.values() for w in ws if w is not None}
        shard = f" from expert {self.first_expert}" if self.first_expert or self.dispatch is not None else ""
        return f"{self.num_experts} experts{shard}, {self.hidden_size} -> {self.intermediate_size}, format={','.join(sorted(fmts))}"


def fixed_shape_call(
    base: FrozenExperts, hidden_states, top_k_index, top_k_weights, factors: list | None, scale: float
) -> torch.Tensor:
    """The routed experts of `base` (with LoRA factors, or None) in fixed shapes (quant.fixed_shape_experts); under
    expert parallelism through the dispatcher's fixed-shape exchange (every rank's tokens gathered, shares sent back)."""

    def share(x, index, weights, first=base.first_expert if base.dispatch is not None else 0):
        return fixed_shape_experts(x, index, weights, base.weights, factors, scale, first, base.stacked)

    if base.dispatch is not None:
        return base.dispatch.fixed_shape(hidden_states, top_k_index, top_k_weights, share)
    return share(hidden_states, top_k_index, top_k_weights)


@contextmanager
def fixed_shapes(model: nn.Module):
    """Inside, every no-grad call of the model's routed experts (FrozenExperts, and the LoRAExperts around them) takes
    quant.fixed_shape_experts, the forward a CUDA graph can capture; outside, the host-routed kernels again. Under
    expert parallelism every rank of an EP group must then call its MoE layers with the same number of tokens."""
    experts = [m for m in model.modules() if isinstance(m, FrozenExperts)]
    for m in experts:
        m.fixed_shapes = True
    try:
        yield model
    finally:
        for m in experts:
            m.fixed_shapes = False


def frozen_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Every frozen quantized weight of `model` (its FrozenLinear and FrozenExperts modules)."""
    out = []
    for m in model.modules():
        if isinstance(m, FrozenLinear) and m.weight_q is not None:
            out.append(m.weight_q)
        elif isinstance(m, FrozenExperts):
            out += [w for ws in m.weights.values() for w in ws if w is not None]
    return out


def compute_copy_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """What `keep_compute_copies` would add: every frozen weight once in `dtype` (a bf16 weight asked in bf16: 0)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(w.numel * size for w in frozen_weights(model) if not (w.fmt == "bf16" and dtype == torch.bfloat16))


def keep_compute_copies(model: nn.Module, dtype: torch.dtype) -> int:
    """Dequantize every frozen weight once and keep it (model.compute_copy): forward and backward then read the
    copy instead of dequantizing at every call, with the same values. Returns the bytes added."""
    return sum(keep_compute_copy(w, dtype) for w in frozen_weights(model))


def stack_frozen_experts(model: nn.Module) -> int:
    """Every FrozenExperts of `model` with its experts' NF4 stacked per projection (quant.fused_experts.
    stack_nf4_experts), so that its fixed-shape forward (quant.fixed_shape_experts) reads them with
    quant.fused_experts.nf4_grouped_mm; returns the modules stacked. Refuses (ValueError, naming the layer) experts
    the kernel cannot read (quant.fused_experts.nf4_stackable)."""
    stacked = 0
    for name, module in model.named_modules():
        if not isinstance(module, FrozenExperts) or module.stacked is not None:
            continue
        for projection, weights in module.weights.items():
            why = nf4_stackable(weights)
            if why is not None:
                raise ValueError(f"{name}.{projection}: {why}")
        module.stacked = {p: stack_nf4_experts(weights) for p, weights in module.weights.items()}
        stacked += 1
    return stacked
