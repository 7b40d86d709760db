"""The `reward:` section: how a response is scored (evals/rewards.py, evals/reward_pool.py)."""

from __future__ import annotations

from dataclasses import dataclass


LENGTH_GROUPS = ("all", "with_correct")


@dataclass
class LengthRewardSection:
    coef: float = 1.0  # reward += coef * Kimi-1.5's group length reward (allsync.algorithms.group_length_reward)
    groups: str = "all"  # all | with_correct: the length term only in groups with a correct response


@dataclass
class RewardSection:
    """How a response is scored (evals/rewards.py, in worker processes: evals/reward_pool.py)."""

    name: str | None = (
        None  # math_dapo (+1/-1) | math_verify | exact | arithmetic (0/1); None: the task's default_reward
    )
    function: str | None = None  # "package.module:function": function(response, row) -> float | dict; replaces name
    timeout_s: float = 10.0  # per sample; a slower sample is an error
    on_error: str = "fail"  # a reward that raises or times out: fail (stop the run, naming the sample) | wrong
    processes: int = 1  # reward processes per worker
    length: LengthRewardSection | None = (
        None  # Kimi-1.5's length reward per group, added beside DAPO's overlong shaping
    )

    def spec(self):
        from evals.reward_pool import RewardSpec

        return RewardSpec(self.name, self.function, self.timeout_s)

    def check(self, fail) -> None:
        from evals.rewards import REWARDS

        if self.function is None and self.name not in REWARDS:
            fail(f"reward.name = {self.name!r}: unknown reward (known: {', '.join(REWARDS)}; or give reward.function)")
        if self.function is not None:
            from evals.reward_pool import load_function

            try:
                load_function(self.function)
            except ValueError as exc:
                fail(f"reward.function: {exc}")
        if self.on_error not in ("fail", "wrong"):
            fail(f"reward.on_error = {self.on_error!r}: use fail (stop the run) or wrong (score the sample as wrong)")
        if not self.timeout_s > 0:
            fail(f"reward.timeout_s = {self.timeout_s}: must be > 0")
        if self.processes < 1:
            fail(f"reward.processes = {self.processes}: must be >= 1")
        if self.length is not None and not self.length.coef > 0:
            fail(f"reward.length.coef = {self.length.coef}: must be > 0 (leave reward.length out for none)")
        if self.length is not None and self.length.groups not in LENGTH_GROUPS:
            fail(f"reward.length.groups = {self.length.groups!r}: use one of {', '.join(LENGTH_GROUPS)}")
