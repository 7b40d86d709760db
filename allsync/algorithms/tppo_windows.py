"""T-PPO window bookkeeping: which in-flight responses finish, continue, and what refills the pool.

Truncated PPO generates in windows of ``window`` tokens over a pool of
``pool_size`` in-flight responses. After each window:

* a response that emitted EOS is finished with reason ``"stop"``;
* a response that reached ``max_len`` tokens is finished with reason ``"length"``;
* every other response continues (it is "truncated" at the window: train on it
  with ``egae(..., truncated=True)``);
* prompts from the front of the queue take the finished responses' places, so
  the pool keeps ``pool_size`` entries as long as the queue has prompts.

Pure bookkeeping on python lists: no tensors, no generation.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class InFlight:
    """One response being generated: the id of its sample (prompt, or (prompt, k)) and its length so far."""

    sample_id: Hashable
    num_tokens: int = 0


@dataclass(frozen=True)
class WindowAdvance:
    """Result of :func:`advance_window`; ids keep the pool's order."""

    finished_ids: list[Hashable]
    finish_reasons: list[str]  # "stop" or "length", aligned with finished_ids
    finished_lengths: list[int]  # total tokens of each finished response
    continuing_ids: list[Hashable]  # cut at the window, still generating
    refilled_ids: list[Hashable]  # taken from the front of the prompt queue
    pool: list[InFlight] = field(default_factory=list)  # continuing (updated) + refilled (0 tokens)
    remaining_queue: list[Hashable] = field(default_factory=list)


def advance_window(
    pool: Sequence[InFlight],
    new_token_counts: Sequence[int],
    finished_flags: Sequence[bool],
    prompt_queue: Sequence[Hashable],
    pool_size: int,
    window: int,
    max_len: int,
) -> WindowAdvance:
    """Advance the pool by one generation window.

    For pool entry i with ``n_i`` tokens before the window and ``k_i`` new ones
    (0 <= k_i <= window, n_i + k_i <= max_len)::

        finished, "stop"    if finished_flags[i]           (EOS inside the window)
        finished, "length"  elif n_i + k_i == max_len
        continuing          otherwise, with n_i + k_i tokens

        refill = min(pool_size - #continuing, len(prompt_queue)) prompts from the queue front
        new pool = continuing entries (pool order) + refilled entries (0 tokens)

    Start with an empty pool (and empty counts/flags) to fill it from the queue.

    Raises:
        ValueError: lengths of pool / counts / flags differ, a count is negative or
            exceeds ``window``, a response would exceed ``max_len``, or the pool
            holds more continuing responses than ``pool_size``.
    """
    if not (len(pool) == len(new_token_counts) == len(finished_flags)):
        raise ValueError(
            f"pool ({len(pool)}), new_token_counts ({len(new_token_counts)}) and "
            f"finished_flags ({len(finished_flags)}) must have one entry per response"
        )
    if window < 1 or max_len < 1 or pool_size < 0:
        raise ValueError(f"need window >= 1, max_len >= 1, pool_size >= 0; got {window}, {max_len}, {pool_size}")

    finished_ids: list[Hashable] = []
    finish_reasons: list[str] = []
    finished_lengths: list[int] = []
    continuing: list[InFlight] = []
    for entry, new_tokens, done in zip(pool, new_token_counts, finished_flags):
        new_tokens = int(new_tokens)
        if not 0 <= new_tokens <= window:
            raise ValueError(f"response {entry.sample_id!r} generated {new_tokens} tokens in a window of {window}")
        length = entry.num_tokens + new_tokens
        if length > max_len:
            raise ValueError(f"response {entry.sample_id!r} has {length} tokens, more than max_len={max_len}")
        if done or length == max_len:
            finished_ids.append(entry.sample_id)
            finish_reasons.append("stop" if done else "length")
            finished_lengths.append(length)
        else:
            continuing.append(InFlight(entry.sample_id, length))

    if len(continuing) > pool_size:
        raise ValueError(f"{len(continuing)} continuing responses do not fit a pool of {pool_size}")
    queue = list(prompt_queue)
    num_refill = min(pool_size - len(continuing), len(queue))
    refilled_ids = queue[:num_refill]
    return WindowAdvance(
        finished_ids=finished_ids,
        finish_reasons=finish_reasons,
        finished_lengths=finished_lengths,
        continuing_ids=[entry.sample_id for entry in continuing],
        refilled_ids=refilled_ids,
        pool=continuing + [InFlight(sample_id) for sample_id in refilled_ids],
        remaining_queue=queue[num_refill:],
    )
