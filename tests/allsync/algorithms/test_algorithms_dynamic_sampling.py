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


def rounds_keeping(mixed: int, total: int = 4):
    """generate_fn whose every round has `total` groups of 2 samples, the first `mixed` of them non-constant."""

    def generate(round_index: int) -> GroupBatch:
        metric = torch.tensor([v for g in range(total) for v in ((0.0, 1.0) if g < mixed else (1.0, 1.0))])
        group_index = torch.arange(2 * total) // 2
        return GroupBatch(group_index, metric, [(round_index, g) for g in group_index.tolist()])

    return generate


def global_fill(kept_per_round: list[int], quota: int, max_rounds: int = 4):
    """Each worker (a thread) fills with `share` over a barrier, as the workers' all-reduce does."""
    import threading

    workers = len(kept_per_round)
    barrier, slots, results = threading.Barrier(workers), [[0] * workers for _ in range(2)], [None] * workers
    calls = [0] * workers

    def share_of(rank):
        def share(count):
            slot = slots[calls[rank] % 2]
            calls[rank] += 1
            slot[rank] = count
            barrier.wait()
            counts = list(slot)
            barrier.wait()
            return counts, rank

        return share

    def run(rank):
        try:
            results[rank] = fill_batch_with_dynamic_sampling(
                rounds_keeping(kept_per_round[rank]), quota, max_rounds, share_of(rank)
            )
        except DynamicSamplingExhausted as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_global_filling_stops_when_the_workers_together_are_full_and_keeps_exactly_the_batch():
    """Quotas 3 each (W = 9); per round worker 0 keeps 1 group, worker 1 keeps 4, worker 2 none. Each filling its own
    quota: worker 0 needs 3 rounds and worker 2 never fills (4 rounds, the cap). Together: 5 after round 1, 10 after
    round 2: every worker stops at round 2, and they keep min(k_r, W - sum_{q<r} k_q) = 2, 7 and 0 groups."""
    results = global_fill([1, 4, 0], quota=3)
    assert [stats.rounds for _, stats in results] == [2, 2, 2]
    assert [batch.num_groups for batch, _ in results] == [2, 7, 0]
    assert [stats.groups_kept for _, stats in results] == [2, 8, 0]
    batch, _ = results[1]
    assert batch.payloads[:2] == [(0, 0), (0, 0)] and batch.group_index.tolist() == [
        g for g in range(7) for _ in (0, 1)
    ]
    alone = fill_batch_with_dynamic_sampling(rounds_keeping(1), 3, 4)[1]
    assert alone.rounds == 3
    with pytest.raises(DynamicSamplingExhausted):
        fill_batch_with_dynamic_sampling(rounds_keeping(0), 3, 4)


def test_global_filling_exhausts_on_every_worker_at_the_same_round():
    results = global_fill([1, 0], quota=3, max_rounds=2)  # 2 of W = 6 after the cap
    assert all(isinstance(r, DynamicSamplingExhausted) and r.rounds_run == 2 for r in results)
    assert [r.kept.num_groups for r in results] == [2, 0]
