"""DAPO's overlong reward shaping and overlong filtering; Kimi-1.5's group length reward.

Shapers added to the task's score are registered in REWARD_SHAPERS under one signature,
    shaper(lengths [N] response tokens, correct [N] bool, group_index [N] or None, settings) -> [N] float64,
where `settings` is the config section that turns the shaper on (allsync.run.scoring.reward_shapings says which).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .selection import Registry


def overlong_penalty(
    lengths: torch.Tensor | Sequence[int],
    max_len: int,
    cache_len: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the task reward::

        R(L) = 0                                           if L <= max_len - cache_len
        R(L) = ((max_len - cache_len) - L) / cache_len * factor   if L <= max_len
        R(L) = -factor                                     if L > max_len

    e.g. max_len 20480, cache_len 4096: 16384 -> 0, 18432 -> -0.5, 20480 -> -1.
    Non-increasing in L and within [-factor, 0] (for factor >= 0).

    Returns:
        float tensor shaped like ``lengths`` (float32 unless ``lengths`` is a float tensor).
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = torch.as_tensor(lengths)
    dtype = lengths.dtype if lengths.is_floating_point() else torch.float32
    length = lengths.to(torch.float64)
    expected_len = max_len - cache_len
    soft = (expected_len - length) / max(cache_len, 1) * factor
    penalty = torch.where(length <= expected_len, torch.zeros_like(length), soft)
    penalty = torch.where(length > max_len, torch.full_like(length, -factor), penalty)
    return penalty.to(dtype)


def overlong_filter_mask(finish_reasons: Sequence[str], mask: torch.Tensor) -> torch.Tensor:
    """Drop truncated samples from the loss: rows whose finish reason is ``"length"`` become all-zero.

    ``out[b, t] = mask[b, t] * (finish_reasons[b] != "length")``; same dtype as ``mask``.
    """
    if len(finish_reasons) != mask.shape[0]:
        raise ValueError(f"{len(finish_reasons)} finish reasons for {mask.shape[0]} mask rows")
    keep = torch.tensor([reason != "length" for reason in finish_reasons], device=mask.device)
    keep = keep.reshape((-1,) + (1,) * (mask.dim() - 1))
    return torch.where(keep, mask, torch.zeros_like(mask))


def group_length_reward(
    lengths: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor, groups_with_correct: bool = False
) -> torch.Tensor:
    """Kimi-1.5's length reward (Kimi Team 2025, sec. 2.3.3), per group of responses to one problem::

        lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)      (min/max over i's group; 0 if they are equal)
        r_i      = lambda_i            if response i is correct
        r_i      = min(0, lambda_i)    otherwise

    so within a group the shortest correct answer earns +0.5 and the longest -0.5, and a wrong answer is
    never rewarded for being short. e.g. lengths [10, 20, 30], correct [1, 1, 0] -> [0.5, 0, -0.5].

    With groups_with_correct, r_i = 0 in a group without a correct response: all-wrong groups get no length
    pressure (with it, the shortest wrong reply is the least punished, and a run can drift to empty replies).

    lengths: [N] response tokens; correct: [N] bool; group_index: [N] group ids (0..G-1). Returns float32 [N].
    """
    lengths = lengths.to(torch.float64)
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    low = torch.full((groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, group_index, lengths, "amin")
    high = torch.full((groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, group_index, lengths, "amax")
    span = (high - low)[group_index]
    lam = torch.where(span > 0, 0.5 - (lengths - low[group_index]) / span.clamp(min=1e-12), torch.zeros_like(lengths))
    reward = torch.where(correct.bool(), lam, lam.clamp(max=0.0))
    if groups_with_correct:
        right = torch.zeros(groups, dtype=torch.float64).scatter_reduce(0, group_index, correct.double(), "amax")
        reward = torch.where(right[group_index] > 0, reward, torch.zeros_like(reward))
    return reward.to(torch.float32)


def shape_overlong(
    lengths: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor | None, settings
) -> torch.Tensor:
    """DAPO's soft overlong punishment (:func:`overlong_penalty`) with settings.max_len, .cache_len, .factor."""
    return overlong_penalty(lengths, settings.max_len, settings.cache_len, settings.factor).double()


def shape_length(
    lengths: torch.Tensor, correct: torch.Tensor, group_index: torch.Tensor | None, settings
) -> torch.Tensor:
    """settings.coef x Kimi-1.5's length reward within each group (:func:`group_length_reward`; settings.groups
    with_correct: only in groups with a correct response)."""
    if group_index is None:
        raise ValueError("the length reward compares the responses of a group: group_index is needed")
    with_correct = settings.groups == "with_correct"
    return settings.coef * group_length_reward(lengths, correct, group_index, with_correct).double()


REWARD_SHAPERS = Registry("reward_shaping", {"overlong": shape_overlong, "length": shape_length})
