"""The producer registry: a run's `producer:` section names how episodes are made (`producer.kind`), and the module
of that producer registers the settings class that holds the section's other keys.

A producer's settings class is a dataclass whose fields are its YAML keys (plus `kind`, a field with init=False
whose default is the producer's name), registered with `@register_producer`. It provides:

    check(fail)                          refuse a bad value of its own keys, naming the key
    check_with(config, fail)             the rules that tie it to the rest of the config (estimator, task, ...)
    build(context) -> producer           the producer a worker runs (context: ProducerContext; see `Producer`)
    model_len(config, tokenizer, problems, max_position_embeddings) -> int
                                         the longest sequence it builds, which the rollout engine must hold
    logs_episode_info: bool              (class attribute) its episodes' info (segments, turns, ...) is logged

and, from `ProducerDefaults` (which a settings class subclasses, overriding what differs), what the rest of the loop
asks of it instead of naming it: the policy loss's aggregation, which rows' tokens train, the per-segment logprob
gaps, the held-out memory ablations, tools in the warm start, streamed rounds and the engine's expert record.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

PRODUCERS: dict[str, type] = {}
DEFAULT_PRODUCER = "single_turn"


@dataclass
class ProducerContext:
    """What a worker hands a producer: its engine, its tokenizer and its view of the data and the reward."""

    config: Any  # the run's RunConfig
    engine: Any  # allsync.engines: generate, agreed_rounds (expert parallelism), load_adapter
    tokenizer: Any
    encode_prompt: Callable  # problem -> prompt ids
    take_problems: Callable  # count -> the next problems of this worker's share
    score: Callable  # (problems, responses, group_index or None) -> (rewards, correct, reward errors)
    samples_per_step: int  # this worker's samples per step (prompts_per_step / workers x group_size)
    groups: Any = (
        None  # allsync.distributed.process_groups.Groups: rank, world size, the all-reduce dynamic sampling fills with
    )
    # () -> a function that puts take_problems' position and torch's generator back where they are now (streamed
    # rounds give back the rounds they began but did not need: allsync/producers/streamed.py)
    rewind_point: Callable | None = None
    longest_prompt: Callable | None = None  # () -> the most prompt tokens of any problem take_problems can give


class Producer(Protocol):
    """What a worker's step and evaluation call on the producer `build` returns. A producer of episode groups
    (generate(problems) -> group_size episodes per problem) gets all of it from allsync.producers.groups.GroupRounds.

        collect(groups_wanted, version) -> (episodes, group_index, stats)
            the episodes to train with adapter `version` (each segment's adapter_version is the one that made its
            trained tokens), each one's group, and the round's counts: `generated` (the episodes finished this
            round, whose rewards are reported), groups_* / sampling_* (dynamic sampling); any other key overrides
            the worker's own count of that name (T-PPO reports staleness_max and continuing)
        trained(version)                      the update made adapter `version`
        evaluate(problems, problem_ids, samples, sampling, memory, score_answers) -> [evals.report.SampleRecord]
            the held-out records; score_answers(problems, problem_ids, n, [(response ids, finish reason)]) scores
            answers with the run's reward
        state_dict() -> dict / load_state_dict(state)   what a checkpoint keeps besides the adapter (JSON)
        close()
    """

    def collect(self, groups_wanted: int, version: int) -> tuple[list, Any, dict]: ...

    def trained(self, version: int) -> None: ...

    def evaluate(self, problems: list, problem_ids: list[int], samples: int, sampling, memory: str, score_answers): ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class ProducerDefaults:
    """What the learner, the warm start and the config checks ask of a producer's settings, answered for a producer of
    one-segment episodes without tools; a settings class subclasses it and overrides what differs.

    logs_episode_info: its episodes' info (segments, turns, ...) is logged.
    reports_segment_gaps: the engine/trainer logprob gap is reported per segment kind (logprob_gap_<kind>).
    memory_ablations: the memories the held-out answers are also scored with at the end of a run
        (heldout_accuracy_<memory>_memory), besides the episode's own.
    uses_tools: the warm start adds tool-call tokens, teaches the task's tool calls with these settings and
        evaluates with rollout.max_new_tokens.
    streams_rounds: algorithm.sampling_rounds streamed can run it (one generate call per episode).
    carries_routing: its episodes carry the engine's experts to the trainer (algorithm.routing_replay).
    """

    logs_episode_info: ClassVar[bool] = False
    reports_segment_gaps: ClassVar[bool] = False
    memory_ablations: ClassVar[tuple[str, ...]] = ()
    uses_tools: ClassVar[bool] = False
    streams_rounds: ClassVar[bool] = False
    carries_routing: ClassVar[bool] = False

    def loss_aggregation(self, loss_agg: str) -> str:
        """The aggregation of the policy loss (allsync.algorithms.aggregation): algorithm.loss_agg."""
        return loss_agg

    def trained_mask(self, response_mask, is_answer):
        """Which of the batch's response tokens train ([B, T]; is_answer [B] bool: the row is an episode's answer
        segment): all of them."""
        return response_mask


class ProducerSettings(Protocol):
    kind: str
    logs_episode_info: bool

    def check(self, fail) -> None: ...

    def check_with(self, config, fail) -> None: ...

    def build(self, context: ProducerContext): ...

    def model_len(self, config, tokenizer, problems: list, max_position_embeddings: int) -> int: ...


def refuse_memory_ablation(memory: str) -> None:
    """Held-out evaluation with another memory than the episode's own (the memory ablation, "blank" / "gold") is
    refused by producers whose episodes carry no memory."""
    if memory != "own":
        raise ValueError(
            f"memory {memory!r}: only multi-conversation episodes (producer.kind multiconv) carry a memory"
        )


def register_producer(cls: type) -> type:
    """Class decorator: `cls.kind` becomes a value of producer.kind."""
    if cls.kind in PRODUCERS:
        raise ValueError(
            f"producer {cls.kind!r} is registered twice ({PRODUCERS[cls.kind].__module__} and {cls.__module__})"
        )
    PRODUCERS[cls.kind] = cls
    return cls


def producer_classes() -> dict[str, type]:
    """The registry after every module of allsync/producers/ was imported (each registers its settings class;
    imported on first use, so reading a config does not load the engines)."""
    package = importlib.import_module("allsync.producers")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"allsync.producers.{module.name}")
    return PRODUCERS


def default_producer():
    return producer_classes()[DEFAULT_PRODUCER]()
