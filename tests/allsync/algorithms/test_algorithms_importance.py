"""Truncated importance sampling's weights on hand-made logprobs: capped, detached, token and sequence level, and 1
where the engine is the trainer."""

import math

import pytest
import torch

from allsync.algorithms import tis_weights

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_token_weights_are_the_capped_ratio_and_one_off_the_mask():
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])
    engine = torch.tensor([[-1.0, -3.0, -0.7, 0.0]])  # ratios 1, e, e^0.2; the 4th is not trained
    weights, capped = tis_weights(old, engine, MASK, "token", cap=2.0)
    assert weights.tolist()[0] == pytest.approx([1.0, 2.0, math.exp(0.2), 1.0])
    assert capped.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_sequence_weights_are_the_capped_product_over_the_trained_tokens():
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-1.0, -1.0, -1.0, -1.0]])
    engine = torch.tensor([[-1.1, -2.1, -0.6, 5.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.cat([MASK, MASK])
    weights, capped = tis_weights(old, engine, mask, "sequence", cap=2.0)
    assert weights[0, :3].tolist() == pytest.approx([math.exp(0.3)] * 3)  # 0.1 three times; token 4 untrained
    assert weights[1, :3].tolist() == pytest.approx([math.exp(-3.0)] * 3) and capped.sum() == 0
    weights, capped = tis_weights(old, engine, mask, "sequence", cap=1.2)
    assert weights[0, :3].tolist() == pytest.approx([1.2] * 3) and capped[0].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_weights_are_one_when_the_engine_is_the_trainer_and_carry_no_gradient():
    old = torch.randn(3, 5, requires_grad=True)
    for level in ("token", "sequence"):
        weights, capped = tis_weights(old, old.detach().clone(), torch.ones(3, 5), level, cap=2.0)
        assert torch.equal(weights, torch.ones(3, 5)) and capped.sum() == 0 and not weights.requires_grad


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="TIS level 'episode'"):
        tis_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "episode", 2.0)
