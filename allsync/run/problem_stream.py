"""A worker's stride through the shared train split: worker r of W takes problems r, r + W, r + 2W, ... in turn."""

from __future__ import annotations

import torch

from allsync.tasks import Problem, longest_prompt_tokens


class ProblemStream:
    def __init__(self, problems: list[Problem], rank: int, world_size: int, tokenizer):
        self.problems, self.rank, self.world_size, self.tokenizer = problems, rank, world_size, tokenizer
        self.position = 0  # prompts taken so far by this worker (the data position a checkpoint keeps)
        self._longest_prompt: int | None = None

    def take_problems(self, count: int) -> list[Problem]:
        """The next `count` training problems of this worker's stride through the shared train split."""
        n = len(self.problems)
        picked = [self.problems[((self.position + i) * self.world_size + self.rank) % n] for i in range(count)]
        self.position += count
        return picked

    def rewind_point(self):
        """A function that puts take_problems' position and torch's generator back where they are now."""
        position, generator = self.position, torch.get_rng_state()

        def rewind() -> None:
            self.position = position
            torch.set_rng_state(generator)

        return rewind

    def longest_prompt(self) -> int:
        """The most prompt tokens of any training problem (what a streamed call's KV slots must hold besides the
        response), counted once."""
        if self._longest_prompt is None:
            self._longest_prompt = longest_prompt_tokens(self.tokenizer, self.problems)
        return self._longest_prompt
