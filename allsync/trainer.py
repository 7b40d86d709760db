"""Trainer-side pieces of one RL step: sequences from a rollout, token logprobs, the policy update.

Sequences are prompt + response, right-padded. Position t of `response_mask` marks that token t+1 is a
response token, so `forward_logprobs(...)[0][:, t]` = log p(token_{t+1} | tokens_{<=t}) lines up with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch import nn

from allsync.algorithms import aggregate_loss, kl_penalty, policy_loss, value_loss


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # [B, L] right-padded prompt + response
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float, 1 where the predicted token is a response token

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> "SequenceBatch":
        return SequenceBatch(self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows])


def build_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> SequenceBatch:
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(lengths), width), dtype=torch.long)
    response = torch.zeros((len(lengths), width - 1))
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention[i, : len(p) + len(r)] = 1
        response[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return SequenceBatch(ids, attention, response)


class ValueHead(nn.Module):
    """PPO's critic: V(s_t) = w . h_t + b on the policy's final hidden state h_t, detached, so the value
    loss trains this head only and never moves the policy's LoRA tensors. Starts at V = 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.detach().float()).squeeze(-1)


def forward_logprobs(model, batch: SequenceBatch, temperature: float = 1.0, value_head: ValueHead | None = None):
    """One forward pass -> (logprobs, values), both [B, L-1]:
    logprobs[:, t] = log softmax(logits_t / T)[token_{t+1}], values[:, t] = V(tokens_{<=t}) (None without a head)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                output_hidden_states=value_head is not None)  # fmt: skip
    logp = torch.log_softmax(out.logits[:, :-1].float() / temperature, dim=-1)
    logprobs = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    values = value_head(out.hidden_states[-1][:, :-1]) if value_head is not None else None
    return logprobs, values


def response_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's response tokens sit in a [B, L-1] mask (contiguous per row): index [B, T] (padded
    with 0) and valid [B, T], T = the longest response. Moves sequence-aligned values to response-aligned
    ones, where token 0 of every response is column 0 (the layout gae/egae expect)."""
    lengths = mask.sum(-1).long()
    width = int(lengths.max()) if len(lengths) else 0
    starts = mask.float().argmax(-1)
    offsets = torch.arange(width)[None, :]
    valid = offsets < lengths[:, None]
    index = torch.where(valid, starts[:, None] + offsets, torch.zeros_like(offsets))
    return index, valid


def to_response_layout(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return x.gather(1, index) * valid


def to_sequence_layout(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    return out.scatter_add_(1, index, x * valid)


def scatter_response_values(values: list[list[float]], batch: SequenceBatch) -> torch.Tensor:
    """Per-response-token lists (e.g. engine logprobs) placed at their [B, L-1] positions."""
    out = torch.zeros_like(batch.response_mask)
    for i, v in enumerate(values):
        positions = batch.response_mask[i].nonzero().squeeze(-1)
        out[i, positions] = torch.tensor(v[: len(positions)], dtype=out.dtype)
    return out


def logprob_gap(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |engine - trainer| logprob over response tokens (nats); NaN anywhere makes it NaN."""
    diff = (engine_logprobs - trainer_logprobs).abs() * mask
    return float(diff.sum() / mask.sum().clamp_min(1))


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    agg: str = "token-mean"
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"


@dataclass
class ValueTargets:
    """What the critic learns from in a micro-batch: EGAE returns on the tokens of finished responses."""

    returns: torch.Tensor  # [B, L-1]
    mask: torch.Tensor  # [B, L-1], 1 on response tokens of finished responses only (T-PPO)
    global_tokens: torch.Tensor | float  # such tokens in the whole batch, over every rank
    coef: float  # algorithm.value_coef


def minibatch_loss(model, batch: SequenceBatch, old_logprobs, advantages, settings: LossSettings,
                   global_tokens, global_seqs, norm_length: int | None = None, ref_logprobs=None,
                   value_head: ValueHead | None = None, value_targets: ValueTargets | None = None):  # fmt: skip
    """Policy loss of one micro-batch, scaled as its share of the global batch (see policy_loss), plus
    value_targets.coef * the critic's value loss when a value head is given."""
    logprobs, values = forward_logprobs(model, batch, settings.temperature, value_head)
    loss, stats = policy_loss(
        logprobs, old_logprobs, advantages, batch.response_mask, clip_low=settings.clip_low,
        clip_high=settings.clip_high, clip_c=settings.clip_c, agg=settings.agg, global_tokens=global_tokens,
        global_seqs=global_seqs, norm_length=norm_length,
    )  # fmt: skip
    if settings.kl_coef and ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, settings.kl_estimator)
        loss = loss + settings.kl_coef * aggregate_loss(kl, batch.response_mask, settings.agg, global_tokens, global_seqs)
    if value_head is not None:
        v = value_targets
        finished = v.mask.sum(-1) > 0
        vloss, _ = value_loss(values, v.returns, v.mask, finished, agg="token-mean", global_tokens=max(float(v.global_tokens), 1.0))
        loss = loss + v.coef * vloss
    return loss, stats
