"""What a worker holds: the checkpoint bytes it read at load and the resident bytes of its routed experts."""

from __future__ import annotations

import torch

from moe_lora.lora import LoRAExperts
from quant.modules import FrozenExperts


def loaded_bytes(model, layout, rank: int) -> dict:
    """Checkpoint bytes this rank read at load (all, routed experts' share) and the experts it holds."""
    held = layout.experts_of(rank) if layout is not None else range(model.config.n_routed_experts)
    return {
        "bytes": model.checkpoint_bytes_read,
        "expert_bytes": model.checkpoint_expert_bytes_read,
        "experts": [held.start, held.stop],
    }


def expert_memory(model, optimizer: torch.optim.Optimizer) -> dict:
    """Resident bytes of this rank's routed experts: frozen weights, their LoRA tensors, and AdamW's state for those
    tensors (allocated with the policy's state: allsync.update.optimizer.allocate_adamw_state)."""
    frozen = sum(
        w.nbytes for m in model.modules() if isinstance(m, FrozenExperts) for ws in m.weights.values() for w in ws
    )
    adapters = [p for m in model.modules() if isinstance(m, LoRAExperts) for p in m.adapter_parameters()]
    state = [
        t for p in adapters for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"frozen": frozen, "adapters": nbytes(adapters), "optimizer": nbytes(state)}
