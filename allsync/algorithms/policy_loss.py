"""Policy losses behind one signature (`PolicyLoss`), registered by name in POLICY_LOSSES (algorithm.policy_loss)
as a `PolicyLossEntry`: the function, the statistics it logs and the settings it needs.

    clipped   PPO's clipped surrogate with DAPO's clip-higher and the dual clip (clipped_policy_loss)
    nlft      NLFT's weighted likelihood / unlikelihood (allsync.algorithms.nlft; recipes/nlft.py only)

To add one (one module and its test): a function with PolicyLoss's signature returning (loss, {statistic: token
mean}), registered with `POLICY_LOSSES["name"] = PolicyLossEntry(function, logged=(...), aggregations=(...),
reads=(...))` in a module of your own that the run's `run.imports` names (tests/fixtures/sequence_loss.py); a name
already registered is refused (selection.Registry). The trainer calls it for every micro-batch, the config checks ask
its entry (the aggregations it takes, the clip settings it reads: one it ignores is refused when set) and the run's
metrics log each of its `logged` statistics under its own name (the token mean over every worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .aggregation import Number, aggregate_loss
from .selection import Registry

LOG_RATIO_CLAMP = 20.0
CLIP_SETTINGS = ("clip_low", "clip_high", "clip_c")  # what PolicyLossEntry.reads may name (algorithm.<key>)


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the True entries of ``valid`` (0 when there are none)."""
    total = values.masked_fill(~valid, 0.0).sum()
    return (total / valid.sum().clamp_min(1)).detach()


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
    agg: str = "token-mean",
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    *,
    norm_length: int | None = None,
    episode_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss (PPO/DAPO) aggregated over tokens.

    Per token, with r = exp(clamp(logprobs - old_logprobs, -20, 20))::

        pg = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))   # decoupled clip
        pg = min(pg, -A * clip_c)            if clip_c is set and A < 0  # dual clip
        loss = aggregate_loss(pg, mask, agg, global_tokens, global_seqs)

    The loss is the negated objective: r = 1.5, A = +1 gives pg = -1.28; with
    clip_c = 3, r = 10, A = -1 gives pg = 3. Clipped tokens have zero gradient.

    Args:
        logprobs, old_logprobs, mask: [B, T]. ``old_logprobs`` is treated as a constant.
        advantages: [B, T], or [B] broadcast over tokens.
        clip_c: dual-clip constant, > 1, or None for no dual clip.
        agg: a name of ``LOSS_AGGREGATIONS`` (token-mean, seq-mean-token-sum,
            seq-mean-token-mean, seq-mean-token-sum-norm).
        global_tokens, global_seqs: whole-batch token / sequence counts for
            micro-batching (see :mod:`allsync.algorithms.aggregation`).
        norm_length: T_max of seq-mean-token-sum-norm (default ``mask.shape[-1]``).
        episode_tokens: [B] tokens of each row's episode, for episode-mean-token-mean.
    Returns:
        (scalar loss, statistics): 0-dim detached means over the unmasked tokens of
        clipfrac_high (A > 0 and r > 1 + clip_high: the upper clip active), clipfrac_low (A < 0 and
        r < 1 - clip_low), clipfrac_dual (A < 0 and the dual bound -c A active), approx_kl (k1:
        mean(old_logprobs - logprobs)) and approx_kl_k3 (mean(r - 1 - log r)).
    """
    if not (logprobs.shape == old_logprobs.shape == mask.shape) or logprobs.dim() != 2:
        raise ValueError(
            "logprobs, old_logprobs and mask must all be [B, T]; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 (or None), got {clip_c}")
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.detach().to(logprobs.dtype).expand_as(logprobs)

    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    negative = advantages < 0
    if clip_c is not None:
        dual_bound = -advantages * clip_c
        dual_active = negative & (pg > dual_bound)
        pg = torch.where(dual_active, dual_bound, pg)
    else:
        dual_active = torch.zeros_like(negative)

    loss = aggregate_loss(pg, mask, agg, global_tokens, global_seqs, norm_length, episode_tokens)

    with torch.no_grad():
        valid = mask != 0
        stats = {
            "clipfrac_high": _masked_mean(((advantages > 0) & (ratio > 1.0 + clip_high)).to(ratio.dtype), valid),
            "clipfrac_low": _masked_mean((negative & (ratio < 1.0 - clip_low)).to(ratio.dtype), valid),
            "clipfrac_dual": _masked_mean(dual_active.to(ratio.dtype), valid),
            "approx_kl": _masked_mean(-log_ratio, valid),
            "approx_kl_k3": _masked_mean(ratio - 1.0 - log_ratio, valid),
        }
    return loss, stats


class PolicyLoss(Protocol):
    """What the trainer calls for each micro-batch: [B, T] token logprobs of the policy being trained (with
    gradient) and of the sampling policy, per-token advantages and the response mask; the clip settings; the
    aggregation (allsync.algorithms.aggregation) with the global normalizers. Returns the loss, scaled as this
    micro-batch's share of the batch, and its statistics: {name: 0-dim detached mean over the unmasked tokens}."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip_low: float,
        clip_high: float,
        clip_c: float | None,
        agg: str,
        global_tokens: Number | None,
        global_seqs: Number | None,
        *,
        norm_length: int | None,
        episode_tokens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class PolicyLossEntry:
    """A registered policy loss and what it asks of the rest of the loop, so that the config checks, the trainer
    and the metrics ask the entry instead of naming the loss. Calling it calls `compute`.

    logged: the statistics of `compute`'s dict that become run metrics under their own names, each the token mean
        over every worker's trained tokens (the trainer sums mean x tokens per micro-batch; allsync.metrics divides).
    aggregations: the algorithm.loss_agg values the loss is defined for (None: every one); another is refused at
        config load naming both keys.
    rollout_refusal: why the loss cannot train on a rollout's advantages (None: it can); a config naming it is
        refused with this text.
    reads: the clip settings (CLIP_SETTINGS, keys of algorithm:) the loss reads. Each is checked against its range
        (clip_low in (0, 1), clip_high > 0, clip_c > 1 or null); one it does not read is refused when set to other
        than its default, naming the loss (CISPO, with no lower clip, reads ("clip_high",)).
    """

    compute: PolicyLoss
    logged: tuple[str, ...]
    aggregations: tuple[str, ...] | None = None
    rollout_refusal: str | None = None
    reads: tuple[str, ...] = ("clip_low", "clip_high", "clip_c")

    def __post_init__(self):
        if unknown := set(self.reads) - set(CLIP_SETTINGS):
            raise ValueError(
                f"PolicyLossEntry.reads: {sorted(unknown)} are not clip settings ({', '.join(CLIP_SETTINGS)})"
            )

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.compute(*args, **kwargs)


POLICY_LOSSES: dict[str, PolicyLossEntry] = Registry(
    "policy_loss",
    {"clipped": PolicyLossEntry(clipped_policy_loss, logged=("clipfrac_high", "clipfrac_low", "approx_kl"))},
)
