"""NLFT's saliency, weights and loss (allsync/algorithms/nlft.py) against the issue's oracle and hand-made cases."""

import math

import pytest
import torch

from allsync.algorithms.nlft import nlft_loss, nlft_weights, salient_tokens


def tensors(*rows):
    return [torch.tensor([r], dtype=torch.float64) for r in rows]


def test_the_oracle_token_is_salient_with_its_weight_and_unlikelihood_term():
    p_base, p_std, p_judge = tensors([0.10], [0.15], [0.30])
    weights, salient = nlft_weights(p_base, p_std, p_judge, torch.tensor([False]))
    assert bool(salient[0, 0]) and float(weights[0, 0]) == pytest.approx(2 / (1 + math.exp(-1.5)), abs=1e-12)
    assert float(weights[0, 0]) == pytest.approx(1.635, abs=5e-4)
    out = nlft_loss(p_base.log(), p_std, p_judge, torch.tensor([False]), torch.ones(1, 1))
    assert float(out.loss) == pytest.approx(-float(weights[0, 0]) * math.log(0.9), abs=1e-12)


def test_a_token_the_judgment_barely_moves_is_not_salient_and_gets_a_likelihood_term():
    p_base, p_std, p_judge = tensors([0.25], [0.15], [0.30])  # 0.30 / 0.25 = 1.2
    out = nlft_loss(p_base.log(), p_std, p_judge, torch.tensor([False]), torch.ones(1, 1))
    assert not bool(out.salient[0, 0])
    assert float(out.loss) == pytest.approx(-math.sqrt(0.15) * math.log(0.25), abs=1e-12)


@pytest.mark.parametrize(
    "p_base, p_std, p_judge, salient",
    [
        (0.10, 0.25, 0.30, False),  # p_judge / p_std = 1.2
        (0.001, 0.001, 0.009, False),  # p_judge <= 0.01
        (0.001, 0.001, 0.02, True),
    ],
)
def test_every_saliency_condition_is_needed(p_base, p_std, p_judge, salient):
    assert bool(salient_tokens(*tensors([p_base], [p_std], [p_judge]))[0, 0]) == salient


def test_a_correct_responses_tokens_are_boosted_where_the_standard_answer_is_nearly_certain():
    p_base, p_std, p_judge = tensors([0.5, 0.5], [0.99, 0.5], [0.99, 0.99])  # p_judge is not read for correct ones
    weights, salient = nlft_weights(p_base, p_std, p_judge, torch.tensor([True]))
    assert not bool(salient.any())
    assert weights[0].tolist() == pytest.approx([1 + 0.8**5, 1.0])


def test_the_gradient_reaches_the_plain_prompts_logprobs_only_and_masked_tokens_do_not_count():
    logprobs = torch.tensor([[math.log(0.10), math.log(0.25), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    p_std = torch.tensor([[0.15, 0.15, 0.15]], dtype=torch.float64, requires_grad=True)
    p_judge = torch.tensor([[0.30, 0.30, 0.30]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = nlft_loss(logprobs, p_std, p_judge, torch.tensor([False]), mask)
    out.loss.backward()
    w_salient, w_other = 2 / (1 + math.exp(-1.5)), math.sqrt(0.15)
    # d/dl [-w log(1 - e^l)] = w e^l / (1 - e^l);  d/dl [-w l] = -w;  mean over the 2 unmasked tokens
    expected = [w_salient * 0.10 / 0.90 / 2, -w_other / 2, 0.0]
    assert logprobs.grad[0].tolist() == pytest.approx(expected, abs=1e-12)
    assert p_std.grad is None or float(p_std.grad.abs().sum()) == 0.0


def test_the_registered_policy_loss_is_nlft_loss_with_signed_weights():
    """What the learner computes (`nlft` policy loss over signed weights, token-mean) equals nlft_loss, value and
    gradient: the oracle's salient token, a likelihood token, a correct response's boosted token, a masked one."""
    from allsync.algorithms import get, nlft_signed_weights

    logprobs = torch.log(torch.tensor([[0.10, 0.25, 0.5], [0.97, 0.6, 0.2]], dtype=torch.float64))
    p_std = torch.tensor([[0.15, 0.15, 0.15], [0.99, 0.5, 0.5]], dtype=torch.float64)
    p_judge = torch.tensor([[0.30, 0.30, 0.30], [0.5, 0.5, 0.5]], dtype=torch.float64)
    correct, mask = torch.tensor([False, True]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    signed = nlft_signed_weights(logprobs.exp(), p_std, p_judge, correct)
    assert signed[0, 0].item() == pytest.approx(-2 / (1 + math.exp(-1.5)))  # salient: the unlikelihood sign
    assert signed[1, 0].item() == pytest.approx(1 + 0.8**5) and signed[0, 1].item() == pytest.approx(math.sqrt(0.15))
    a = logprobs.clone().requires_grad_(True)
    b = logprobs.clone().requires_grad_(True)
    loss, stats = get("policy_loss", "nlft")(a, logprobs, signed, mask, agg="token-mean")
    reference = nlft_loss(b, p_std, p_judge, correct, mask).loss
    loss.backward()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), abs=1e-12) and loss.item() > 0
    assert torch.allclose(a.grad, b.grad, atol=1e-12) and float(stats["approx_kl"]) == 0.0
