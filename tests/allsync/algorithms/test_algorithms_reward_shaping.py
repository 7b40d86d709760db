import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allsync.algorithms import overlong_filter_mask, overlong_penalty


def test_dapo_paper_oracle():
    lengths = torch.tensor([16384, 18432, 20480, 20481, 1000])
    penalty = overlong_penalty(lengths, max_len=20480, cache_len=4096)
    assert penalty.tolist() == [0.0, -0.5, -1.0, -1.0, 0.0]


def test_factor_scales_and_list_input():
    assert overlong_penalty([17408, 30000], max_len=20480, cache_len=4096, factor=2.0).tolist() == [-0.5, -2.0]


def test_zero_cache_len_is_a_hard_cutoff():
    assert overlong_penalty([10, 11], max_len=10, cache_len=0).tolist() == [0.0, -1.0]


def test_invalid_cache_len():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty([1], max_len=10, cache_len=11)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 5000),
    st.data(),
    st.floats(0.0, 5.0, allow_nan=False),
)
def test_property_monotone_and_bounded(max_len, data, factor):
    cache_len = data.draw(st.integers(0, max_len))
    lengths = torch.tensor(sorted(data.draw(st.lists(st.integers(0, 2 * max_len + 5), min_size=1, max_size=50))))
    penalty = overlong_penalty(lengths, max_len, cache_len, factor)
    assert bool((penalty[1:] <= penalty[:-1]).all())
    assert bool((penalty >= -factor - 1e-6).all()) and bool((penalty <= 0).all())


def test_overlong_filter_mask_zeroes_truncated_rows():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = overlong_filter_mask(["stop", "length", "stop"], mask)
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert out.dtype == mask.dtype
    assert mask[1].tolist() == [1, 1, 1]  # input untouched
    with pytest.raises(ValueError):
        overlong_filter_mask(["stop"], mask)


def test_kimi_group_length_reward_oracle():
    from allsync.algorithms import group_length_reward

    # group 0: lengths 10, 20, 30, correct, correct, wrong -> lambda 0.5, 0, -0.5; the wrong one keeps min(0, -0.5)
    # group 1: equal lengths -> 0; group 2: lengths 7 (wrong), 9 (right) -> lambda 0.5, -0.5 -> wrong gets min(0, 0.5) = 0
    # group 3: a single response -> 0
    reward = group_length_reward(
        torch.tensor([10, 20, 30, 5, 5, 7, 9, 8]),
        torch.tensor([1, 1, 0, 1, 0, 0, 1, 1]),
        torch.tensor([0, 0, 0, 1, 1, 2, 2, 3]),
    )
    assert reward.tolist() == [0.5, 0.0, -0.5, 0.0, 0.0, 0.0, -0.5, 0.0]
    # reward.length.groups with_correct: an all-wrong group gets no length term (the shortest wrong reply is not the
    # least punished); groups with a correct reply as before
    only = group_length_reward(
        torch.tensor([10, 20, 30, 5, 5, 7, 9, 8, 4, 12]),
        torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 0, 0]),
        torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 4, 4]),
        groups_with_correct=True,
    )
    assert only.tolist() == [0.5, 0.0, -0.5, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0]
    everywhere = group_length_reward(
        torch.tensor([4, 12]), torch.tensor([0, 0]), torch.tensor([0, 0]), groups_with_correct=False
    )
    assert everywhere.tolist() == [0.0, -0.5]
    # lambda is linear in length between the group's shortest (+0.5) and longest (-0.5)
    assert group_length_reward(
        torch.tensor([100, 125, 200]), torch.ones(3), torch.zeros(3, dtype=torch.long)
    ).tolist() == [0.5, 0.25, -0.5]


def test_length_reward_in_the_worker_is_coef_times_the_group_reward(tiny_bf16):
    from allsync.config import parse_config
    from allsync.tasks import Problem
    from allsync.run.worker import RLWorker

    problems = [Problem("what is 1+1?", "2"), Problem("what is 2+2?", "4")]
    config = parse_config(
        {
            "model": {"base": str(tiny_bf16)},
            "lora": {"rank": 8, "alpha": 16},
            "reward": {"length": {"coef": 0.2}},
            "rollout": {"prompts_per_step": 2, "group_size": 3},
            "parallel": {"workers_per_node": 1},
        }
    )
    w = RLWorker(config, problems)
    try:
        encode = lambda text: w.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        responses = [
            encode("Answer: 2"),
            encode("I think... Answer: 2"),
            encode("Answer: 3"),
            encode("Answer: 4"),
            encode("Answer: 5"),
        ]
        rewards, correct, _ = w.scorer.rewards([problems[0]] * 3 + [problems[1]] * 2, responses, [0, 0, 0, 1, 1])
    finally:
        w.shutdown()
    assert correct == [True, True, False, True, False]
    n = [len(r) for r in responses]
    lam0 = [0.5 - (x - min(n[:3])) / (max(n[:3]) - min(n[:3])) for x in n[:3]]
    expected = [1 + 0.2 * lam0[0], 1 + 0.2 * lam0[1], 0.2 * min(0.0, lam0[2]), 1.0, 0.0]  # group 1: equal lengths
    assert rewards == pytest.approx(expected)
