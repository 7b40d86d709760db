"""Truncated importance sampling (TIS): the policy loss reweighted for a sampler that is not the trainer.

The rollout engine samples from pi_engine (its kernels, its frozen formats, its experts' routing), the trainer's
old logprobs are pi_old's. Each trained token's policy loss is multiplied by a detached weight

    token level      w_t = min(pi_old(y_t) / pi_engine(y_t), cap) = min(exp(old_t - engine_t), cap)
    sequence level   w   = min(prod_t pi_old(y_t) / pi_engine(y_t), cap) over the row's trained tokens

(1 where engine = trainer). For the clipped surrogate with A scaled by w > 0 this is the same as scaling each
token's loss by w, which is how the trainer applies it (allsync.update.loss.minibatch_loss).
"""

from __future__ import annotations

import torch

TIS_LEVELS = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0  # exp of at most 20: a weight past the cap is the cap anyway


def tis_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, level: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, T], capped [B, T]): the detached TIS weight of every position (1 off the mask) and whether the
    cap cut it (0 off the mask). Formulas in the module docstring."""
    if level not in TIS_LEVELS:
        raise ValueError(f"TIS level {level!r}: use one of {TIS_LEVELS}")
    log_ratio = ((old_logprobs - engine_logprobs) * mask).detach().float()
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    ratio = log_ratio.clamp(max=LOG_RATIO_CLAMP).exp()
    capped = (ratio > cap).float() * mask
    weights = torch.where(mask > 0, ratio.clamp(max=cap), torch.ones_like(ratio))
    return weights, capped
