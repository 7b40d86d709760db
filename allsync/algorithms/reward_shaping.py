"""DAPO's overlong reward shaping and overlong filtering."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
