"""DAPO dynamic sampling: keep only groups with a non-constant metric, refill until full.

A group whose samples all score the same (all correct or all wrong) has zero
group-relative advantage and contributes no gradient; dynamic sampling drops
such groups and generates more until the batch holds ``num_groups`` groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class GroupBatch:
    """A batch of samples organised in groups (e.g. G responses per prompt).

    Attributes:
        group_index: [N] LongTensor, group id of each sample (any ids, any order).
        metric: [N] per-sample metric used for filtering (reward, accuracy ...).
        payloads: N per-sample objects of any type (token ids, texts, dicts ...).
    """

    group_index: torch.Tensor
    metric: torch.Tensor
    payloads: list[Any]

    def __post_init__(self) -> None:
        n = self.group_index.shape[0]
        if self.group_index.dim() != 1 or self.metric.shape != self.group_index.shape or len(self.payloads) != n:
            raise ValueError(
                f"GroupBatch needs 1-D group_index, metric and payloads of one length; got "
                f"{tuple(self.group_index.shape)}, {tuple(self.metric.shape)}, {len(self.payloads)}"
            )

    def __len__(self) -> int:
        return len(self.payloads)

    @property
    def num_groups(self) -> int:
        return int(torch.unique(self.group_index).numel())

    def select(self, keep: torch.Tensor) -> GroupBatch:
        """The samples where the [N] bool ``keep`` is True, in their original order."""
        rows = keep.nonzero().flatten()
        return GroupBatch(
            group_index=self.group_index[rows],
            metric=self.metric[rows],
            payloads=[self.payloads[i] for i in rows.tolist()],
        )

    def relabeled(self, offset: int = 0) -> GroupBatch:
        """Same samples with group ids renumbered ``offset, offset+1, ...`` by first appearance."""
        order = first_appearance_rank(self.group_index)
        return GroupBatch(order + offset, self.metric, list(self.payloads))

    @staticmethod
    def concat(batches: Sequence[GroupBatch]) -> GroupBatch:
        """Concatenate batches; groups of different batches stay distinct (ids are renumbered
        0..G-1 in order of first appearance, batch by batch)."""
        parts, offset = [], 0
        for batch in batches:
            part = batch.relabeled(offset)
            offset += batch.num_groups
            parts.append(part)
        if not parts:
            return GroupBatch(torch.zeros(0, dtype=torch.long), torch.zeros(0), [])
        return GroupBatch(
            group_index=torch.cat([p.group_index for p in parts]),
            metric=torch.cat([p.metric for p in parts]),
            payloads=[payload for p in parts for payload in p.payloads],
        )

    def first_groups(self, num_groups: int) -> GroupBatch:
        """The samples of the first ``num_groups`` groups, by order of first appearance."""
        return self.select(first_appearance_rank(self.group_index) < num_groups)


def first_appearance_rank(group_index: torch.Tensor) -> torch.Tensor:
    """[N] rank of each sample's group by the position of the group's first sample.

    e.g. ``[7, 3, 7, 9, 3] -> [0, 1, 0, 2, 1]``.
    """
    if group_index.numel() == 0:
        return group_index.to(torch.long)
    unique, inverse = torch.unique(group_index, return_inverse=True)
    positions = torch.arange(group_index.numel(), device=group_index.device)
    first = torch.full((unique.numel(),), group_index.numel(), device=group_index.device, dtype=torch.long)
    first = first.scatter_reduce(0, inverse, positions, reduce="amin")
    rank_of_group = torch.empty_like(first)
    rank_of_group[torch.argsort(first)] = torch.arange(unique.numel(), device=group_index.device)
    return rank_of_group[inverse]


def keep_groups(metric: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[N] bool: True for samples of groups whose metric is not constant.

    ``keep_i = max_{j in g(i)} metric_j != min_{j in g(i)} metric_j`` (exact
    comparison; a group of one sample is constant and dropped).
    """
    if metric.shape != group_index.shape or metric.dim() != 1:
        raise ValueError(f"metric {tuple(metric.shape)} and group_index {tuple(group_index.shape)} must be equal 1-D")
    if metric.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=metric.device)
    unique, ids = torch.unique(group_index, return_inverse=True)
    values = metric.to(torch.float64)
    empty = torch.zeros(unique.numel(), dtype=torch.float64, device=metric.device)
    group_max = empty.scatter_reduce(0, ids, values, reduce="amax", include_self=False)
    group_min = empty.scatter_reduce(0, ids, values, reduce="amin", include_self=False)
    return (group_max != group_min)[ids]


