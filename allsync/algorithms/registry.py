"""Registries: configs pick algorithm functions by name.

    get("advantage", "grpo")                 -> AdvantageEstimator(grpo_advantages, ...)
    get("loss_aggregation", "token-mean")    -> token_mean
    get("kl", "k3")                          -> kl_k3
    get("policy_loss", "clipped")            -> PolicyLossEntry(clipped_policy_loss, ...)
    get("reward_shaping", "overlong")        -> shape_overlong

Entries are callable (an estimator or loss entry calls its function) and carry what the loop asks of them.
Unknown kinds or names raise :class:`UnknownNameError` (a ``ValueError``)
naming the bad value and listing the valid ones.
"""

from __future__ import annotations

from typing import Any, Callable

from .advantages import ADVANTAGE_ESTIMATORS
from .aggregation import LOSS_AGGREGATIONS
from .policy_loss import POLICY_LOSSES
from .regularizers import KL_ESTIMATORS
from .reward_shaping import REWARD_SHAPERS
from .selection import UnknownNameError, select

REGISTRIES: dict[str, dict[str, Callable[..., Any]]] = {
    "advantage": ADVANTAGE_ESTIMATORS,
    "policy_loss": POLICY_LOSSES,
    "loss_aggregation": LOSS_AGGREGATIONS,
    "kl": KL_ESTIMATORS,
    "reward_shaping": REWARD_SHAPERS,
}


def get(kind: str, name: str) -> Callable[..., Any]:
    """The function registered as ``name`` in the registry ``kind`` (see module docstring)."""
    return select(select(REGISTRIES, "registry kind", kind), kind, name)


__all__ = ["REGISTRIES", "REWARD_SHAPERS", "UnknownNameError", "get"]
