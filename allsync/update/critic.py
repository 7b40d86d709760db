"""PPO / T-PPO's value model (algorithm.advantage gae | egae), trained apart from the policy.

    V(s_t) = w . h_t + b,   h_t = final hidden state at position t of the frozen base under the critic's own LoRA

The critic is a second model over the policy's frozen weights (moe_lora.lora.adapter_copy): every quantized
projection, expert, embedding and norm is shared, nothing that trains is. Its adapter has the policy's rank and
targets except the routed experts: their adapter is the bulk of the bytes at 671B (it would double them) and is
sharded under expert parallelism, whereas the critic's is replicated like the rest. It starts as a fresh adapter
(B = 0: the base's features) with w = 0, b = 0 (V = 0).

The value loss moves only the critic's tensors and the policy loss only the policy's: T-PPO's independent
optimization of the two models, each its own AdamW param group, learning rate (optim.value_lr) and clip. Being
its own forward pass, the critic doubles the forwards of a step; the policy's features are never detached into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from allsync.algorithms import value_loss
from allsync.update.sequences import SequenceBatch
from moe_lora.lora import adapter_copy, seeded_init_


@dataclass
class ValueTargets:
    """What the critic learns from in a micro-batch: EGAE returns on the tokens of finished responses."""

    returns: torch.Tensor  # [B, L-1]
    mask: torch.Tensor  # [B, L-1], 1 on response tokens of finished responses only (T-PPO)
    global_tokens: torch.Tensor | float  # such tokens in the whole batch, over every rank


class Critic(nn.Module):
    """The value model (module docstring). `policy`: the policy with its LoRA attached (a transformers causal LM
    whose decoder is `policy.model`); `seed`: the critic's adapter draws (moe_lora.lora.seeded_init_)."""

    def __init__(self, policy: nn.Module, seed: int):
        super().__init__()
        self.model = adapter_copy(policy.model, routed_experts=False)  # `.model.layers`, as the policy's decoder
        seeded_init_(self.model, seed)  # its own keys (no "model." level): draws unlike the policy's at one seed
        device = policy.get_output_embeddings().weight.device
        self.head = nn.Linear(policy.config.hidden_size, 1, device=device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        """V at every position but the last, [B, L-1]: position t values tokens_{<=t}, aligned with the policy's
        token logprobs (allsync.update.forward.forward_pass)."""
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return self.head(out.last_hidden_state[:, :-1].float()).squeeze(-1)

    def trainable_tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of what the critic trains (its adapter and head): what a checkpoint holds of it."""
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def load_trainable(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Strict: every trainable tensor present with its shape, nothing else; checked before any copy."""
        own = self.trainable_tensors()
        for name, t in own.items():
            if name not in tensors:
                raise KeyError(
                    f"{source}: critic tensor {name!r} missing ({sum(k not in tensors for k in own)} missing)"
                )
            if tuple(tensors[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"{source}: critic tensor {name!r} is {list(tensors[name].shape)}, expected {list(t.shape)}"
                )
        extra = sorted(set(tensors) - set(own))
        if extra:
            raise KeyError(f"{source}: {extra[0]!r} is not a critic tensor ({len(extra)} such)")
        for name, t in own.items():
            t.copy_(tensors[name])


def critic_loss(critic: Critic, batch: SequenceBatch, targets: ValueTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 (V_t - R_t)^2 summed over the finished responses' tokens of this micro-batch / the whole batch's such
    tokens (allsync.algorithms.value_loss): this rank's share. Returns (loss, loss detached). No weight: the critic
    has its own AdamW group, learning rate (optim.value_lr) and clip, and AdamW's step does not change with a
    constant scale of its loss.

    Only the rows with a target go through the critic (`rows_with_targets`): the rows of a T-PPO window whose
    responses go on add nothing to the loss, so their forward and backward are skipped (the same loss and
    gradient). A micro-batch without any still runs one masked row, so that every rank runs the same forwards
    (expert parallelism's all-to-alls)."""
    rows = rows_with_targets(targets.mask)
    part = batch.select(rows)
    width = part.width
    part, mask = part.trimmed(width), targets.mask[rows, : width - 1]
    values = critic(part)
    loss, _ = value_loss(
        values,
        targets.returns[rows, : width - 1],
        mask,
        mask.sum(-1) > 0,
        agg="token-mean",
        global_tokens=max(float(targets.global_tokens), 1.0),
    )
    return loss, loss.detach()


def rows_with_targets(mask: torch.Tensor) -> torch.Tensor:
    """Indices of the rows of `mask` [B, L-1] with any target token; [0] (a row whose targets are all masked)
    when there is none."""
    rows = (mask.sum(-1) > 0).nonzero().squeeze(-1)
    return rows if len(rows) else torch.zeros(1, dtype=torch.long, device=mask.device)
