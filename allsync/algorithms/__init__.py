"""RL algorithm math for allsync: torch-only pure functions selectable by name.

No distributed calls, no I/O. Each function documents its formula.
"""

from .advantages import (
    estimators_that,
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    batch_normalized_advantages,
    drgrpo_advantages,
    egae,
    gae,
    grpo_advantages,
    group_centered_sums,
    split_advantage_sums,
    whiten_advantages,
    whitening_sums,
)
from .aggregation import LOSS_AGGREGATIONS, aggregate_loss, loss_normalizers
from .importance import TIS_LEVELS, tis_weights
from .segment_credit import CREDIT_RULES, credit_mask, episode_token_counts, episodes_with_tokens
from .dynamic_sampling import (
    DynamicSamplingExhausted,
    DynamicSamplingStats,
    GroupBatch,
    fill_batch_with_dynamic_sampling,
    first_appearance_rank,
    keep_groups,
)
from .policy_loss import POLICY_LOSSES, PolicyLoss, PolicyLossEntry, clipped_policy_loss
from .nlft import nlft_policy_loss, nlft_signed_weights  # registers the nlft policy loss
from .registry import REGISTRIES, get
from .regularizers import KL_ESTIMATORS, entropy_from_logits, kl_k1, kl_k2, kl_k3, kl_penalty
from .reward_shaping import (
    REWARD_SHAPERS,
    group_length_reward,
    overlong_filter_mask,
    overlong_penalty,
    shape_length,
    shape_overlong,
)
from .selection import UnknownNameError
from .tppo_windows import InFlight, WindowAdvance, advance_window
from .value_loss import ValueLossStats, explained_variance, value_fit_sums, value_loss

__all__ = [
    "CREDIT_RULES",
    "credit_mask",
    "episode_token_counts",
    "episodes_with_tokens",
    "whiten_advantages",
    "whitening_sums",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "batch_normalized_advantages",
    "group_centered_sums",
    "estimators_that",
    "POLICY_LOSSES",
    "PolicyLoss",
    "shape_length",
    "shape_overlong",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "REGISTRIES",
    "REWARD_SHAPERS",
    "DynamicSamplingExhausted",
    "DynamicSamplingStats",
    "GroupBatch",
    "InFlight",
    "PolicyLossEntry",
    "UnknownNameError",
    "ValueLossStats",
    "WindowAdvance",
    "advance_window",
    "aggregate_loss",
    "drgrpo_advantages",
    "egae",
    "split_advantage_sums",
    "entropy_from_logits",
    "fill_batch_with_dynamic_sampling",
    "first_appearance_rank",
    "gae",
    "get",
    "grpo_advantages",
    "keep_groups",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "loss_normalizers",
    "group_length_reward",
    "overlong_filter_mask",
    "overlong_penalty",
    "clipped_policy_loss",
    "TIS_LEVELS",
    "tis_weights",
    "value_loss",
    "nlft_policy_loss",
    "nlft_signed_weights",
    "value_fit_sums",
    "explained_variance",
]
