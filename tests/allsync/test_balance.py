"""allsync/update/balance.py's assignment of a minibatch's episodes to the workers (optim.balance_ranks), on hand examples."""

from allsync.update.balance import assign_episodes, dealt_forwards
from allsync.update.sequences import token_budget_chunks


def test_without_a_budget_each_episode_goes_to_the_worker_with_the_fewest_tokens():
    """Longest-processing-time: 9 (worker 0), 8 (worker 1), 5 (worker 1: 8 < 9), 4 (worker 0: 9 < 13), 1 (worker 0:
    13 = 13, the lower rank); every episode in forward 0."""
    got = assign_episodes([[9, 4], [8, 5, 1]], 2)
    assert got == [[(0, 0), (0, 0)], [(1, 0), (1, 0), (0, 0)]]


def test_with_a_budget_forwards_are_packed_over_every_worker_and_dealt_largest_first():
    """Budget 10: forwards [9], [8], [5, 4] (2 x 5), [3, 2, 2] (3 x 3), [1] -> sizes 9, 8, 10, 9, 1; largest first:
    10 (worker 0, turn 0), 9 [9] (worker 1, turn 0), 9 [3, 2, 2] (turn 1, back: worker 1), 8 (worker 0, turn 1),
    1 (turn 2: worker 0). Each worker's turn-t forward runs beside the others' turn-t one."""
    tokens = [[9, 5, 2, 1], [8, 4, 3, 2]]
    got = assign_episodes(tokens, 2, budget=10)
    assert got == [[(1, 0), (0, 0), (1, 1), (0, 2)], [(0, 1), (0, 0), (1, 1), (1, 1)]]
    for worker in range(2):  # every forward within the budget, as the learner packs them
        rows = [(t, f) for w, episodes in enumerate(tokens) for t, (d, f) in zip(episodes, got[w]) if d == worker]
        for group in dealt_forwards([f for _, f in rows]):
            assert len(group) * max(rows[i][0] for i in group) <= 10
    assert dealt_forwards([1, 0, 1, 2]) == [[1], [0, 2], [3]]


def test_forwards_are_packed_longest_first_and_listed_in_row_order():
    assert token_budget_chunks([5, 3, 9, 2], 10) == [[2], [0, 1], [3]]
    assert token_budget_chunks([3, 5, 4], 100) == [[0, 1, 2]]  # one forward: the rows in their order
    assert token_budget_chunks([3, 5, 4], None) == [[0, 1, 2]]
