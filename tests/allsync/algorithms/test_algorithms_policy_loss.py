import math

import pytest
import torch

from allsync.algorithms import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    entropy_from_logits,
    explained_variance,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    loss_normalizers,
    clipped_policy_loss,
    value_fit_sums,
    value_loss,
)


def _single_token(ratio, advantage, **kwargs):
    old = torch.zeros(1, 1, dtype=torch.float64)
    logprobs = torch.full((1, 1), math.log(ratio), dtype=torch.float64, requires_grad=True)
    loss, stats = clipped_policy_loss(
        logprobs, old, torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1), **kwargs
    )
    loss.backward()
    return loss.item(), logprobs.grad.item(), stats


def test_clip_high_positive_advantage_is_clipped_with_zero_gradient():
    loss, grad, stats = _single_token(1.5, 1.0)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert stats["clipfrac_high"].item() == 1.0 and stats["clipfrac_low"].item() == 0.0


def test_clip_low_negative_advantage_is_clipped_with_zero_gradient():
    loss, grad, stats = _single_token(0.5, -1.0)
    assert loss == pytest.approx(0.8)  # -A * (1 - 0.2)
    assert grad == 0.0
    assert stats["clipfrac_low"].item() == 1.0 and stats["clipfrac_high"].item() == 0.0


def test_unclipped_token_has_ppo_gradient():
    loss, grad, _ = _single_token(1.1, 2.0)
    assert loss == pytest.approx(-2.2)
    assert grad == pytest.approx(-2.2)  # d(-A r)/d logp = -A r


def test_dual_clip_bounds_negative_advantage_loss():
    loss, grad, stats = _single_token(10.0, -1.0, clip_c=3.0)
    assert loss == pytest.approx(3.0)
    assert grad == 0.0
    assert stats["clipfrac_dual"].item() == 1.0
    loss_no_dual, _, stats_no_dual = _single_token(10.0, -1.0)
    assert loss_no_dual == pytest.approx(10.0)
    assert stats_no_dual["clipfrac_dual"].item() == 0.0


def test_dual_clip_rejects_c_not_above_one():
    with pytest.raises(ValueError, match="clip_c"):
        _single_token(1.0, 1.0, clip_c=1.0)


def test_log_ratio_is_clamped_before_exp():
    loss, _, _ = _single_token(math.exp(50.0), -1.0)
    assert loss == pytest.approx(math.exp(20.0))


