import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allsync.algorithms import (
    batch_normalized_advantages,
    drgrpo_advantages,
    egae,
    gae,
    get,
    group_centered_sums,
    grpo_advantages,
)


def test_grpo_hand_example():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 0]))
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.5/(0.57735 + 1e-6)
    expected = 0.5 / (0.5773502691896258 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, -expected, expected]), rtol=0, atol=1e-6)
    assert adv[0].item() == pytest.approx(0.866025, abs=2e-6)


def test_grpo_non_contiguous_unsorted_groups_and_singleton():
    rewards = torch.tensor([3.0, 1.0, 5.0, 2.0, 7.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([42, 7, 42, 7, 100, 7])  # 42: {3,5}  7: {1,2,0}  100: {7}
    adv = grpo_advantages(rewards, groups, eps=0.0)
    # group 42: mean 4, std sqrt(2) ; group 7: mean 1, std 1 ; group 100: singleton -> 0
    s2 = 2**0.5
    expected = torch.tensor([-1 / s2, 0.0, 1 / s2, 1.0, 0.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_drgrpo_is_reward_minus_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])
    torch.testing.assert_close(grpo_advantages(rewards, groups, norm_by_std=False), expected)
    torch.testing.assert_close(drgrpo_advantages(rewards, groups), expected)


def test_constant_group_gives_exact_zero_in_float32():
    rewards = torch.full((3,), 0.1)
    assert torch.equal(grpo_advantages(rewards, torch.zeros(3, dtype=torch.long)), torch.zeros(3))


def test_integer_rewards_give_float_advantages():
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.is_floating_point()


group_batches = st.lists(
    st.tuples(st.integers(0, 5), st.floats(-10, 10, allow_nan=False, width=32)), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None)
@given(group_batches, st.booleans())
def test_property_group_advantages_sum_to_zero(samples, norm_by_std):
    groups = torch.tensor([g for g, _ in samples])
    rewards = torch.tensor([r for _, r in samples], dtype=torch.float64)
    adv = grpo_advantages(rewards, groups, norm_by_std=norm_by_std)
    sums = torch.zeros(6, dtype=torch.float64).index_add(0, groups, adv)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(group_batches, st.lists(st.floats(-100, 100, allow_nan=False), min_size=6, max_size=6))
def test_property_drgrpo_invariant_to_per_group_constant(samples, shifts):
    groups = torch.tensor([g for g, _ in samples])
    rewards = torch.tensor([r for _, r in samples], dtype=torch.float64)
    shifted = rewards + torch.tensor(shifts, dtype=torch.float64)[groups]
    torch.testing.assert_close(
        drgrpo_advantages(shifted, groups), drgrpo_advantages(rewards, groups), atol=1e-9, rtol=0
    )


def test_egae_oracle_truncated_response():
    values = torch.tensor([[0.1, 0.2, 0.3, 0.5, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    adv, ret = egae(torch.zeros_like(values), values, mask, torch.tensor([True]), gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.3755, 0.29, 0.2, 0.0, 0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.4755, 0.49, 0.5, 0.5, 0.0, 0.0]], dtype=torch.float64))


def test_gae_hand_computation_finished_response():
    # gamma 0.9, lam 0.8, l = 3, V = [1, 2, 3], r = [0, 0, 1], V_3 = 0
    values = torch.tensor([[1.0, 2.0, 3.0, 7.0]], dtype=torch.float64)  # 7.0 is padding, ignored
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    d2 = 1.0 - 3.0  # -2
    d1 = 0.9 * 3.0 - 2.0  # 0.7
    d0 = 0.9 * 2.0 - 1.0  # 0.8
    a2 = d2
    a1 = d1 + 0.72 * a2  # 0.7 - 1.44 = -0.74
    a0 = d0 + 0.72 * a1  # 0.8 - 0.5328 = 0.2672
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, 0.0]], dtype=torch.float64))
    assert adv[0, 0].item() == pytest.approx(0.2672)
    torch.testing.assert_close(ret, torch.tensor([[a0 + 1, a1 + 2, a2 + 3, 0.0]], dtype=torch.float64))


def test_egae_equals_gae_when_nothing_truncated():
    torch.manual_seed(0)
    B, T = 5, 9
    lengths = torch.tensor([9, 1, 4, 6, 0])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    rewards, values = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    no_trunc = torch.zeros(B, dtype=torch.bool)
    for a, b in zip(egae(rewards, values, mask, no_trunc, 0.99, 0.95), gae(rewards, values, mask, 0.99, 0.95)):
        torch.testing.assert_close(a, b)
    # truncating changes only rows with tokens, and only through the last-token bootstrap
    adv_t, _ = egae(rewards, values, mask, torch.ones(B, dtype=torch.bool), 1.0, 1.0)
    adv_f, _ = gae(rewards, values, mask, 1.0, 1.0)
    last_values = values[torch.arange(B), (lengths - 1).clamp_min(0)] * (lengths > 0)
    torch.testing.assert_close(adv_t - adv_f, last_values[:, None] * mask)


def test_gae_does_not_track_gradients():
    values = torch.randn(2, 3, requires_grad=True)
    adv, ret = gae(torch.zeros(2, 3), values, torch.ones(2, 3), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


def test_reinforce_pp_baseline_hand_example():
    """Groups [1, 0] and [1, 1, 1, 0]: c = [0.5, -0.5, 0.25, 0.25, 0.25, -0.75]; sum c = 0, sum c^2 = 1.25 over
    6 episodes, sigma = sqrt(1.25 / 6); a constant group [2, 2] adds two zeros and counts in N."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 2.0, 2.0])
    index = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2])
    sigma = (1.25 / 8) ** 0.5
    expected = torch.tensor([0.5, -0.5, 0.25, 0.25, 0.25, -0.75, 0.0, 0.0]) / (sigma + 1e-6)
    assert torch.allclose(batch_normalized_advantages(rewards, index), expected, atol=1e-6)
    assert torch.equal(group_centered_sums(rewards, index), torch.tensor([0.0, 1.25, 8.0], dtype=torch.float64))


def test_batch_sums_make_two_halves_compute_the_whole_batch():
    """Workers holding whole groups: the sums of the halves add to the whole's, and each half computes with them
    exactly what the whole batch computes (its own sums alone would scale by its own spread: not the same)."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (24,), generator=gen).float()
    index = torch.arange(24) // 4
    estimator = get("advantage", "reinforce_pp_baseline")
    whole = estimator(rewards, index)
    halves = [(rewards[:8], index[:8]), (rewards[8:], index[8:] - 2)]
    total = sum(estimator.batch_sums(r, g) for r, g in halves)
    assert torch.allclose(total, estimator.batch_sums(rewards, index))
    assert torch.allclose(torch.cat([estimator(r, g, sums=total) for r, g in halves]), whole, atol=1e-6)
    assert not torch.allclose(torch.cat([estimator(r, g) for r, g in halves]), whole, atol=1e-3)
    empty = torch.zeros(0)
    assert torch.equal(estimator.batch_sums(empty, empty.long()), torch.zeros(3, dtype=torch.float64))