@dataclass(frozen=True)
class DynamicSamplingStats:
    """What :func:`fill_batch_with_dynamic_sampling` generated to fill the batch."""

    rounds: int  # calls of generate_fn
    groups_generated: int  # groups over all rounds
    samples_generated: int  # samples over all rounds
    groups_kept: int  # non-constant groups over all rounds (before trimming)
    groups_returned: int  # == num_groups


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling ran ``max_rounds`` rounds without collecting enough groups.

    ``kept`` holds the groups it did keep (ids renumbered from 0), so a caller may train on them."""

    def __init__(
        self,
        groups_wanted: int,
        groups_kept: int,
        rounds_run: int,
        kept: GroupBatch | None = None,
        groups_generated: int = 0,
    ):
        self.groups_wanted = groups_wanted
        self.groups_kept = groups_kept
        self.rounds_run = rounds_run
        self.kept = kept if kept is not None else GroupBatch.concat([])
        self.groups_generated = groups_generated
        super().__init__(
            f"dynamic sampling wanted {groups_wanted} groups with a non-constant metric but kept "
            f"only {groups_kept} after {rounds_run} rounds (max_rounds reached)"
        )


def fill_batch_with_dynamic_sampling(
    generate_fn: Callable[[int], GroupBatch],
    num_groups: int,
    max_rounds: int,
    share: Callable[[int], tuple[list[int], int]] | None = None,
) -> tuple[GroupBatch, DynamicSamplingStats]:
    """Call ``generate_fn(round_index)`` for rounds 0, 1, ... keeping non-constant groups
    (:func:`keep_groups`) until at least ``num_groups`` are kept, then trim to exactly
    ``num_groups`` (the earliest kept groups win).

    Global filling (``share`` given, one caller per worker): ``share(count)`` returns every worker's count, in
    rank order, and this worker's rank. Every worker runs rounds until the workers together keep
    W = sum of their ``num_groups`` (all stop at the same round), then worker r keeps
        min(k_r, max(0, W - sum_{q<r} k_q))
    of its earliest groups, so the kept total is exactly W (a worker may keep fewer than its own quota, or none).

    Group ids of the result are renumbered 0..n-1 (round by round, first
    appearance), so groups of different rounds never merge even if their ids collide.

    Raises:
        DynamicSamplingExhausted: with groups wanted / kept / rounds run and the kept
            groups themselves, when ``max_rounds`` rounds do not yield ``num_groups`` groups
            (with ``share``: the workers' W).
    """
    if num_groups < 1 or max_rounds < 1:
        raise ValueError(f"need num_groups >= 1 and max_rounds >= 1, got {num_groups}, {max_rounds}")
    share = share or (lambda count: ([count], 0))
    quotas, rank = share(num_groups)
    wanted, kept_by_worker = sum(quotas), [0] * len(quotas)
    kept_parts: list[GroupBatch] = []
    groups_generated = samples_generated = groups_kept = 0
    rounds = 0
    while sum(kept_by_worker) < wanted:
        if rounds == max_rounds:
            raise DynamicSamplingExhausted(
                num_groups, groups_kept, rounds, GroupBatch.concat(kept_parts), groups_generated
            )
        batch = generate_fn(rounds)
        rounds += 1
        kept = batch.select(keep_groups(batch.metric, batch.group_index))
        groups_generated += batch.num_groups
        samples_generated += len(batch)
        groups_kept += kept.num_groups
        kept_parts.append(kept)
        kept_by_worker, _ = share(groups_kept)
    mine = min(groups_kept, max(0, wanted - sum(kept_by_worker[:rank])))
    result = GroupBatch.concat(kept_parts).first_groups(mine)
    stats = DynamicSamplingStats(
        rounds=rounds,
        groups_generated=groups_generated,
        samples_generated=samples_generated,
        groups_kept=groups_kept,
        groups_returned=result.num_groups,
    )
    return result, stats