def test_clip_fractions_and_kl_on_hand_made_batch():
    ratios = torch.tensor([[1.5, 1.0, 0.5, 10.0], [0.5, 1.5, 2.0, 5.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0], [1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # last token masked out
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    logprobs = old + ratios.log()
    _, stats = clipped_policy_loss(logprobs, old, adv, mask, clip_c=3.0)
    # 7 valid tokens. high: (0,0) r1.5 A+, (1,2) r2 A+ -> 2 ; low: (0,2) r.5 A- -> 1 ; dual: (0,3) r10 A- -> 1
    assert stats["clipfrac_high"].item() == pytest.approx(2 / 7)
    assert stats["clipfrac_low"].item() == pytest.approx(1 / 7)
    assert stats["clipfrac_dual"].item() == pytest.approx(1 / 7)
    valid_ratios = torch.tensor([1.5, 1.0, 0.5, 10.0, 0.5, 1.5, 2.0], dtype=torch.float64)
    assert stats["approx_kl"].item() == pytest.approx((-valid_ratios.log()).mean().item())
    assert stats["approx_kl_k3"].item() == pytest.approx((valid_ratios - 1 - valid_ratios.log()).mean().item())
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_token_advantages_and_broadcast_advantages_agree():
    torch.manual_seed(1)
    logprobs, old = torch.randn(3, 5), torch.randn(3, 5)
    adv, mask = torch.randn(3), torch.ones(3, 5)
    a, _ = clipped_policy_loss(logprobs, old, adv, mask)
    b, _ = clipped_policy_loss(logprobs, old, adv[:, None].expand(3, 5), mask)
    torch.testing.assert_close(a, b)


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 3 fully masked: not a sequence
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 4))
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(10 / 20)
    assert aggregate_loss(loss, mask, "token-mean", global_tokens=20).item() == pytest.approx(10 / 20)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", global_seqs=6).item() == pytest.approx(6 / 6)
    assert aggregate_loss(loss, torch.zeros_like(mask), "token-mean").item() == 0.0


def test_seq_mean_token_mean_averages_episodes_that_span_several_rows():
    """An agent episode that started a new context is two rows: the sequence is the episode. Episode A's rows hold
    tokens with losses (1, 3) and (5); episode B's one row (2, 2, 2): (mean(1, 3, 5) + mean(2, 2, 2)) / 2 episodes
    (before: the sum of the three row means (2 + 5 + 2) over 2 episodes = 4.5)."""
    loss = torch.tensor([[1.0, 3.0, 0.0], [5.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    episode_tokens = torch.tensor([3, 3, 3])
    for agg in ("seq-mean-token-mean", "episode-mean-token-mean"):
        got = aggregate_loss(loss, mask, agg, global_seqs=2, episode_tokens=episode_tokens)
        assert got.item() == pytest.approx((3.0 + 2.0) / 2)


def test_nan_on_padding_does_not_leak():
    loss = torch.tensor([[1.0, float("nan")]])
    assert aggregate_loss(loss, torch.tensor([[1, 0]]), "token-mean").item() == 1.0


def test_unknown_aggregation_names_it():
    with pytest.raises(ValueError, match="token-sum-mean.*token-mean"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-sum-mean")


@pytest.mark.parametrize("agg", sorted(LOSS_AGGREGATIONS))
def test_micro_batch_gradients_sum_to_full_batch_gradient(agg):
    gen = torch.Generator().manual_seed(0)
    B, T = 8, 7
    lengths = torch.tensor([7, 3, 1, 5, 0, 6, 2, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    base = old + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)

    full = base.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(full, old, adv, mask, clip_c=3.0, agg=agg)
    loss.backward()

    tokens, seqs = loss_normalizers(mask)
    micro = base.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        part, _ = clipped_policy_loss(
            micro[rows], old[rows], adv[rows], mask[rows], clip_c=3.0, agg=agg, global_tokens=tokens, global_seqs=seqs
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-12)
    assert full.grad.abs().sum() > 0
    assert torch.allclose(micro.grad, full.grad, rtol=1e-12, atol=1e-14)


def test_value_loss_only_finished_responses_get_gradient():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1]])
    loss, stats = value_loss(values, returns, mask, finished=torch.tensor([True, False]))
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    torch.testing.assert_close(values.grad, torch.tensor([[0.5, 1.0], [0.0, 0.0]], dtype=torch.float64))
    assert stats.num_tokens.item() == 2


def test_value_loss_clipping():
    values = torch.tensor([[2.0, 0.1]], dtype=torch.float64, requires_grad=True)
    old_values = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[3.0, 0.0]], dtype=torch.float64)
    loss, stats = value_loss(values, returns, torch.ones(1, 2), torch.tensor([True]), old_values=old_values, clip=0.5)
    # token 0: unclipped (2-3)^2 = 1, clipped (0.5-3)^2 = 6.25 -> 6.25 (no gradient); token 1: 0.01 both
    assert loss.item() == pytest.approx(0.5 * (6.25 + 0.01) / 2)
    loss.backward()
    assert values.grad[0, 0].item() == 0.0
    assert stats.clipfrac.item() == pytest.approx(0.5)


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    d = math.log(2.0)
    assert kl_k1(logp, ref).item() == pytest.approx(d)
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * d * d)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - (-d) - 1)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


def test_kl_estimators_average_to_true_kl():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum()
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp, logq = p.log()[samples], q.log()[samples]
    assert kl_k1(logp, logq).mean().item() == pytest.approx(true_kl.item(), abs=5e-3)
    assert kl_k3(logp, logq).mean().item() == pytest.approx(true_kl.item(), abs=5e-3)


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ent = entropy_from_logits(logits)
    assert ent[0].item() == pytest.approx(math.log(4))
    assert ent[1].item() == pytest.approx(0.0, abs=1e-9)
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    assert entropy_from_logits(p.log() + 3.0).item() == pytest.approx(-(p * p.log()).sum().item())


def test_explained_variance_by_hand_and_over_shards():
    """R = [1, 0, 0, 1] on the masked tokens (Var 0.25): V = R explains all of it, V = the mean nothing, V = 0.5 + 0.25
    (R - 0.5) gives
    EV = 1 - Var(R - V) / Var(R) = 1 - 0.75^2 = 0.4375; two workers' sums add up."""
    returns = torch.tensor([[1.0, 0.0, 9.0], [0.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 9s are masked out
    assert explained_variance(value_fit_sums(returns, returns, mask)) == pytest.approx(1.0)
    assert explained_variance(value_fit_sums(torch.full_like(returns, 0.5), returns, mask)) == pytest.approx(0.0)
    partial = 0.5 + 0.25 * (returns - 0.5)
    assert explained_variance(value_fit_sums(partial, returns, mask)) == pytest.approx(0.4375)
    shards = value_fit_sums(partial[:1], returns[:1], mask[:1]) + value_fit_sums(partial[1:], returns[1:], mask[1:])
    assert explained_variance(shards) == pytest.approx(0.4375)
    assert explained_variance(value_fit_sums(returns, torch.ones_like(returns), mask)) is None  # Var(R) = 0
