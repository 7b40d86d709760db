"""Episodes spread over several rows: one row per segment (a memory write, a tool turn, the answer).

An episode's advantage is one number (GRPO / Dr.GRPO over the group's episode rewards) copied to every
trained token of every one of its segments: A[b, t] = A_episode(e(b)). Which tokens train is the
segment's loss mask (0 on observation tokens) times the credit rule:

    credit all    every segment's response tokens
    credit final  only the answer segment's (the ablation: memory writes get no gradient)

Weighting (see allsync.algorithms.aggregation): token = token-mean over all trained tokens of the
batch; episode = episode-mean-token-mean, whose per-row denominator n_e(b) comes from
`episode_token_counts` and whose E from `episodes_with_tokens`, both over whole episodes, so that
micro-batches and workers holding whole episodes sum to the full batch's gradient.
"""

from __future__ import annotations

import torch

CREDIT_RULES = ("all", "final")


def episode_token_counts(mask: torch.Tensor, episode_of_row: torch.Tensor) -> torch.Tensor:
    """[B] n_e(b) = sum over rows r of b's episode of sum_t mask[r, t] (mask [B, T], episode ids [B] >= 0)."""
    per_row = mask.to(torch.float64).sum(-1)
    per_episode = torch.zeros(
        int(episode_of_row.max()) + 1 if len(episode_of_row) else 0, dtype=torch.float64, device=mask.device
    ).index_add_(0, episode_of_row, per_row)
    return per_episode[episode_of_row].to(mask.dtype)


def episodes_with_tokens(mask: torch.Tensor, episode_of_row: torch.Tensor) -> torch.Tensor:
    """0-dim count of the episodes that have at least one unmasked token."""
    if not len(episode_of_row):
        return torch.zeros((), dtype=torch.long, device=mask.device)
    return torch.unique(episode_of_row[(mask != 0).any(-1)]).numel() * torch.ones(
        (), dtype=torch.long, device=mask.device
    )


def credit_mask(mask: torch.Tensor, is_answer: torch.Tensor, credit: str) -> torch.Tensor:
    """mask with every non-answer row zeroed for credit "final"; unchanged for "all" (is_answer [B] bool)."""
    if credit not in CREDIT_RULES:
        raise ValueError(f"credit {credit!r}: use one of {CREDIT_RULES}")
    return mask if credit == "all" else mask * is_answer[:, None].to(mask.dtype)
