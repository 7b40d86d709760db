"""T-PPO's in-flight pool: every response advances by one window of tokens per step (producer.kind windows).

Each step the pool's responses (prompt + response so far) get `producer.window` more tokens from the
current adapter (without a window: the whole response, PPO). Responses that end (eos or
rollout.max_new_tokens) are finished and leave the pool; new samples (group_size per problem) refill it
to prompts_per_step / workers x group_size. The update trains exactly this window's tokens, so each
token is trained once, by the adapter that generated it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from allsync.algorithms import InFlight, WindowAdvance, advance_window
from allsync.engines.torch_engine import Sampling
from allsync.producers.registry import ProducerContext, register_producer
from allsync.tasks import Problem, longest_prompt_tokens, model_len_needed

# (problems, responses) -> (rewards, correct, reward errors)
Rewards = Callable[[list[Problem], list[list[int]]], tuple[list[float], list[bool], int]]


@dataclass
class PartialResponse:
    """A response generated over several T-PPO windows: its tokens so far and who produced them."""

    problem: Problem
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    engine_logprobs: list[float] = field(default_factory=list)
    started_version: int = 0  # adapter version of its first window
    window_start: int = 0  # index of the first token generated in the latest window

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> "PartialResponse":
        return PartialResponse(**{**data, "problem": Problem(**data["problem"])})


@dataclass
class WindowRound:
    pool: list[PartialResponse]
    advance: WindowAdvance
    adapter_version: int
    rewards: list[float] = field(default_factory=list)  # of the finished responses, in `finished`'s order
    correct: list[bool] = field(default_factory=list)
    reward_errors: int = 0

    @property
    def finished(self) -> dict[int, str]:
        """Pool index -> finish reason of the responses that ended in this window."""
        return dict(zip(self.advance.finished_ids, self.advance.finish_reasons))


class WindowPool:
    def __init__(
        self,
        engine,
        encode: Callable[[Problem], list[int]],
        take_problems: Callable[[int], list[Problem]],
        pool_size: int,
        group_size: int,
        window: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
    ):
        self.engine, self.encode, self.take_problems = engine, encode, take_problems
        self.pool_size, self.group_size, self.window, self.max_new_tokens = (
            pool_size,
            group_size,
            window,
            max_new_tokens,
        )
        self.sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=window)
        self.in_flight: list[PartialResponse] = []  # the responses being generated
        self.waiting: list[PartialResponse] = []  # samples of problems already taken that have not started

    def start_responses(self, count: int, version: int) -> list[PartialResponse]:
        """`count` new samples (group_size per problem), taken from `waiting`, topped up from the data."""
        while len(self.waiting) < count:
            (problem,) = self.take_problems(1)
            prompt = self.encode(problem)
            self.waiting += [PartialResponse(problem, prompt) for _ in range(self.group_size)]
        started, self.waiting = self.waiting[:count], self.waiting[count:]
        for r in started:
            r.started_version = version
        return started

    def generate(self, version: int) -> WindowRound:
        """One window for every in-flight response (the pool is filled first)."""
        if not self.in_flight:
            self.in_flight = self.start_responses(self.pool_size, version)
        pool = self.in_flight
        rollout = self.engine.generate([r.prompt_ids + r.response_ids for r in pool], 1, self.sampling)
        counts, eos = [], []
        for r, tokens, logprobs, reason in zip(pool, rollout.response_ids, rollout.logprobs, rollout.finish_reasons):
            room = self.max_new_tokens - len(r.response_ids)  # the last window may hold fewer tokens
            r.window_start = len(r.response_ids)
            r.response_ids = r.response_ids + tokens[:room]
            r.engine_logprobs = r.engine_logprobs + logprobs[:room]
            counts.append(min(len(tokens), room))
            eos.append(reason == "stop" and len(tokens) <= room)
        new_ids = list(range(len(pool), len(pool) + self.pool_size))  # enough new samples to refill any pool
        advance = advance_window(
            [InFlight(i, r.window_start) for i, r in enumerate(pool)],
            counts,
            eos,
            new_ids,
            self.pool_size,
            self.window,
            self.max_new_tokens,
        )
        return WindowRound(pool, advance, rollout.adapter_version)

    @staticmethod
    def score(round_: WindowRound, rewards: Rewards) -> None:
        """The round's finished responses scored by `rewards` (the worker's reward + shaping), kept on the round."""
        done = [round_.pool[i] for i in round_.finished]
        round_.rewards, round_.correct, round_.reward_errors = rewards(
            [r.problem for r in done], [r.response_ids for r in done]
        )

    def train(self, round_: WindowRound, learner, version: int) -> dict:
        """The update on exactly this window's tokens (the learner's window batch: EGAE / GAE over the pool);
        returns the step's metric sums. A continuing response's earlier windows came from older adapters: that
        context staleness is reported as staleness_max."""
        finished, responses = round_.finished, round_.pool
        done = [responses[i] for i in finished]
        batch = learner.window_batch(
            [r.prompt_ids for r in responses],
            [r.response_ids for r in responses],
            [r.window_start for r in responses],
            finished,
            dict(zip(finished, round_.rewards)),
            [r.engine_logprobs for r in responses],
        )
        metrics = learner.update(batch, version)
        metrics.update(
            {
                "samples_generated": len(done),
                "reward_sum": sum(round_.rewards),
                "correct_sum": sum(round_.correct),
                "response_tokens": sum(len(r.response_ids) for r in done),
                "truncated": sum(reason == "length" for reason in finished.values()),
                "staleness_max": max(version - r.started_version for r in responses),
                "continuing": len(round_.advance.continuing_ids),
                "groups_generated": 0,
                "groups_kept": 0,
                "groups_wanted": 0,
                "sampling_cap_hits": 0,
                "sampling_rounds": 1,
                "reward_errors": round_.reward_errors,
            }
        )
        return metrics

    def refill(self, round_: WindowRound, version: int) -> None:
        """Keep the continuing responses and start new ones in place of the finished."""
        continuing = [round_.pool[i] for i in round_.advance.continuing_ids]
        self.in_flight = continuing + self.start_responses(len(round_.advance.refilled_ids), version)

    def to_json(self) -> dict:
        return {"in_flight": [r.to_json() for r in self.in_flight], "waiting": [r.to_json() for r in self.waiting]}

    def load_json(self, data: dict) -> None:
        self.in_flight = [PartialResponse.from_json(r) for r in data["in_flight"]]
        self.waiting = [PartialResponse.from_json(r) for r in data["waiting"]]


@register_producer
@dataclass
class WindowsSettings:
    """producer.kind windows: PPO with a critic over in-flight responses; `window` tokens per step (T-PPO, with
    algorithm.advantage egae), or None for whole responses (PPO, gae)."""

    kind: str = field(default="windows", init=False)
    logs_episode_info: ClassVar[bool] = False
    window: int | None = None  # tokens generated per step for every in-flight response; None: to the end

    def check(self, fail) -> None:
        if self.window is not None and self.window < 1:
            fail(f"producer.window = {self.window}: must be >= 1 (or left out for whole responses)")

    def check_with(self, config, fail) -> None:
        a, r = config.algorithm, config.rollout
        if not a.estimator.needs_critic:
            fail(
                f"producer.kind windows with algorithm.advantage {a.advantage}: in-flight responses are trained with a "
                "critic's values; use gae (whole responses) or egae (T-PPO windows)"
            )
        if self.window is not None and self.window > r.max_new_tokens:
            fail(f"producer.window = {self.window}: must be in 1..rollout.max_new_tokens ({r.max_new_tokens})")
        if a.estimator.bootstraps_cut and self.window is None:
            fail(f"algorithm.advantage {a.advantage} needs producer.window (T-PPO's truncated generation windows)")
        if self.window is not None and not a.estimator.bootstraps_cut:
            fail(
                f"producer.window = {self.window} with algorithm.advantage {a.advantage}: responses cut at a window have "
                "no reward yet; T-PPO bootstraps them from the critic, so use algorithm.advantage egae"
            )

    def build(self, context: ProducerContext) -> WindowPool:
        r = context.config.rollout
        return WindowPool(
            context.engine,
            context.encode_prompt,
            context.take_problems,
            context.samples_per_step,
            r.group_size,
            self.window or r.max_new_tokens,
            r.max_new_tokens,
            r.temperature,
            r.top_p,
        )

    def model_len(self, config, tokenizer, problems: list[Problem], max_position_embeddings: int) -> int:
        """A window's prompt is the prompt plus the response so far: longest prompt + rollout.max_new_tokens."""
        return model_len_needed(
            longest_prompt_tokens(tokenizer, problems), config.rollout.max_new_tokens, max_position_embeddings
        )
