"""KL-to-reference estimators and token entropy.

With the log-ratio d = log p - log p_ref (per token, sampled from p)::

    k1 = d                          unbiased, can be negative
    k2 = 0.5 * d^2                  biased, low variance
    k3 = exp(-d) - (-d) - 1         unbiased, always >= 0 (Schulman's estimator)

d is clamped to [-20, 20] before ``exp`` in k3.
"""

from __future__ import annotations

import torch

from .selection import Registry, select

LOG_RATIO_CLAMP = 20.0


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = log p - log p_ref`` per token."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 * (log p - log p_ref)^2`` per token."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(ref - logp) - (ref - logp) - 1`` per token, ``ref - logp`` clamped to [-20, 20]."""
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS = Registry("kl", {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3})


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(p || p_ref) estimate with the estimator named in ``KL_ESTIMATORS``.

    Aggregate it with :func:`aggregate_loss` and add ``beta *`` it to the loss.
    """
    return select(KL_ESTIMATORS, "KL estimator", estimator)(logprobs, ref_logprobs)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: ``logsumexp(z) - sum softmax(z) * z``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
