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

from allsync.algorithms.dynamic_sampling import keep_groups
from allsync.engines.torch_engine import draw_seeds
from allsync.episodes import Episode
from allsync.producers.groups import fill_groups, filter_values, group_batch


@dataclass
class StreamRound:
    """One round of the stream: its problems, its rows' results as they end (round j holds rows [j R, (j + 1) R),
    R = StreamedRounds.round_rows)."""

    problems: list
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
        self.round_rows = groups_wanted * producer.group_size  # rows of every round: its groups x group_size
        self.capacity = context.longest_prompt() + producer.sampling.max_new_tokens
        self.most_rows = self.max_rounds * self.round_rows

    # ---------------------------------------------------------------------------------------- RowSource
    def more(self, waiting: int, free: int) -> tuple[list[list[int]], torch.Tensor]:
        """The next round's rows once the queue holds fewer rows than free slots (at most max_sampling_rounds)."""
        if waiting >= free or len(self.rounds) == self.max_rounds:
            return [], torch.zeros(0, dtype=torch.int64)
        problems = self.context.take_problems(self.quota)
        rows = [prompt for p in problems for prompt in [self.producer.encode(p)] * self.producer.group_size]
        seeds = draw_seeds(len(rows))
        self.rounds.append(StreamRound(problems, self.context.rewind_point()))
        return rows, seeds

    def ended(self, rows: list[int], result) -> None:
        """Each row's result kept in its round; a round whose rows have all ended is scored."""
        for row in rows:
            j = row // self.round_rows
            self.rounds[j].results[row] = result(row)
            if len(self.rounds[j].results) == self.round_rows:
                self.score(j)

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

    def rows_of(self, j: int) -> range:
        """Round j's rows."""
        return range(j * self.round_rows, (j + 1) * self.round_rows)

    def score(self, j: int) -> None:
        """Round j's rewards, and the groups dynamic sampling keeps of it."""
        n, stream_round = self.producer.group_size, self.rounds[j]
        responses = [stream_round.results[r][0] for r in self.rows_of(j)]
        problems = [stream_round.problems[i // n] for i in range(self.round_rows)]
        group_index = torch.arange(self.round_rows) // n
        rewards, correct, _ = self.producer.score(problems, responses, group_index.tolist())
        stream_round.scores = (rewards, correct)
        metric = filter_values(correct, rewards, self.filter_metric)
        stream_round.kept = int(torch.unique(group_index[keep_groups(metric, group_index)]).numel())

    def episodes(self, j: int, rollout) -> list[Episode]:
        """Round j's episodes from the streamed call's rollout and the round's scores."""
        rows = self.rows_of(j)
        rewards, correct = self.rounds[j].scores
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
        group_batch(stream.episodes(j, rollout), producer.group_size, a.filter_metric)
        for j in range(stream.ended_rounds())
    ]
    batch, stats = fill_groups(lambda j: batches[j], groups_wanted, a, context.groups, context.groups.rank)
    rounds = stats["sampling_rounds"]
    stream.rounds[rounds - 1].rewind()  # the rounds begun after the last needed one go back
    return batch.payloads, stats | {
        "generated": [e for b in batches[:rounds] for e in b.payloads],
        "samples_dropped": len(rollout) - rounds * stream.round_rows,
    }
