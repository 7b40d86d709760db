"""Single-turn groups: each problem's prompt answered group_size times; each answer is a one-segment episode."""

from __future__ import annotations

from allsync.episodes import Episode
from allsync.engines.torch_engine import Sampling
from allsync.tasks import Problem


class SingleTurn:
    def __init__(self, engine, encode, score, sampling: Sampling, group_size: int):
        """encode(problem) -> prompt ids; score(problems, responses, group_index) -> (rewards, correct, errors)."""
        self.engine, self.encode, self.score = engine, encode, score
        self.sampling, self.group_size = sampling, group_size

    def generate(self, problems: list[Problem]) -> list[Episode]:
        n = self.group_size
        rollout = self.engine.generate([self.encode(p) for p in problems], n, self.sampling)
        rewards, correct, _ = self.score([problems[i // n] for i in range(len(rollout))], rollout.response_ids,
                                         rollout.group_index)  # fmt: skip
        return [
            Episode.single(prompt, response, logprobs, reason, reward, ok, rollout.adapter_version)
            for prompt, response, logprobs, reason, reward, ok in zip(
                rollout.prompt_ids, rollout.response_ids, rollout.logprobs, rollout.finish_reasons, rewards, correct
            )
        ]

    def serve(self) -> None:
        self.engine.generate([], self.group_size, self.sampling)
