"""Reduce a [B, T] per-token loss to a scalar, shared by policy and value losses.

Modes (m = mask, L = per-token loss, S = number of sequences with at least one
unmasked token, N = number of unmasked tokens, T_max = ``norm_length`` or
``mask.shape[-1]``)::

    token-mean               sum_{b,t} m L / N
    seq-mean-token-sum       sum_b ( sum_t m L ) / S
    seq-mean-token-mean      sum_b ( sum_t m L / n_e(b) ) / S
    seq-mean-token-sum-norm  sum_{b,t} m L / (S * T_max)          (Dr.GRPO)
    episode-mean-token-mean  the same as seq-mean-token-mean (multi-conversation's name for it)

A sequence is an episode. Episodes (multi-conversation DAPO, agents that start a new context) span
several rows (segments): n_e(b) is the number of unmasked tokens of row b's whole episode
(``episode_tokens``, see :func:`allsync.algorithms.segment_credit.episode_token_counts`) and S the number of
episodes with at least one unmasked token (pass it as ``global_seqs``): the token mean inside each
episode, then the mean over episodes. Without ``episode_tokens`` each row is its own episode
(n_e(b) = sum_t m[b, t]).

Micro-batching: pass ``global_tokens`` (N of the whole batch) and
``global_seqs`` (S of the whole batch, see :func:`loss_normalizers`); each
micro-batch loss is then its exact share of the full-batch loss, so gradients
SUMMED over micro-batches (and ranks) equal the full-batch gradient. Under DDP,
which averages gradients over ranks, multiply the loss by the world size.
For seq-mean-token-sum-norm give all micro-batches the same ``norm_length``
(e.g. the generation budget) when they are padded to different lengths.

A zero denominator (an all-padding micro-batch) is replaced by 1, so its loss is 0.
"""

from __future__ import annotations

import torch

from .selection import Registry

from .selection import select

Number = int | float | torch.Tensor


def loss_normalizers(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, S)`` of a [B, T] mask as 0-dim tensors (all-reduce them across ranks if needed).

    N = sum of the mask, S = number of rows with at least one unmasked token.
    """
    return mask.sum(), (mask != 0).any(dim=-1).sum()


def _masked(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``loss * mask`` that also turns NaN/inf on padding into 0."""
    mask = mask.to(loss_mat.dtype)
    return loss_mat.masked_fill(mask == 0, 0.0) * mask


def _safe(denominator: Number) -> Number:
    if isinstance(denominator, torch.Tensor):
        return torch.where(denominator == 0, torch.ones_like(denominator), denominator)
    return denominator if denominator != 0 else 1


def _num_seqs(mask: torch.Tensor, global_seqs: Number | None) -> Number:
    return _safe(loss_normalizers(mask)[1] if global_seqs is None else global_seqs)


def token_mean(loss_mat, mask, global_tokens=None, global_seqs=None, norm_length=None, episode_tokens=None):
    """``sum_{b,t} m L / N`` (N = ``global_tokens`` if given)."""
    tokens = mask.sum() if global_tokens is None else global_tokens
    return _masked(loss_mat, mask).sum() / _safe(tokens)


def seq_mean_token_sum(loss_mat, mask, global_tokens=None, global_seqs=None, norm_length=None, episode_tokens=None):
    """``sum_b (sum_t m L) / S`` (S = ``global_seqs`` if given)."""
    return _masked(loss_mat, mask).sum() / _num_seqs(mask, global_seqs)


def seq_mean_token_mean(loss_mat, mask, global_tokens=None, global_seqs=None, norm_length=None, episode_tokens=None):
    """``sum_b (sum_t m L / n_e(b)) / S``: n_e(b) = ``episode_tokens[b]`` (the row's own tokens if None),
    S = ``global_seqs`` (the episodes with a token; without it, the rows with a token)."""
    per_row_tokens = (
        mask.to(loss_mat.dtype).sum(dim=-1) if episode_tokens is None else episode_tokens.to(loss_mat.dtype)
    )
    per_row = _masked(loss_mat, mask).sum(dim=-1) / _safe(per_row_tokens)
    return per_row.sum() / _num_seqs(mask, global_seqs)


def seq_mean_token_sum_norm(
    loss_mat, mask, global_tokens=None, global_seqs=None, norm_length=None, episode_tokens=None
):
    """``sum_{b,t} m L / (S * T_max)``, T_max = ``norm_length`` or ``mask.shape[-1]`` (Dr.GRPO)."""
    t_max = mask.shape[-1] if norm_length is None else norm_length
    return _masked(loss_mat, mask).sum() / (_num_seqs(mask, global_seqs) * _safe(t_max))


LOSS_AGGREGATIONS = Registry(
    "loss_aggregation",
    {
        "token-mean": token_mean,
        "seq-mean-token-sum": seq_mean_token_sum,
        "seq-mean-token-mean": seq_mean_token_mean,
        "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
        "episode-mean-token-mean": seq_mean_token_mean,
    },
)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    norm_length: int | None = None,
    episode_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce the [B, T] ``loss_mat`` with the mode named ``agg`` (see module docstring)."""
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ in shape")
    reduce = select(LOSS_AGGREGATIONS, "loss aggregation", agg)
    return reduce(loss_mat, mask, global_tokens, global_seqs, norm_length, episode_tokens)
