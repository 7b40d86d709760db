"""Dynamic sampling's rounds streamed through the torch engine's KV slots (algorithm.sampling_rounds: streamed).

Sequential rounds (allsync.producers.groups.collect_groups) start round j + 1 only after every row of round j has
ended, so the slots idle through each round's long tail, once per round. Streamed, round j + 1's rows wait in the
engine's queue behind round j's and take slots as round j's rows end (allsync.engines.slots.RowSource); a round is
scored as soon as its last row ends, and the stream stops once the rounds that have ended decide the batch:

    worker filling    rounds 0..c have ended and keep the worker's quota, or c + 1 = algorithm.max_sampling_rounds
    global filling    every worker's rounds 0..c have ended and together keep the workers' quotas, or every worker's
                      max_sampling_rounds rounds have ended (one all-reduce per iteration of the engine's loop)

Rows of later rounds still in the slots or the queue are dropped (`samples_dropped`). The batch is the one
sequential rounds make (the same fill_batch_with_dynamic_sampling over the same rounds): each round takes its
problems and draws its seeds in the order a sequential round would, a row's tokens depend on its prompt, its seed and
the weights only, and the rounds begun but not needed are given back (the worker's problem stream and torch's
generator rewound to where the last needed round left them), so the next step starts where sequential rounds' would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from allsync.algorithms import DynamicSamplingExhausted, fill_batch_with_dynamic_sampling
from allsync.algorithms.dynamic_sampling import keep_groups
from allsync.engines.torch_engine import draw_seeds
from allsync.episodes import Episode
from allsync.producers.groups import group_batch, kept_counts


@dataclass
class StreamRound:
    """One round of the stream: its problems, its rows [first, first + size), their results as they end."""

    problems: list
    first: int
    size: int
    rewind: object  # the context's rewind point after this round took its problems and seeds
    results: dict[int, tuple[list[int], str]] = field(default_factory=dict)  # row -> (tokens, finish reason)
    scores: tuple | None = None  # (rewards, correct) of its rows, once every row has ended
    kept: int = 0  # groups dynamic sampling keeps


class StreamedRounds:
    """A RowSource (allsync.engines.slots) of one step's rounds, and the batch they make (module docstring).

    producer: allsync.producers.single_turn.SingleTurn (encode, score, sampling, group_size); context: the
    ProducerContext (take_problems, rewind_point, groups, config)."""

    def __init__(self, producer, context, groups_wanted: int):
        self.producer, self.context, self.quota = producer, context, groups_wanted
        a = context.config.algorithm
        self.max_rounds, self.filter_metric, self.fill = a.max_sampling_rounds, a.filter_metric, a.sampling_fill
        self.rounds: list[StreamRound] = []
        self.capacity = context.longest_prompt() + producer.sampling.max_new_tokens
        self.most_rows = self.max_rounds * groups_wanted * producer.group_size

    # ---------------------------------------------------------------------------------------- RowSource
    def more(self, waiting: int, free: int) -> tuple[list[list[int]], torch.Tensor]:
        """The next round's rows once the queue holds fewer rows than free slots (at most max_sampling_rounds)."""
        if waiting >= free or len(self.rounds) == self.max_rounds:
            return [], torch.zeros(0, dtype=torch.int64)
        problems = self.context.take_problems(self.quota)
        rows = [prompt for p in problems for prompt in [self.producer.encode(p)] * self.producer.group_size]
        seeds = draw_seeds(len(rows))
        first = self.rounds[-1].first + self.rounds[-1].size if self.rounds else 0
        self.rounds.append(StreamRound(problems, first, len(rows), self.context.rewind_point()))
        return rows, seeds

    def ended(self, rows: list[int], result) -> None:
        """Each row's result kept in its round; a round whose rows have all ended is scored."""
        size = self.rounds[0].size  # every round holds quota x group_size rows
        for row in rows:
            stream_round = self.rounds[row // size]
            stream_round.results[row] = result(row)
            if len(stream_round.results) == stream_round.size:
                self.score(stream_round)

    def stopped(self) -> bool:
        """Whether the rounds that have ended decide the batch (module docstring)."""
        done = self.ended_rounds()
        if self.fill == "worker":
            return sum(r.kept for r in self.rounds[:done]) >= self.quota or done == self.max_rounds
        m = self.max_rounds
        state = torch.zeros(1 + 2 * m, dtype=torch.int64)
        state[0] = self.quota
        state[1 : 1 + done] = torch.tensor([r.kept for r in self.rounds[:done]], dtype=torch.int64)
        state[1 + m : 1 + m + done] = 1
        total = self.context.groups.all_reduce(state).tolist()
        world = self.context.groups.world_size
        wanted, kept, everywhere = total[0], total[1 : 1 + m], [n == world for n in total[1 + m :]]
        cumulative = 0
        for j in range(m):
            if not everywhere[j]:
                return False
            cumulative += kept[j]
            if cumulative >= wanted:
                return True
        return True  # every worker's max_sampling_rounds rounds have ended

    # ---------------------------------------------------------------------------------------- the step's batch
    def ended_rounds(self) -> int:
        """Rounds 0..c - 1 have all ended and been scored: c."""
        return next((j for j, r in enumerate(self.rounds) if r.scores is None), len(self.rounds))

    def score(self, stream_round: StreamRound) -> None:
        n = self.producer.group_size
        rows = range(stream_round.first, stream_round.first + stream_round.size)
        responses = [stream_round.results[r][0] for r in rows]
        problems = [stream_round.problems[i // n] for i in range(stream_round.size)]
        rewards, correct, _ = self.producer.score(problems, responses, [i // n for i in range(stream_round.size)])
        stream_round.scores = (rewards, correct)
        metric = torch.tensor([float(c) if self.filter_metric == "acc" else r for r, c in zip(rewards, correct)])
        group_index = torch.arange(stream_round.size) // n
        stream_round.kept = int(torch.unique(group_index[keep_groups(metric, group_index)]).numel())

    def episodes(self, stream_round: StreamRound, rollout) -> list[Episode]:
        """The round's episodes from the streamed call's rollout and the round's scores."""
        rows = range(stream_round.first, stream_round.first + stream_round.size)
        rewards, correct = stream_round.scores
        routing = rollout.routing or [None] * len(rollout)
        return [
            Episode.single(
                rollout.prompt_ids[r],
                rollout.response_ids[r],
                rollout.logprobs[r],
                rollout.finish_reasons[r],
                reward,
                ok,
                rollout.adapter_version,
                routing[r],
            )
            for r, reward, ok in zip(rows, rewards, correct)
        ]


def collect_streamed(producer, context, groups_wanted: int) -> tuple[list[Episode], dict]:
    """What allsync.producers.groups.collect_groups returns, from one streamed generate call (module docstring):
    the kept episodes and the round's statistics, `samples_dropped` among them (rows of rounds not needed)."""
    a = context.config.algorithm
    stream = StreamedRounds(producer, context, groups_wanted)
    rollout = producer.engine.generate_streamed(stream, producer.group_size, producer.sampling)
    batches = [
        group_batch(stream.episodes(r, rollout), producer.group_size, a.filter_metric)
        for r in stream.rounds[: stream.ended_rounds()]
    ]
    base = {"groups_wanted": groups_wanted, "sampling_cap_hits": 0}
    share = kept_counts(context.groups) if a.sampling_fill == "global" else None
    try:
        batch, stats = fill_batch_with_dynamic_sampling(
            lambda j: batches[j], groups_wanted, a.max_sampling_rounds, share
        )
        rounds, groups_generated = stats.rounds, stats.groups_generated
    except DynamicSamplingExhausted as exc:
        if a.on_sampling_cap == "error":
            raise RuntimeError(
                f"worker {context.groups.rank}: {exc} (algorithm.on_sampling_cap: error; partial trains on the groups "
                "kept)"
            ) from exc
        batch, rounds, groups_generated = exc.kept, exc.rounds_run, exc.groups_generated
        base["sampling_cap_hits"] = 1
    stream.rounds[rounds - 1].rewind()  # the rounds begun after the last needed one go back
    used = stream.rounds[:rounds]
    return batch.payloads, {
        **base,
        "groups_generated": groups_generated,
        "sampling_rounds": rounds,
        "groups_kept": batch.num_groups,
        "generated": [e for b in batches[:rounds] for e in b.payloads],
        "group_index": batch.group_index,
        "samples_dropped": len(rollout) - sum(r.size for r in used),
    }
