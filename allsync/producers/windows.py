"""T-PPO's in-flight pool: every response advances by one window of tokens per step (producer.kind windows).

Each step the pool's responses (prompt + response so far) get `producer.window` more tokens from the
current adapter (without a window: the whole response, PPO). Responses that end (eos or
rollout.max_new_tokens) are finished and leave the pool; new samples (group_size per problem) refill it
to prompts_per_step / workers x group_size. Each step's episodes are the pool's responses so far, their loss masks on
this window's tokens (finish reason "window" while they go on), so the update (allsync/update/learner.py's critic batch)
trains each token once, by the adapter that generated it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from allsync.algorithms import InFlight, WindowAdvance, advance_window, estimators_that
from allsync.engines.torch_engine import Sampling
from allsync.episodes import Episode, Segment
from allsync.producers.registry import ProducerContext, ProducerDefaults, register_producer
from allsync.producers.single_turn import engine_answers
from allsync.tasks import Problem, longest_prompt_tokens, model_len_needed


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

    def episode(self, finish_reason: str, reward: float, correct: bool, version: int) -> Episode:
        """The response so far as a one-segment episode whose loss mask trains only the latest window's tokens
        (made by adapter `version`); finish_reason "window" while it goes on (no reward yet: the critic bootstraps)."""
        mask = [0] * self.window_start + [1] * (len(self.response_ids) - self.window_start)
        segment = Segment(
            self.prompt_ids, self.response_ids, self.engine_logprobs, finish_reason, "answer", version, mask
        )
        return Episode([segment], reward, correct)


class WindowPool:
    """The worker's producer (allsync.producers.registry.Producer) for producer.kind windows."""

    def __init__(
        self,
        engine,
        encode: Callable[[Problem], list[int]],
        take_problems: Callable[[int], list[Problem]],
        score: Callable,
        pool_size: int,
        group_size: int,
        window: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
    ):
        """score(problems, responses, None) -> (rewards, correct, errors): the worker's reward and shaping."""
        self.engine, self.encode, self.take_problems, self.score = engine, encode, take_problems, score
        self.pool_size, self.group_size, self.window, self.max_new_tokens = (
            pool_size,
            group_size,
            window,
            max_new_tokens,
        )
        self.sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=window)
        self.in_flight: list[PartialResponse] = []  # the responses being generated
        self.waiting: list[PartialResponse] = []  # samples of problems already taken that have not started
        self.advance: WindowAdvance | None = None  # the last window's outcome, until the update that trains it

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

    def generate(self, version: int) -> WindowAdvance:
        """One window for every in-flight response (the pool is filled first)."""
        if not self.in_flight:
            self.in_flight = self.start_responses(self.pool_size, version)
        pool = self.in_flight
        # keep: a response cut at this window continues next step from its cached positions if the policy has not
        # moved in between (the torch engine; value pretraining), else it is prefilled again (on-policy)
        rollout = self.engine.generate([r.prompt_ids + r.response_ids for r in pool], 1, self.sampling, keep=True)
        counts, eos = [], []
        for r, tokens, logprobs, reason in zip(pool, rollout.response_ids, rollout.logprobs, rollout.finish_reasons):
            room = self.max_new_tokens - len(r.response_ids)  # the last window may hold fewer tokens
            r.window_start = len(r.response_ids)
            r.response_ids = r.response_ids + tokens[:room]
            r.engine_logprobs = r.engine_logprobs + logprobs[:room]
            counts.append(min(len(tokens), room))
            eos.append(reason == "stop" and len(tokens) <= room)
        new_ids = list(range(len(pool), len(pool) + self.pool_size))  # enough new samples to refill any pool
        return advance_window(
            [InFlight(i, r.window_start) for i, r in enumerate(pool)],
            counts,
            eos,
            new_ids,
            self.pool_size,
            self.window,
            self.max_new_tokens,
        )

    def collect(self, groups_wanted: int, version: int) -> tuple[list[Episode], torch.Tensor, dict]:
        """Every in-flight response as an episode after one more window (`PartialResponse.episode`), the finished
        ones scored. A continuing response's earlier windows came from older adapters: that context staleness is
        reported as staleness_max."""
        self.advance = self.generate(version)
        pool, finished = self.in_flight, dict(zip(self.advance.finished_ids, self.advance.finish_reasons))
        done = [pool[i] for i in finished]
        rewards, correct, _ = self.score([r.problem for r in done], [r.response_ids for r in done], None)
        outcome = {i: (reason, reward, ok) for (i, reason), reward, ok in zip(finished.items(), rewards, correct)}
        episodes = [r.episode(*outcome.get(i, ("window", 0.0, False)), version) for i, r in enumerate(pool)]
        stats = {
            "generated": [episodes[i] for i in finished],
            "staleness_max": max(version - r.started_version for r in pool),
            "continuing": len(self.advance.continuing_ids),
            "groups_generated": 0,
            "groups_kept": 0,
            "groups_wanted": 0,
            "sampling_cap_hits": 0,
            "sampling_rounds": 1,
        }
        return episodes, torch.arange(len(episodes)), stats

    def trained(self, version: int) -> None:
        """Keep the continuing responses and start new ones, by adapter `version`, in place of the finished."""
        continuing = [self.in_flight[i] for i in self.advance.continuing_ids]
        self.in_flight = continuing + self.start_responses(len(self.advance.refilled_ids), version)
        self.advance = None

    def evaluate(self, problems, problem_ids, samples, sampling, memory, score_answers) -> list:
        """Whole responses to the held-out prompts (not windows), scored."""
        answers = engine_answers(self.engine, self.encode, problems, samples, sampling, memory)
        return score_answers(problems, problem_ids, samples, answers)

    def state_dict(self) -> dict:
        return {"in_flight": [r.to_json() for r in self.in_flight], "waiting": [r.to_json() for r in self.waiting]}

    def load_state_dict(self, state: dict) -> None:
        self.in_flight = [PartialResponse.from_json(r) for r in state["in_flight"]]
        self.waiting = [PartialResponse.from_json(r) for r in state["waiting"]]

    def close(self) -> None:
        pass


