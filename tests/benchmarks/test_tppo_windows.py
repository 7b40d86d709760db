"""benchmarks/tppo_windows.py: its three arms are configs the recipe accepts, with the settings the comparison
names, and its summary reads the curve and rates from a run's metric rows."""

import pytest

from allsync.config import parse_config
from benchmarks.tppo_windows import arm_configs, summarize, time_to_reach


def test_the_arms_are_valid_configs_that_differ_where_the_comparison_says():
    arms = arm_configs(minutes=12, window=32, pool=128, eval_minutes=2)
    parsed = {name: parse_config(config) for name, config in arms.items()}
    dapo, ppo, tppo = parsed["DAPO"], parsed["PPO"], parsed["T-PPO"]
    assert all(c.run.time_limit_minutes == 12 and c.model.warm_start_steps == 450 for c in parsed.values())
    assert dapo.algorithm.advantage == "grpo" and dapo.producer.kind == "single_turn"
    assert (ppo.algorithm.advantage, ppo.producer.window) == ("gae", None)
    assert (tppo.algorithm.advantage, tppo.producer.window) == ("egae", 32)
    for c in (ppo, tppo):
        assert (c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.decode_batch) == (128, 1, 64)
        assert c.optim.lr == dapo.optim.lr and c.algorithm.lam == 1.0 and c.algorithm.value_lam == 1.0
    # about as many finished responses before the policy moves: 5 x 128 whole ones, 20 windows of 128 x 32 tokens
    assert (ppo.algorithm.value_pretrain_steps, tppo.algorithm.value_pretrain_steps) == (5, 20)


def test_the_probe_arms_change_only_what_they_probe():
    """PPO-last: PPO with the probe producer (run.imports) training each reply's last window of tokens; T-PPO-critic4x:
    T-PPO with four times the critic-only steps; T-PPO-scale: T-PPO whose advantages keep their sign (algorithm.whiten
    scale)."""
    from dataclasses import replace

    from benchmarks.probes.last_tokens_credit import last_tokens_mask

    names = ("PPO", "PPO-last", "T-PPO-critic4x", "T-PPO", "T-PPO-scale")
    arms = arm_configs(minutes=12, window=32, pool=128, eval_minutes=2, arms=names)
    parsed = {name: parse_config(config) for name, config in arms.items()}
    ppo, last, critic4x = parsed["PPO"], parsed["PPO-last"], parsed["T-PPO-critic4x"]
    assert (last.producer.kind, last.producer.trained_tokens, last.producer.window) == ("last_tokens_credit", 32, None)
    assert last.algorithm == ppo.algorithm and last.rollout == ppo.rollout
    assert (critic4x.producer.window, critic4x.algorithm.value_pretrain_steps) == (32, 80)
    assert last_tokens_mask(40, 32) == [0] * 8 + [1] * 32 and last_tokens_mask(20, 32) == [1] * 20
    tppo, scaled = parsed["T-PPO"], parsed["T-PPO-scale"]
    assert (tppo.algorithm.whiten, scaled.algorithm.whiten) == ("batch", "scale")
    assert replace(scaled.algorithm, whiten="batch") == tppo.algorithm and scaled.producer == tppo.producer


def test_the_summary_counts_training_minutes_and_the_first_evaluation_at_a_target():
    rows = [
        {"step": 0, "heldout_accuracy": 0.3},
        *[
            {
                "step": s,
                "step_seconds": 30.0,
                "utilization": 1.0,
                "decode_fill": 0.5,
                "samples_per_second": 2.0,
                "trained_tokens": 100,
            }
            for s in (1, 2, 3, 4)
        ],
    ]
    rows[2]["heldout_accuracy"], rows[4]["heldout_accuracy"] = 0.2, 0.4  # after 1 and 2 minutes
    workers = [{"workers": [{"generate_seconds": 10.0, "train_seconds": 20.0}]}] * 4
    r = summarize(rows, workers)
    assert r["curve"] == [(0, 0.0, 0.3), (2, 1.0, 0.2), (4, 2.0, 0.4)]
    assert (r["steps"], r["train_minutes"], r["step_seconds"]) == (4, 2.0, 30.0)
    assert r["responses_per_minute"] == pytest.approx(120.0) and r["trained_tokens_per_minute"] == pytest.approx(200.0)
    assert time_to_reach(r["curve"], 0.3) == 2.0  # the base's own 30% at step 0 does not count
    assert time_to_reach(r["curve"], 0.5) is None
