"""Critic loss for PPO / T-PPO, trained on finished responses only."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .aggregation import Number, aggregate_loss


@dataclass(frozen=True)
class ValueLossStats:
    """Diagnostics of one :func:`value_loss` call, 0-dim detached tensors."""

    clipfrac: torch.Tensor  # fraction of value tokens where the clipped term is the larger one
    num_tokens: torch.Tensor  # tokens that received a value gradient (finished responses only)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return asdict(self)


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    finished: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
    *,
    agg: str = "token-mean",
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Squared-error value loss over finished responses (T-PPO: truncated ones get no value gradient).

    With m_bt = mask_bt * finished_b::

        L_t = 0.5 * (V_t - R_t)^2
        L_t = 0.5 * max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -clip, clip) - R_t)^2)
              when ``old_values`` and ``clip`` are given
        loss = aggregate_loss(L, m, agg, global_tokens, global_seqs)

    ``global_tokens`` / ``global_seqs`` must count finished responses only.

    Args:
        values, returns, mask: [B, T]; ``returns`` (e.g. from :func:`egae`) is a constant.
        finished: [B] bool, True where the response ended (EOS or max length).
    Returns:
        (scalar loss, :class:`ValueLossStats`).
    """
    if not (values.shape == returns.shape == mask.shape) or values.dim() != 2:
        raise ValueError(
            "values, returns and mask must all be [B, T]; got "
            f"{tuple(values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    if finished.shape != values.shape[:1]:
        raise ValueError(f"finished must be [B]={values.shape[0]}, got {tuple(finished.shape)}")
    if (clip is None) != (old_values is None):
        raise ValueError("value clipping needs both old_values and clip (or neither)")
    returns = returns.detach().to(values.dtype)
    value_mask = mask.to(values.dtype) * finished.to(values.dtype)[:, None]

    squared_error = (values - returns) ** 2
    if clip is not None:
        old_values = old_values.detach().to(values.dtype)
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped_error = (clipped_values - returns) ** 2
        clip_active = clipped_error > squared_error
        squared_error = torch.maximum(squared_error, clipped_error)
    else:
        clip_active = torch.zeros_like(squared_error, dtype=torch.bool)

    loss = aggregate_loss(0.5 * squared_error, value_mask, agg, global_tokens, global_seqs)
    with torch.no_grad():
        valid = value_mask != 0
        num_tokens = valid.sum()
        clipfrac = (clip_active & valid).sum() / num_tokens.clamp_min(1)
    return loss, ValueLossStats(clipfrac=clipfrac.to(values.dtype), num_tokens=num_tokens)


def value_fit_sums(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sums over the masked tokens that add up over workers, float64 [5]:
    [n, sum R, sum R^2, sum (R - V), sum (R - V)^2] (for :func:`explained_variance`)."""
    m = mask.double()
    r, e = returns.double() * m, (returns.double() - values.double()) * m
    return torch.stack([m.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])


def explained_variance(sums) -> float | None:
    """The critic's explained variance from :func:`value_fit_sums` (summed over workers):

        EV = 1 - Var(R - V) / Var(R)

    1: the values predict every return; 0: no better than the mean return; < 0: worse. None when Var(R) = 0."""
    n, r, r2, e, e2 = (float(x) for x in sums)
    if n == 0:
        return None
    var_r = r2 / n - (r / n) ** 2
    return None if var_r <= 1e-12 else 1.0 - (e2 / n - (e / n) ** 2) / var_r