@register_producer
@dataclass
class WindowsSettings(ProducerDefaults):
    """producer.kind windows: PPO with a critic over in-flight responses; `window` tokens per step (T-PPO, with
    algorithm.advantage egae), or None for whole responses (PPO, gae)."""

    kind: str = field(default="windows", init=False)
    window: int | None = None  # tokens generated per step for every in-flight response; None: to the end

    def check(self, fail) -> None:
        if self.window is not None and self.window < 1:
            fail(f"producer.window = {self.window}: must be >= 1 (or left out for whole responses)")

    def check_with(self, config, fail) -> None:
        a, r = config.algorithm, config.rollout
        if not a.estimator.needs_critic:
            fail(
                f"producer.kind windows with algorithm.advantage {a.advantage}: in-flight responses are trained with a "
                f"critic's values; use {estimators_that(needs_critic=True, bootstraps_cut=False)} (whole responses) or "
                f"{estimators_that(bootstraps_cut=True)} (T-PPO windows)"
            )
        if self.window is not None and self.window > r.max_new_tokens:
            fail(f"producer.window = {self.window}: must be in 1..rollout.max_new_tokens ({r.max_new_tokens})")
        if a.estimator.bootstraps_cut and self.window is None:
            fail(f"algorithm.advantage {a.advantage} needs producer.window (T-PPO's truncated generation windows)")
        if self.window is not None and not a.estimator.bootstraps_cut:
            fail(
                f"producer.window = {self.window} with algorithm.advantage {a.advantage}: responses cut at a window have "
                f"no reward yet; T-PPO bootstraps them from the critic, so use algorithm.advantage "
                f"{estimators_that(bootstraps_cut=True)}"
            )

    def build(self, context: ProducerContext) -> WindowPool:
        r = context.config.rollout
        return WindowPool(
            context.engine,
            context.encode_prompt,
            context.take_problems,
            context.score,
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
