"""Natural Language Fine-Tuning (NLFT, arXiv 2412.20382): token weights from natural-language judgments.

The same response tokens are scored under three prompts (probabilities of each response token, [B, T]):

    p_base    the plain prompt: the policy being trained (its log carries the gradient)
    p_std     the prompt with the standard answer
    p_judge   the prompt with the natural-language judgment of the response (wrong responses)

A wrong response's token is salient when the judgment makes it much likelier than either other prompt does:

    salient = p_judge / p_base > 1.5  and  p_judge / p_std > 1.5  and  p_judge > 0.01

salient tokens get an unlikelihood term, the others a likelihood term weighted by how well the standard answer
supports them; a correct response's tokens get a likelihood term, boosted where the standard answer is nearly certain:

    wrong, salient       -w log(1 - p_base),   w = 2 sigmoid(p_judge / p_base - 1.5)
    wrong, not salient   -w log(p_base),       w = sqrt(p_std)
    correct              -w log(p_base),       w = 1 + ((p_std - 0.95) / 0.05)^5 if p_std > 0.95 else 1

The weights are computed from detached probabilities; the loss is the mean of the weighted terms over the masked
tokens. In the learner (the same update loop as RL) the weights travel as the per-token "advantages" of a batch,
signed: w for a likelihood term, -w for an unlikelihood one (`nlft_signed_weights`), and `nlft_policy_loss` is the
policy loss registered as `nlft` (trained by recipes/nlft.py; refused for RL runs, whose advantages are not
weights). SFT is the same loss with every weight 1 on the standard answer.

Example: p_judge 0.30, p_base 0.10, p_std 0.15 is salient with w = 2 sigmoid(1.5) = 1.635 and term -1.635 log(0.9);
p_judge 0.30 with p_base 0.25 is not salient (0.30 / 0.25 = 1.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import Number, aggregate_loss
from .policy_loss import POLICY_LOSSES, PolicyLossEntry, _masked_mean

SALIENCY_RATIO = 1.5
SALIENT_MIN_PROBABILITY = 0.01
CONFIDENT_STD = 0.95


@dataclass
class NLFTTerms:
    weights: torch.Tensor  # [B, T], detached
    salient: torch.Tensor  # [B, T] bool: unlikelihood tokens
    loss: torch.Tensor  # scalar


def salient_tokens(p_base: torch.Tensor, p_std: torch.Tensor, p_judge: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: p_judge / p_base > 1.5, p_judge / p_std > 1.5 and p_judge > 0.01."""
    return (
        (p_judge > SALIENCY_RATIO * p_base) & (p_judge > SALIENCY_RATIO * p_std) & (p_judge > SALIENT_MIN_PROBABILITY)
    )


def nlft_weights(
    p_base: torch.Tensor, p_std: torch.Tensor, p_judge: torch.Tensor, correct: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, salient), both [B, T], from detached probabilities; `correct`: [B] bool per response."""
    p_base, p_std, p_judge = p_base.detach(), p_std.detach(), p_judge.detach()
    salient = salient_tokens(p_base, p_std, p_judge) & ~correct[:, None]
    wrong_weight = torch.where(salient, 2 * torch.sigmoid(p_judge / p_base - SALIENCY_RATIO), p_std.sqrt())
    boost = 1 + ((p_std - CONFIDENT_STD) / (1 - CONFIDENT_STD)).clamp(min=0) ** 5
    weights = torch.where(correct[:, None], boost, wrong_weight)
    return weights, salient


def nlft_signed_weights(
    p_base: torch.Tensor, p_std: torch.Tensor, p_judge: torch.Tensor, correct: torch.Tensor
) -> torch.Tensor:
    """[B, T]: +w on likelihood tokens, -w on salient (unlikelihood) ones (`nlft_weights`)."""
    weights, salient = nlft_weights(p_base, p_std, p_judge, correct)
    return torch.where(salient, -weights, weights)


def nlft_terms(logprobs: torch.Tensor, signed_weights: torch.Tensor) -> torch.Tensor:
    """Per token: -w log(1 - p) where the signed weight is -w < 0, else -w log p (p = exp(logprobs))."""
    unlikely = torch.log1p(-logprobs.exp().clamp(max=1 - 1e-6))
    return torch.where(signed_weights < 0, signed_weights * unlikely, -signed_weights * logprobs)


def nlft_policy_loss(
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
    """The `nlft` policy loss: aggregate_loss(nlft_terms(logprobs, advantages), mask, agg, ...), `advantages` being
    the signed NLFT weights; no ratio and no clip (the clip settings are ignored: a supervised loss). Statistics:
    approx_kl, mean(old_logprobs - logprobs) over the unmasked tokens."""
    loss = aggregate_loss(
        nlft_terms(logprobs, advantages),
        mask,
        agg,
        global_tokens,
        global_seqs,
        norm_length=norm_length,
        episode_tokens=episode_tokens,
    )
    return loss, {"approx_kl": _masked_mean(old_logprobs - logprobs.detach(), mask > 0)}


POLICY_LOSSES["nlft"] = PolicyLossEntry(
    nlft_policy_loss,
    logged=("approx_kl",),
    reads=(),
    rollout_refusal="NLFT trains on judged examples whose token weights it computes itself (python recipes/nlft.py), "
    "not on a rollout's advantages; use clipped",
)


def nlft_loss(
    logprobs_base: torch.Tensor,
    p_std: torch.Tensor,
    p_judge: torch.Tensor,
    correct: torch.Tensor,
    mask: torch.Tensor,
) -> NLFTTerms:
    """The NLFT loss (module docstring) as a token mean. logprobs_base: [B, T] log p_base of the response tokens
    under the plain prompt, with gradient; p_std, p_judge: [B, T] probabilities (p_judge is read for wrong
    responses only); correct: [B] bool; mask: [B, T], 1 on response tokens."""
    weights, salient = nlft_weights(logprobs_base.exp(), p_std, p_judge, correct)
    terms = nlft_terms(logprobs_base, torch.where(salient, -weights, weights))
    mask = mask.float()
    return NLFTTerms(weights, salient, (terms * mask).sum() / mask.sum().clamp(min=1))
