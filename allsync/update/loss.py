"""The policy's loss of one micro-batch: its forward (allsync.update.forward), the PolicyLossEntry the config names,
the KL penalty to the reference and truncated importance weights, scaled as the micro-batch's share of the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from allsync.algorithms import aggregate_loss, get, kl_penalty, tis_weights
from allsync.update.forward import forward_pass
from allsync.update.sequences import SequenceBatch


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    agg: str = "token-mean"
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    policy_loss: str = "clipped"  # a name in allsync.algorithms.POLICY_LOSSES
    tis_level: str | None = None  # algorithm.tis.level; None: no importance weights
    tis_cap: float = 2.0


@dataclass
class LossStats:
    """Token sums of one micro-batch (divide by the global token count for means)."""

    policy: dict[str, float]  # the policy loss's logged statistics (PolicyLossEntry.logged), mean x tokens
    entropy: float  # policy entropy at the rollout temperature
    kl_ref: float  # KL to the reference policy (the kl_estimator's value); 0 without reference logprobs
    logprobs: torch.Tensor | None = None  # [B, L-1] the forward's token logprobs, detached
    tis: float = 0.0  # TIS weights summed over the trained tokens (algorithm.tis)
    tis_capped: float = 0.0  # trained tokens whose TIS weight the cap cut


def minibatch_loss(
    model,
    batch: SequenceBatch,
    old_logprobs,
    advantages,
    settings: LossSettings,
    global_tokens,
    global_seqs,
    norm_length: int | None = None,
    ref_logprobs=None,
    episode_tokens: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
):
    """Policy loss of one micro-batch (the PolicyLossEntry settings.policy_loss names), scaled as its share of the
    global batch (episode_tokens: each row's episode's trained tokens, for episode-mean-token-mean), plus
    kl_coef * KL(policy || reference) aggregated the same way when reference logprobs are given
    (reference = the frozen base with the adapters off). Returns (loss, LossStats of token sums).

    old_logprobs None: the policy being trained is the one that sampled (one on-policy minibatch, before any
    optimizer step), so the old logprobs are this forward's own, detached: r = exp(logprobs - sg(logprobs)) = 1,
    and the separate no-gradient pass that would compute the same numbers is skipped.

    settings.tis_level set: each token's policy loss is weighted by its truncated importance weight against the
    engine's logprobs (allsync.algorithms.tis_weights; the advantages scaled by it, the same for the clipped
    surrogate)."""
    out = forward_pass(model, batch, settings.temperature, with_entropy=True)
    mask = batch.response_mask
    old_logprobs = out.logprobs.detach() if old_logprobs is None else old_logprobs
    tis = capped = None
    if settings.tis_level is not None:
        tis, capped = tis_weights(old_logprobs, engine_logprobs, mask, settings.tis_level, settings.tis_cap)
        advantages = advantages * tis
    policy_loss = get("policy_loss", settings.policy_loss)
    loss, stats = policy_loss(
        out.logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        clip_c=settings.clip_c,
        agg=settings.agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
        episode_tokens=episode_tokens,
    )
    kl_ref = 0.0
    if ref_logprobs is not None:
        kl = kl_penalty(out.logprobs, ref_logprobs, settings.kl_estimator)
        loss = loss + settings.kl_coef * aggregate_loss(
            kl, mask, settings.agg, global_tokens, global_seqs, norm_length, episode_tokens
        )
        kl_ref = float((kl.detach() * mask).sum())
    tokens = float(mask.sum())
    sums = LossStats(
        {name: float(stats[name]) * tokens for name in policy_loss.logged},
        float((out.entropy * mask).sum()),
        kl_ref,
        out.logprobs.detach(),
        float((tis * mask).sum()) if tis is not None else 0.0,
        float(capped.sum()) if capped is not None else 0.0,
    )
    return loss, sums


def loss_settings(config) -> LossSettings:
    """The policy loss's settings; the producer says the aggregation (ProducerDefaults.loss_aggregation)."""
    a = config.algorithm
    agg = config.producer.loss_aggregation(a.loss_agg)
    tis = {"tis_level": a.tis.level, "tis_cap": a.tis.cap} if a.tis is not None else {}
    return LossSettings(
        a.clip_low,
        a.clip_high,
        a.clip_c,
        agg,
        config.rollout.temperature,
        a.kl_coef,
        a.kl_estimator,
        a.policy_loss,
        **tis,
    )
