"""DAPO's dynamic sampling around any producer of episode groups (`GroupRounds`).

A group producer's `generate(problems)` returns group_size episodes per problem, episode i of problem i //
group_size; called with no problems it runs the engine calls with nothing of its own (under expert parallelism
a rank whose batch is full still joins the other ranks' generation rounds, because their MoE layers need its
experts: the engine's lockstep and agreed_rounds make such a call match the others'). Its
`evaluate(problems, problem_ids, samples, sampling, memory, score_answers)` gives the held-out records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from allsync.algorithms import DynamicSamplingExhausted, GroupBatch, fill_batch_with_dynamic_sampling
from allsync.episodes import Episode
from allsync.tasks import Problem


def group_batch(episodes: list[Episode], group_size: int, filter_metric: str) -> GroupBatch:
    """The episodes as groups; the metric dynamic sampling filters on is correctness (acc, as DAPO and
    verl) or the shaped reward (reward)."""
    metric = filter_values([e.correct for e in episodes], [e.reward for e in episodes], filter_metric)
    return GroupBatch(torch.arange(len(episodes)) // group_size, metric, episodes)


def filter_values(correct: list[bool], rewards: list[float], filter_metric: str) -> torch.Tensor:
    """Per sample, what algorithm.filter_metric filters on: correctness (acc) or the shaped reward (reward)."""
    return torch.tensor([float(c) if filter_metric == "acc" else r for c, r in zip(correct, rewards)])


def kept_counts(groups) -> Callable[[int], tuple[list[int], int]]:
    """Global filling's `share` (allsync.algorithms.fill_batch_with_dynamic_sampling): every worker's count, by one
    all-reduce of a vector holding this worker's in its rank's slot."""

    def share(count: int) -> tuple[list[int], int]:
        counts = torch.zeros(groups.world_size, dtype=torch.int64)
        counts[groups.rank] = count
        return groups.all_reduce(counts).tolist(), groups.rank

    return share


def collect_groups(
    producer,
    take_problems: Callable[[int], list[Problem]],
    groups_wanted: int,
    algorithm,
    groups,
    group_size: int,
    rank: int,
) -> tuple[list[Episode], dict]:
    """Generate `groups_wanted` groups; with algorithm.dynamic_sampling keep groups whose filter metric
    varies and refill (DAPO). At algorithm.max_sampling_rounds the groups kept so far are trained on
    (on_sampling_cap partial), or the step fails (error). Returns the kept episodes and the round's
    statistics, among them `generated` (every episode generated) and `group_index` (of the kept ones).
    algorithm.sampling_fill global: the workers fill the whole batch together (every worker runs the rounds the
    workers need together, and may keep more or fewer than its quota); worker: each fills its own quota."""
    a = algorithm
    base = {"groups_wanted": groups_wanted, "sampling_cap_hits": 0}
    generated: list[Episode] = []

    def round_fn(_round: int) -> GroupBatch:
        if groups.lockstep:
            groups.max_over_ranks(1)  # "I generate another round" (see serve_rounds)
        batch = group_batch(producer.generate(take_problems(groups_wanted)), group_size, a.filter_metric)
        generated.extend(batch.payloads)
        return batch

    if not a.dynamic_sampling:
        batch = group_batch(producer.generate(take_problems(groups_wanted)), group_size, a.filter_metric)
        return batch.payloads, {
            **base,
            "groups_generated": groups_wanted,
            "sampling_rounds": 1,
            "groups_kept": groups_wanted,
            "generated": list(batch.payloads),
            "group_index": batch.group_index,
        }
    try:
        batch, stats = fill_groups(round_fn, groups_wanted, a, groups, rank)
    finally:
        serve_rounds(producer, groups)
    return batch.payloads, stats | {"generated": generated}


def fill_groups(round_fn, groups_wanted: int, algorithm, groups, rank: int) -> tuple[GroupBatch, dict]:
    """Dynamic sampling over round_fn(j) (fill_batch_with_dynamic_sampling, the workers' kept counts shared with
    global filling): the kept batch and the round's statistics but `generated`. At algorithm.max_sampling_rounds the
    groups kept so far (on_sampling_cap partial, `sampling_cap_hits` 1), or the step fails (error)."""
    a = algorithm
    cap_hits = 0
    try:
        share = kept_counts(groups) if a.sampling_fill == "global" else None
        batch, stats = fill_batch_with_dynamic_sampling(round_fn, groups_wanted, a.max_sampling_rounds, share)
        rounds, groups_generated = stats.rounds, stats.groups_generated
    except DynamicSamplingExhausted as exc:
        if a.on_sampling_cap == "error":
            raise RuntimeError(
                f"worker {rank}: {exc} (algorithm.on_sampling_cap: error; partial trains on the groups kept)"
            ) from exc
        batch, rounds, groups_generated, cap_hits = exc.kept, exc.rounds_run, exc.groups_generated, 1
    return batch, {
        "groups_wanted": groups_wanted,
        "sampling_cap_hits": cap_hits,
        "groups_generated": groups_generated,
        "sampling_rounds": rounds,
        "groups_kept": batch.num_groups,
        "group_index": batch.group_index,
    }


def serve_rounds(producer, groups) -> None:
    """Ranks in lockstep (expert parallelism, in the trainer's engine or in vLLM's): a rank whose batch is full
    keeps joining the generation rounds of ranks that are still refilling, with nothing of its own, until every
    rank is done. Each round every rank calls max_over_ranks once: 1 from a rank that generates, 0 from here."""
    if not groups.lockstep:
        return
    while groups.max_over_ranks(0):
        producer.generate([])


class GroupRounds:
    """The worker's producer (allsync.producers.registry.Producer) for a producer of episode groups: each step
    collects the groups wanted with the run's dynamic sampling (`collect_groups`); keeps no state between steps."""

    def __init__(self, producer: Any, context: Any, collect_rounds: Callable | None = None):
        """producer: the episode-group producer, whose contract is
            generate(problems: list[Problem]) -> list[Episode]
                rollout.group_size episodes per problem, problem by problem (episodes[i * n:(i + 1) * n] answer
                problems[i]; they are one group), each with its reward and correctness already scored (context.score)
                and each segment's engine logprobs and adapter_version (the engine's rollout.adapter_version);
                called once per sampling round with that round's problems (context.take_problems)
            evaluate(problems, problem_ids, samples, sampling, memory, score_answers) -> [evals.report.SampleRecord]
                `samples` answers per held-out problem, scored by score_answers(problems, problem_ids, samples,
                [(response ids, finish reason)]); memory other than "own" refused unless its episodes carry one
            close() (optional)
        (allsync.producers.single_turn.SingleTurn is the smallest; tests/fixtures/hinted_turn.py builds one from
        outside the package); context: the ProducerContext; collect_rounds(producer, context, groups_wanted) -> what
        collect_groups returns, in its place (None: collect_groups; allsync.producers.streamed.collect_streamed for
        algorithm.sampling_rounds streamed). A group is whole on the worker that generated it: dynamic sampling keeps
        or drops whole groups, and balancing moves rows only after the advantages are computed."""
        self.producer, self.context, self.collect_rounds = producer, context, collect_rounds

    def collect(self, groups_wanted: int, version: int) -> tuple[list[Episode], torch.Tensor, dict]:
        c = self.context
        if self.collect_rounds is not None:
            episodes, stats = self.collect_rounds(self.producer, c, groups_wanted)
            return episodes, stats.pop("group_index"), stats
        episodes, stats = collect_groups(
            self.producer,
            c.take_problems,
            groups_wanted,
            c.config.algorithm,
            c.groups,
            c.config.rollout.group_size,
            c.groups.rank,
        )
        return episodes, stats.pop("group_index"), stats

    def trained(self, version: int) -> None:
        pass

    def evaluate(self, problems, problem_ids, samples, sampling, memory, score_answers) -> list:
        return self.producer.evaluate(problems, problem_ids, samples, sampling, memory, score_answers)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        if hasattr(self.producer, "close"):
            self.producer.close()
