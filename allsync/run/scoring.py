"""A worker's scoring of its responses: the run's reward (reward.name or reward.function) in the reward processes
(evals/reward_pool.py), then the reward shapers the config turns on (DAPO's overlong punishment, Kimi-1.5's
length reward), and the count of samples whose reward failed, for the step's report."""

from __future__ import annotations

import time

import torch

from allsync.algorithms import get
from allsync.run.evaluation import score_texts
from allsync.tasks import Problem
from evals.reward_pool import RewardPool


def reward_shapings(config) -> list[tuple[str, object]]:
    """(shaper name in allsync.algorithms.REWARD_SHAPERS, its config section), in the order they add to the score:
    DAPO's overlong punishment (algorithm.overlong), then the group length reward (reward.length)."""
    wanted = (("overlong", config.algorithm.overlong), ("length", config.reward.length))
    return [(name, settings) for name, settings in wanted if settings is not None]


class Scorer:
    def __init__(self, config, tokenizer, rank: int, monitor):
        """monitor: the worker's allsync.health.monitor.WorkerMonitor (its reward_seconds)."""
        self.config, self.tokenizer, self.rank, self.monitor = config, tokenizer, rank, monitor
        self.pool = RewardPool(config.reward.spec(), config.reward.processes)
        self.errors = 0  # samples whose reward raised or timed out since the last report

    def score_responses(
        self, problems: list[Problem], responses: list[list[int]]
    ) -> tuple[list[float], list[bool], int]:
        """(scores, correct, errors) from reward.name / reward.function in the reward processes
        (allsync.run.evaluation.score_texts: reward.on_error decides what a failed sample does)."""
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        return score_texts(self.pool, self.config.reward, problems, texts, where=f" of worker {self.rank}")

    def rewards(
        self, problems: list[Problem], responses: list[list[int]], group_index: list[int] | None = None
    ) -> tuple[list[float], list[bool], int]:
        """The reward's score plus DAPO's overlong shaping and, with reward.length, coef x Kimi-1.5's length
        reward within each group (`group_index`), per response; whether each is correct; reward errors."""
        scores, correct, errors = self.score_responses(problems, responses)
        shaped = torch.tensor(scores, dtype=torch.float64)
        if responses:
            lengths, is_correct = torch.tensor([len(r) for r in responses]), torch.tensor(correct)
            groups = None if group_index is None else torch.tensor(group_index)
            for name, settings in reward_shapings(self.config):
                shaped += get("reward_shaping", name)(lengths, is_correct, groups, settings)
        return shaped.tolist(), correct, errors

    def score_episodes(self, problems: list[Problem], responses: list[list[int]], group_index: list[int]):
        """`rewards`, with the reward errors counted for the step's report (the producers' score function)."""
        t = time.time()
        rewards, correct, errors = self.rewards(problems, responses, group_index)
        self.monitor.reward_seconds += time.time() - t
        self.errors += errors
        return rewards, correct, errors

    def take_errors(self) -> int:
        """The reward errors counted since the last call (the step's report), and the count reset."""
        errors, self.errors = self.errors, 0
        return errors

    def close(self) -> None:
        self.pool.close()
