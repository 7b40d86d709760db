"""Rewards in worker processes (evals/reward_pool.py): registry names and user functions, errors of any kind,
and a per-sample timeout that costs at most the timeout plus a restart; the config refuses bad reward keys."""

import time

import pytest

from allsync.config import ConfigError, parse_config
from evals.reward_pool import RewardPool, RewardSpec


def test_registry_rewards_in_order():
    samples = [("Answer: 1,000", {"answer": "1000"}), ("Answer: 7", {"answer": "8"}), ("none", {"answer": "1"})]
    with RewardPool(RewardSpec("math_dapo"), processes=2) as pool:
        assert [r.score for r in pool.score(samples)] == [1.0, -1.0, -1.0]
        assert [r.score for r in pool.score(samples * 20)] == [1.0, -1.0, -1.0] * 20


def test_user_function_dict_score_and_errors():
    with RewardPool(RewardSpec(function="reward_functions:length_bonus"), processes=1) as pool:
        (good, bad) = pool.score([("Answer: 42", {"answer": "42"}), ("Answer: 4", {"answer": "42"})])
        assert (good.score, bad.score) == (1.0, -0.5)  # what it printed did not disturb the protocol
    with RewardPool(RewardSpec(function="reward_functions:broken"), processes=1) as pool:
        (result,) = pool.score([("x", {"answer": "1"})])
        assert result.score is None and result.error == "ZeroDivisionError: bad verifier"


def test_user_code_that_writes_to_the_real_stdout_or_reads_stdin_cannot_touch_the_protocol():
    """A reward whose child process (`echo`) or C code writes to fd 1, or that reads stdin: scores come back as the
    function returned them (before: true scores 0,0,0 came back as 1,0,1, stdout being the protocol)."""
    samples = [("x", {"answer": "1"})] * 3
    with RewardPool(RewardSpec(function="reward_functions:echoes"), processes=1) as pool:
        assert [(r.score, r.error) for r in pool.score(samples)] == [(0.0, None)] * 3
    with RewardPool(RewardSpec(function="reward_functions:reads_stdin"), processes=2) as pool:
        assert [(r.score, r.error) for r in pool.score(samples)] == [(0.0, None)] * 3


def test_nan_and_inf_rewards_are_errors():
    with RewardPool(RewardSpec(function="reward_functions:not_finite"), processes=1) as pool:
        results = pool.score([("nan", {"answer": "1"}), ("-inf", {"answer": "1"}), ("0.5", {"answer": "1"})])
    assert [r.score for r in results] == [None, None, 0.5]
    assert results[0].error == "ValueError: the reward is nan, not a finite number"
    assert results[1].error == "ValueError: the reward is -inf, not a finite number"


def test_a_sample_past_its_timeout_costs_the_timeout_plus_at_most_one_second():
    with RewardPool(RewardSpec(function="reward_functions:sleeps", timeout_s=2.0), processes=2) as pool:
        pool.start()  # the processes' own start (longer on a loaded machine) is not the samples' time
        start = time.monotonic()
        results = pool.score([("x", {"answer": "1"}), ("y", {"answer": "1"})])
        elapsed = time.monotonic() - start
    assert [r.error for r in results] == ["timeout after 2s"] * 2
    assert 2.0 <= elapsed < 3.0
    with RewardPool(RewardSpec("exact", timeout_s=2.0), processes=1) as pool:  # a fresh process serves after a kill
        pool.workers = []
        assert pool.score([("Answer: 3", {"answer": "3"})])[0].score == 1.0


def test_a_batch_goes_on_after_a_timeout_or_a_dead_process_in_it():
    """Issue 24: each process scores its batch of samples from one request. A sample past its timeout (counted from
    when its process started it) or one that kills its process costs only itself: a fresh process scores the rest
    of the batch, in order: one timeout, not two (the two fresh processes' starts are the rest of the time)."""
    spec = RewardSpec(function="reward_functions:slow_or_dies_when_asked", timeout_s=4.0)
    for processes in (1, 2):
        with RewardPool(spec, processes=processes) as pool:
            pool.start()
            start = time.monotonic()
            results = pool.score([(r, {"answer": "1"}) for r in ("a", "slow", "b", "die", "c", "d")])
            elapsed = time.monotonic() - start
        assert [r.score for r in results] == [1.0, None, 1.0, None, 1.0, 1.0]
        assert results[1].error == "timeout after 4s" and results[3].error == "reward process exited with code 3"
        assert 4.0 <= elapsed < 8.0


def test_a_reward_process_that_starts_slowly_does_not_time_out_its_first_sample():
    """A reward module that takes 2 s to import, with a 1 s timeout: the import comes before the process says it is
    ready, so no sample is charged for it (before: every fresh process's first sample timed out; a loaded machine
    did that to the 10 s default with math-verify's import and Python's start)."""
    with RewardPool(RewardSpec(function="reward_slow_import:one", timeout_s=1.0), processes=2) as pool:
        results = pool.score([("x", {"answer": "1"})] * 4)
    assert [(r.score, r.error) for r in results] == [(1.0, None)] * 4


@pytest.mark.parametrize(
    "reward, message",
    [
        ({"name": "f1"}, r"reward.name = 'f1': unknown reward"),
        ({"function": "no_such_module:fn"}, r"reward.function: cannot import 'no_such_module'"),
        ({"function": "reward_functions:missing"}, r"reward.function: 'reward_functions' has no function 'missing'"),
        (
            {"function": "reward_functions"},
            r"reward.function: 'reward_functions' is not of the form package.module:function",
        ),
        ({"on_error": "ignore"}, r"reward.on_error = 'ignore'"),
        ({"timeout_s": 0}, r"reward.timeout_s = 0: must be > 0"),
        ({"processes": 0}, r"reward.processes = 0: must be >= 1"),
    ],
)
def test_bad_reward_sections_name_the_key(reward, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"reward": reward})
