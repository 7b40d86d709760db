import pytest

from allsync.algorithms import InFlight, advance_window


def test_hand_made_window_partition_and_refill():
    pool = [InFlight("a", 0), InFlight("b", 8), InFlight("c", 4), InFlight("d", 6)]
    step = advance_window(
        pool,
        new_token_counts=[4, 2, 4, 4],
        finished_flags=[False, True, False, False],
        prompt_queue=["e", "f", "g"],
        pool_size=4,
        window=4,
        max_len=10,
    )
    # a: 0+4 continues; b: EOS -> stop (10 tokens); c: 4+4=8 continues; d: 6+4 = 10 = max_len -> length
    assert step.finished_ids == ["b", "d"]
    assert step.finish_reasons == ["stop", "length"]
    assert step.finished_lengths == [10, 10]
    assert step.continuing_ids == ["a", "c"]
    assert step.refilled_ids == ["e", "f"]
    assert step.pool == [InFlight("a", 4), InFlight("c", 8), InFlight("e", 0), InFlight("f", 0)]
    assert step.remaining_queue == ["g"]
    assert set(step.finished_ids).isdisjoint(step.continuing_ids)
    assert set(step.finished_ids) | set(step.continuing_ids) == {"a", "b", "c", "d"}


def test_pool_size_constant_while_queue_has_prompts():
    window, max_len, pool_size = 3, 7, 5
    step = advance_window([], [], [], list(range(40)), pool_size, window, max_len)
    assert len(step.pool) == pool_size
    queue, pool, finished = step.remaining_queue, step.pool, []
    for i in range(30):
        counts = [min(window, max_len - e.num_tokens) for e in pool]
        flags = [(hash((e.sample_id, i)) % 3 == 0) for e in pool]
        had_queue = len(queue)
        step = advance_window(pool, counts, flags, queue, pool_size, window, max_len)
        finished += step.finished_ids
        if had_queue >= len(step.finished_ids):
            assert len(step.pool) == pool_size
        assert all(e.num_tokens <= max_len for e in step.pool)
        queue, pool = step.remaining_queue, step.pool
        if not pool:
            break
    assert not pool and not queue
    assert sorted(finished) == list(range(40))  # every prompt finished exactly once


def test_rejects_more_tokens_than_the_window_or_max_len():
    with pytest.raises(ValueError, match="window"):
        advance_window([InFlight("a")], [5], [False], [], 1, window=4, max_len=10)
    with pytest.raises(ValueError, match="max_len"):
        advance_window([InFlight("a", 8)], [3], [False], [], 1, window=4, max_len=10)
    with pytest.raises(ValueError):
        advance_window([InFlight("a")], [1, 2], [False], [], 1, window=4, max_len=10)
