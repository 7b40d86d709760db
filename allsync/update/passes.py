"""The trainer's forward passes besides the update's own (loss.minibatch_loss): the current policy's logprobs, the
critic's values and the reference policy's logprobs of a batch, computed in row groups of at most
optim.max_tokens_per_forward padded tokens and, under expert parallelism, in lockstep with the other ranks (a rank
with fewer groups runs idle rows, whose MoE layers serve the others' tokens), with the step's routing replay
switched as each pass needs. The learner builds its batches with them."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from allsync.update.forward import forward_logprobs
from allsync.update.sequences import SequenceBatch, build_sequences, token_budget_chunks
from allsync.update.train_batch import TrainBatch
from moe_lora.lora import adapters_disabled


class ForwardPasses:
    def __init__(self, model, config, groups, pad_id: int, device: torch.device):
        """groups: allsync.distributed.process_groups.Groups."""
        self.model, self.config, self.groups = model, config, groups
        self.pad_id, self.device = pad_id, device

    def idle_batch(self) -> TrainBatch:
        """One row whose tokens are all masked out: a rank with nothing to train runs it so that its MoE
        layers take part in the other ranks' forward and backward (expert parallelism). Adds nothing."""
        seqs = build_sequences([[self.pad_id]], [[self.pad_id]], self.pad_id).to(self.device)
        seqs.response_mask.zero_()
        zeros = torch.zeros_like(seqs.response_mask)
        kl = zeros if self.config.algorithm.kl_coef else None
        critic = (zeros, zeros) if self.config.algorithm.uses_critic else (None, None)
        return TrainBatch(seqs, zeros, zeros, *critic, ref_logprobs=kl, engine_logprobs=zeros)

    def forward_chunks(self, batch: SequenceBatch) -> list[list[int]]:
        """Row groups of at most optim.max_tokens_per_forward padded tokens (one group of all rows without it)."""
        return token_budget_chunks(batch.attention_mask.sum(-1).tolist(), self.config.optim.max_tokens_per_forward)

    def lockstep_count(self, count: int) -> int:
        """How many forwards this rank runs for its `count` row groups. Under expert parallelism every rank runs
        as many as the rank with the most (a rank with fewer runs idle rows: the others' MoE layers need it),
        which is 1 without a token budget; otherwise `count`."""
        if not self.groups.expert_parallel:
            return count
        return 1 if self.config.optim.max_tokens_per_forward is None else self.groups.max_over_ranks(count)

    def chunked(self, batch: SequenceBatch, compute) -> torch.Tensor:
        """compute(rows) -> [rows, width - 1] (the policy's token logprobs, the critic's values) over the batch's
        row groups (`forward_chunks`), put back together at the batch's width."""
        if self.config.optim.max_tokens_per_forward is None:
            return compute(batch)
        chunks, width = self.forward_chunks(batch), batch.input_ids.shape[1] - 1
        forwards = self.lockstep_count(len(chunks))  # agreed before any forward: the MoE layers' all-to-alls pair up
        parts = []
        for rows in chunks:
            part = batch.select(rows)
            parts.append(compute(part.trimmed(part.width)))
        for _ in range(forwards - len(chunks)):
            compute(self.idle_batch().sequences)
        if not parts:
            return batch.response_mask.new_zeros(0, width)
        return placed_rows(parts, chunks, parts[0].new_zeros(len(batch), width))  # the groups: longest rows first

    def policy_logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        return self.chunked(batch, lambda rows: forward_logprobs(self.model, rows, self.config.rollout.temperature))

    @torch.no_grad()
    def current_logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """The current policy's logprobs of the batch, before any update: the step's first policy pass, after which
        routing_mismatch stops counting (`stop_counting_routes`)."""
        logprobs = self.policy_logprobs(batch)
        self.stop_counting_routes()
        return logprobs

    @torch.no_grad()
    def current_values(self, batch: SequenceBatch, critic) -> torch.Tensor:
        """The critic's (allsync.update.critic.Critic) values of the batch, before any update."""
        return self.chunked(batch, critic)

    @torch.no_grad()
    def reference_logprobs(self, batch: SequenceBatch) -> torch.Tensor | None:
        """The reference policy's logprobs for the KL penalty: the frozen base with every adapter switched off,
        the same forward pass and temperature as the policy's. None when algorithm.kl_coef is 0."""
        if not self.config.algorithm.kl_coef:
            return None
        with adapters_disabled(self.model), self.routing_switched(live=True, counting=False):
            return self.policy_logprobs(batch)

    @contextmanager
    def routing_switched(self, **settings):
        """Inside, the step's routing replay (moe_lora.routing.RoutingReplay, when `train` attached one) has these
        `live` / `counting` settings."""
        routing = getattr(self.model, "routing_replay", None)
        before = {key: getattr(routing, key) for key in settings} if routing is not None else {}
        for key in before:
            setattr(routing, key, settings[key])
        try:
            yield
        finally:
            for key, value in before.items():
                setattr(routing, key, value)

    def stop_counting_routes(self) -> None:
        """After the step's first policy pass (the sampling policy, before any optimizer step): routing_mismatch
        compares the engine's experts with that pass's only, not with later minibatches' or the reference's."""
        if (routing := getattr(self.model, "routing_replay", None)) is not None:
            routing.counting = False


def placed_rows(parts: list[torch.Tensor], row_groups: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """Row groups' [rows, width_i] tensors (each cut to its own longest row) put back at their rows of a zero
    tensor shaped like `like` [B, W]."""
    full = torch.zeros_like(like)
    for part, rows in zip(parts, row_groups):
        full[torch.tensor(rows, device=full.device), : part.shape[1]] = part
    return full
