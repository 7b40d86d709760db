"""Single-turn groups: each problem's prompt answered group_size times; each answer is a one-segment episode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from allsync.episodes import Episode
from allsync.engines.torch_engine import Sampling
from allsync.producers.groups import GroupRounds
from allsync.producers.registry import ProducerContext, ProducerDefaults, refuse_memory_ablation, register_producer
from allsync.producers.streamed import collect_streamed
from allsync.tasks import Problem, longest_prompt_tokens, model_len_needed


class SingleTurn:
    def __init__(self, engine, encode, score, sampling: Sampling, group_size: int):
        """encode(problem) -> prompt ids; score(problems, responses, group_index) -> (rewards, correct, errors)."""
        self.engine, self.encode, self.score = engine, encode, score
        self.sampling, self.group_size = sampling, group_size

    def generate(self, problems: list[Problem]) -> list[Episode]:
        n = self.group_size
        rollout = self.engine.generate([self.encode(p) for p in problems], n, self.sampling)
        rewards, correct, _ = self.score(
            [problems[i // n] for i in range(len(rollout))], rollout.response_ids, rollout.group_index
        )
        routing = rollout.routing or [None] * len(rollout)
        return [
            Episode.single(prompt, response, logprobs, reason, reward, ok, rollout.adapter_version, experts)
            for prompt, response, logprobs, reason, reward, ok, experts in zip(
                rollout.prompt_ids,
                rollout.response_ids,
                rollout.logprobs,
                rollout.finish_reasons,
                rewards,
                correct,
                routing,
            )
        ]

    def evaluate(self, problems, problem_ids, samples, sampling, memory, score_answers) -> list:
        answers = engine_answers(self.engine, self.encode, problems, samples, sampling, memory)
        return score_answers(problems, problem_ids, samples, answers)


def engine_answers(
    engine, encode, problems: list[Problem], n: int, sampling: Sampling, memory: str = "own"
) -> list[tuple[list[int], str]]:
    """n answers per problem to its prompt, each (response ids, finish reason). `memory` other than own (the memory
    ablation) is refused: a single-turn answer carries no memory."""
    refuse_memory_ablation(memory)
    rollout = engine.generate([encode(p) for p in problems], n, sampling)
    return list(zip(rollout.response_ids, rollout.finish_reasons))


@register_producer
@dataclass
class SingleTurnSettings(ProducerDefaults):
    """producer.kind single_turn (the default): each problem's prompt answered rollout.group_size times."""

    kind: str = field(default="single_turn", init=False)
    streams_rounds: ClassVar[bool] = True
    carries_routing: ClassVar[bool] = True

    def check(self, fail) -> None:
        pass

    def check_with(self, config, fail) -> None:
        a = config.algorithm
        if a.estimator.needs_critic:
            fail(
                f"algorithm.advantage {a.advantage} learns a critic, which trains on windows of in-flight responses: "
                "use producer: {kind: windows} (producer.window: N for T-PPO, none for whole responses)"
            )

    def build(self, context: ProducerContext) -> GroupRounds:
        r = context.config.rollout
        producer = SingleTurn(
            context.engine, context.encode_prompt, context.score, Sampling.for_training(r), r.group_size
        )
        streamed = context.config.algorithm.sampling_rounds == "streamed"
        return GroupRounds(producer, context, collect_streamed if streamed else None)

    def model_len(self, config, tokenizer, problems: list[Problem], max_position_embeddings: int) -> int:
        """Longest prompt + rollout.max_new_tokens."""
        return model_len_needed(
            longest_prompt_tokens(tokenizer, problems), config.rollout.max_new_tokens, max_position_embeddings
        )
