"""Multi-conversation DAPO's loss on a hand-computable batch (the oracle of issue 12).

2 problems, group size 2, 3 segments per episode (memory, memory, answer), on-policy (ratio 1, so
nothing is clipped and each token's loss is -A). P1: rewards [1, 0], response tokens [4, 6, 2] and
[3, 3, 3]; P2: rewards [1, 1], tokens [5, 5, 2] twice.
"""

import pytest
import torch

from allsync.algorithms import (
    credit_mask,
    episode_token_counts,
    episodes_with_tokens,
    get,
    keep_groups,
    clipped_policy_loss,
)

REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUP = torch.tensor([0, 0, 1, 1])
TOKENS = [[4, 6, 2], [3, 3, 3], [5, 5, 2], [5, 5, 2]]
KINDS = ["memory", "memory", "answer"]
WIDTH = 6


def rows_of(episodes: list[int]):
    """mask [B, WIDTH], episode id per row (0.. in order), answer flag per row, for these episodes."""
    mask, episode_of_row, is_answer = [], [], []
    for e_new, e in enumerate(episodes):
        for n, kind in zip(TOKENS[e], KINDS):
            mask.append([1.0] * n + [0.0] * (WIDTH - n))
            episode_of_row.append(e_new)
            is_answer.append(kind == "answer")
    return torch.tensor(mask), torch.tensor(episode_of_row), torch.tensor(is_answer)


def loss_and_grad(advantage="drgrpo", dynamic_sampling=True, weighting="token", credit="all", split=None):
    """The loss and d loss / d logprob [B, WIDTH] over the kept episodes; with `split`, each part (a list
    of positions among the kept episodes: one worker's share) is computed alone with the whole batch's
    normalizers, and the parts' losses and gradients are summed."""
    keep = keep_groups(REWARDS, GROUP) if dynamic_sampling else torch.ones(4, dtype=torch.bool)
    kept = keep.nonzero().flatten().tolist()
    episode_advantages = get("advantage", advantage)(REWARDS[kept], GROUP[kept])
    mask, episode_of_row, is_answer = rows_of(kept)
    mask = credit_mask(mask, is_answer, credit)
    totals = (mask.sum(), episodes_with_tokens(mask, episode_of_row))  # all-reduced over workers in the loop
    agg = {"token": "token-mean", "episode": "episode-mean-token-mean"}[weighting]
    logprobs = torch.zeros(mask.shape, dtype=torch.float64, requires_grad=True)
    total = torch.zeros((), dtype=torch.float64)
    for part in split or [list(range(len(kept)))]:
        rows = torch.isin(episode_of_row, torch.tensor(part))
        loss, _ = clipped_policy_loss(
            logprobs[rows],
            logprobs[rows].detach(),
            episode_advantages[episode_of_row[rows]].double(),
            mask[rows].double(),
            agg=agg,
            global_tokens=totals[0],
            global_seqs=totals[1],
            episode_tokens=episode_token_counts(mask[rows], episode_of_row[rows]),
        )
        loss.backward()
        total = total + loss.detach()
    return float(total), logprobs.grad, mask, episode_of_row


def grads_of_episode(grad, mask, episode_of_row, e):
    return grad[(episode_of_row == e)][mask[episode_of_row == e] != 0]


def test_drgrpo_token_weighting_drops_the_constant_group():
    loss, grad, mask, ep = loss_and_grad()
    assert loss == pytest.approx((-0.5 * 12 + 0.5 * 9) / 21, abs=1e-7)
    assert loss == pytest.approx(-0.0714286, abs=1e-7)
    assert torch.allclose(grads_of_episode(grad, mask, ep, 0), torch.full((12,), -0.5 / 21, dtype=torch.float64))
    assert torch.allclose(grads_of_episode(grad, mask, ep, 1), torch.full((9,), 0.5 / 21, dtype=torch.float64))
    assert grads_of_episode(grad, mask, ep, 0)[0] == pytest.approx(-0.0238095, abs=1e-7)
    assert (grad[mask == 0] == 0).all()


def test_grpo_unbiased_std_and_no_dynamic_sampling():
    assert loss_and_grad("grpo")[0] == pytest.approx(-0.101015, abs=1e-6)
    loss, grad, mask, ep = loss_and_grad(dynamic_sampling=False)
    assert loss == pytest.approx(-1.5 / 45, abs=1e-7) and loss == pytest.approx(-0.0333333, abs=1e-7)
    assert (grad[ep >= 2] == 0).all()  # P2's advantage is 0


def test_episode_weighting():
    loss, grad, mask, ep = loss_and_grad(weighting="episode")
    assert loss == pytest.approx(0.0, abs=1e-12)
    assert torch.allclose(
        grads_of_episode(grad, mask, ep, 0), torch.full((12,), -0.0208333, dtype=torch.float64), atol=1e-7
    )
    assert torch.allclose(
        grads_of_episode(grad, mask, ep, 1), torch.full((9,), 0.0277778, dtype=torch.float64), atol=1e-7
    )


def test_credit_final_trains_only_the_answer_segment():
    loss, grad, mask, ep = loss_and_grad(credit="final")
    assert loss == pytest.approx(0.1, abs=1e-7)
    _, is_answer = rows_of([0, 1])[1:]
    memory_rows = ~is_answer
    assert (grad[memory_rows] == 0).all()  # exactly 0
    assert grad[is_answer].abs().sum() > 0


@pytest.mark.parametrize("weighting", ["token", "episode"])
@pytest.mark.parametrize("credit", ["all", "final"])
def test_two_workers_sum_to_the_same_gradient(weighting, credit):
    whole = loss_and_grad(weighting=weighting, credit=credit, dynamic_sampling=False)
    split = loss_and_grad(weighting=weighting, credit=credit, dynamic_sampling=False, split=[[0, 3], [1, 2]])
    assert split[0] == pytest.approx(whole[0], abs=1e-12)
    assert torch.allclose(split[1], whole[1], atol=1e-15)
