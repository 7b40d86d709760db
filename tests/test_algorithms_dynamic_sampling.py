import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allsync.algorithms import (
    DynamicSamplingExhausted,
    GroupBatch,
    fill_batch_with_dynamic_sampling,
    first_appearance_rank,
    keep_groups,
)


def test_keep_groups_hand_example():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([3, 3, 9, 9, 1, 1, 4])  # 3 constant, 9 mixed, 1 constant, 4 singleton
    assert keep_groups(metric, groups).tolist() == [False, False, True, True, False, False, False]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.0, 0.5, 1.0])), min_size=1, max_size=40))
def test_property_keep_groups_keeps_exactly_non_constant_groups(samples):
    groups = torch.tensor([g for g, _ in samples])
    metric = torch.tensor([m for _, m in samples])
    keep = keep_groups(metric, groups)
    for g in set(groups.tolist()):
        members = groups == g
        constant = len(set(metric[members].tolist())) == 1
        assert bool((keep[members] == (not constant)).all())


def test_first_appearance_rank():
    assert first_appearance_rank(torch.tensor([7, 3, 7, 9, 3])).tolist() == [0, 1, 0, 2, 1]


def _round(groups_metrics, tag):
    """A batch of groups; each group gets ids 0.. (ids collide across rounds on purpose)."""
    ids, metric, payloads = [], [], []
    for g, values in enumerate(groups_metrics):
        for k, value in enumerate(values):
            ids.append(g)
            metric.append(value)
            payloads.append((tag, g, k))
    return GroupBatch(torch.tensor(ids), torch.tensor(metric), payloads)


def test_driver_refills_across_rounds_and_trims():
    rounds = [
        _round([[1, 1], [0, 1], [0, 0]], "r0"),  # keeps 1 group
        _round([[0, 0], [1, 1]], "r1"),  # keeps 0
        _round([[1, 0], [0, 1], [1, 0]], "r2"),  # keeps 3 -> total 4, trim to 3
        _round([[0, 1]], "never"),
    ]
    calls = []

    def generate(round_index):
        calls.append(round_index)
        return rounds[round_index]

    batch, stats = fill_batch_with_dynamic_sampling(generate, num_groups=3, max_rounds=10)
    assert calls == [0, 1, 2]
    assert batch.num_groups == 3
    assert batch.payloads == [("r0", 1, 0), ("r0", 1, 1), ("r2", 0, 0), ("r2", 0, 1), ("r2", 1, 0), ("r2", 1, 1)]
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.metric.tolist() == [0, 1, 1, 0, 0, 1]
    assert (stats.rounds, stats.groups_generated, stats.samples_generated) == (3, 8, 16)
    assert (stats.groups_kept, stats.groups_returned) == (4, 3)


def test_driver_raises_with_numbers_after_max_rounds():
    def generate(round_index):
        return _round([[0, 1], [1, 1]], round_index)  # one useful group per round

    with pytest.raises(DynamicSamplingExhausted, match=r"wanted 5 .* kept only 3 after 3 rounds") as info:
        fill_batch_with_dynamic_sampling(generate, num_groups=5, max_rounds=3)
    assert (info.value.groups_wanted, info.value.groups_kept, info.value.rounds_run) == (5, 3, 3)


def test_group_batch_validates_lengths():
    with pytest.raises(ValueError):
        GroupBatch(torch.tensor([0, 0]), torch.tensor([1.0]), ["a", "b"])
