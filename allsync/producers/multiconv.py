"""Multi-conversation DAPO (MemAgent's Multi-Conv DAPO): a long input read chunk by chunk with a memory
(producer.kind multiconv).

For each episode of a problem (question q, chunks c_1..c_K: the texts of `problem.metadata["chunks"]`, or
the token ids of `problem.metadata["context"]` cut every `chunk_tokens` tokens, as MemAgent reads a long
document):

    conversation k = 1..K   user: q, the memory m_{k-1} (empty at k = 1), chunk c_k
                            reply: <memory> m_k </memory>          (kind "memory", at most memory_tokens)
    final conversation      user: q, the memory m_K                (kind "answer", no chunk)
                            reply: Answer: ...                     -> the episode's reward

The memory is passed on as token ids (the reply's ids between the tags), never decoded and re-encoded,
so every segment's prompt holds exactly the tokens the engine produced and its logprobs stay valid. A
write without a closing tag is passed on as it is: cut at memory_tokens ("truncated"), or ended early
("malformed"); a reply without an opening tag leaves an empty memory ("malformed"). Each conversation
is a new segment of the episode; the reward of the final answer trains them all (allsync/update/learner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from allsync.algorithms import credit_mask, estimators_that
from allsync.episodes import Episode, Segment
from allsync.producers.groups import GroupRounds
from allsync.producers.registry import ProducerContext, ProducerDefaults, register_producer
from allsync.engines.torch_engine import Sampling
from allsync.tasks import Problem, model_len_needed
from allsync.tasks.conversations import (
    MEMORY_CLOSE,
    MEMORY_OPEN,
    chunk_ids,
    conversation_ids,
    longest_conversation_tokens,
)

MEMORY_MODES = ("own", "blank", "gold")


def find_ids(haystack: list[int], needle: list[int], start: int = 0) -> int:
    """First index >= start where `needle` occurs in `haystack`, -1 if none (a byte search, no Python loop)."""
    if not needle or len(haystack) - start < len(needle):
        return -1
    hay = np.asarray(haystack[start:], dtype=np.int64).tobytes()
    pattern = np.asarray(needle, dtype=np.int64).tobytes()
    at = hay.find(pattern)
    while at != -1 and at % 8:  # matches must start on a token boundary
        at = hay.find(pattern, at + 1)
    return -1 if at == -1 else start + at // 8


def extract_memory(
    response_ids: list[int], open_ids: list[int], close_ids: list[int], eos_id: int, finish_reason: str
) -> tuple[list[int], str]:
    """(memory ids, status): status "ok" (both tags), "truncated" (no closing tag, cut at the token budget:
    everything after the opening tag), "malformed" (no opening tag: empty; or ended without a closing tag)."""
    begin = find_ids(response_ids, open_ids)
    if begin == -1:
        return [], "malformed"
    begin += len(open_ids)
    end = find_ids(response_ids, close_ids, begin)
    if end != -1:
        return response_ids[begin:end], "ok"
    body = response_ids[begin:]
    if body and body[-1] == eos_id:
        body = body[:-1]
    return body, "truncated" if finish_reason == "length" else "malformed"


class MultiConversation:
    def __init__(
        self,
        engine,
        tokenizer,
        score,
        sampling: Sampling,
        group_size: int,
        memory_tokens: int,
        chunk_tokens: int | None = None,
    ):
        """score(problems, answer responses, group_index) -> (rewards, correct, errors); sampling: the answer's
        (its max_new_tokens is rollout.max_new_tokens); memory writes use the same sampling with at most
        memory_tokens new tokens. Under expert parallelism every rank runs as many memory rounds as the rank
        with the most chunks (the engine's agreed_rounds)."""
        self.engine, self.tokenizer, self.score = engine, tokenizer, score
        self.sampling, self.group_size, self.memory_tokens, self.chunk_tokens = (
            sampling,
            group_size,
            memory_tokens,
            chunk_tokens,
        )
        self.open_ids = tokenizer(MEMORY_OPEN, add_special_tokens=False)["input_ids"]
        self.close_ids = tokenizer(MEMORY_CLOSE, add_special_tokens=False)["input_ids"]
        self.eos_id = tokenizer.eos_token_id

    def prompt_ids(
        self, question: str | tuple[tuple[str, str], ...], chunk: list[int] | None, memory: list[int]
    ) -> list[int]:
        return conversation_ids(self.tokenizer, question, chunk, memory)

    def gold_memory(self, problem: Problem) -> list[int]:
        return self.tokenizer(problem.metadata["gold_memory"], add_special_tokens=False)["input_ids"]

    def run(self, problems: list[Problem], n: int, sampling: Sampling, memory: str = "own") -> list[list[Segment]]:
        """n episodes per problem (episode i of problem i // n): their segments, the answer last. memory
        "own": the episode's own writes; "blank": no writes, an empty memory; "gold": no writes, the task's
        gold memory (the ablation's bounds)."""
        if memory not in MEMORY_MODES:
            raise ValueError(f"memory {memory!r}: use one of {MEMORY_MODES}")
        owners = [p for p in problems for _ in range(n)]
        memories: list[list[int]] = [[] for _ in owners]
        segments: list[list[Segment]] = [[] for _ in owners]
        write = Sampling(sampling.temperature, sampling.top_p, self.memory_tokens, sampling.greedy)
        if memory == "own":
            chunks = {id(p): chunk_ids(self.tokenizer, p, self.chunk_tokens) for p in problems}
            for k in range(self.engine.agreed_rounds(max((len(chunks[id(p)]) for p in owners), default=0))):
                active = [i for i, p in enumerate(owners) if k < len(chunks[id(p)])]
                prompts = [self.prompt_ids(owners[i].prompt, chunks[id(owners[i])][k], memories[i]) for i in active]
                rollout = self.engine.generate(prompts, 1, write)
                for i, prompt, ids, lps, reason in zip(
                    active, prompts, rollout.response_ids, rollout.logprobs, rollout.finish_reasons
                ):
                    segments[i].append(Segment(prompt, ids, lps, reason, "memory", rollout.adapter_version))
                    memories[i], _ = extract_memory(ids, self.open_ids, self.close_ids, self.eos_id, reason)
        elif memory == "gold":
            memories = [self.gold_memory(p) for p in owners]
        prompts = [self.prompt_ids(p.prompt, None, m) for p, m in zip(owners, memories)]
        rollout = self.engine.generate(prompts, 1, sampling)
        for i, (prompt, ids, lps, reason) in enumerate(
            zip(prompts, rollout.response_ids, rollout.logprobs, rollout.finish_reasons)
        ):
            segments[i].append(Segment(prompt, ids, lps, reason, "answer", rollout.adapter_version))
        return segments

    def generate(self, problems: list[Problem]) -> list[Episode]:
        n = self.group_size
        runs = self.run(problems, n, self.sampling)
        owners = [p for p in problems for _ in range(n)]
        rewards, correct, _ = self.score(owners, [s[-1].response_ids for s in runs], [i // n for i in range(len(runs))])
        return [Episode(s, r, ok, self.episode_info(p, s)) for p, s, r, ok in zip(owners, runs, rewards, correct)]

    def evaluate(self, problems, problem_ids, samples, sampling, memory, score_answers) -> list:
        """The episodes run whole (memory: own, blank or gold, see `run`); their last answers scored."""
        answers = [
            (seg[-1].response_ids, seg[-1].finish_reason) for seg in self.run(problems, samples, sampling, memory)
        ]
        return score_answers(problems, problem_ids, samples, answers)

    def episode_info(self, problem: Problem, segments: list[Segment]) -> dict:
        """Counts the metrics sum: memory writes, their tokens, truncated / malformed writes, and whether the
        last memory equals the task's gold memory (when the task has one)."""
        statuses, memory = [], []
        for s in segments[:-1]:
            memory, status = extract_memory(s.response_ids, self.open_ids, self.close_ids, self.eos_id, s.finish_reason)
            statuses.append(status)
        info = {
            "segments": len(segments),
            "memory_tokens": sum(len(s.response_ids) for s in segments[:-1]),
            "memory_truncated": statuses.count("truncated"),
            "memory_malformed": statuses.count("malformed"),
        }
        if (problem.metadata or {}).get("gold_memory") is not None:
            info["memory_exact"] = int(memory == self.gold_memory(problem))
        return info


WEIGHTING_AGGREGATION = {"token": "token-mean", "episode": "episode-mean-token-mean"}  # producer.weighting


@register_producer
@dataclass
class MultiConvSettings(ProducerDefaults):
    """producer.kind multiconv: the final answer's reward trains every memory segment (task memory_recall, or
    dataset rows with a context cut every chunk_tokens)."""

    kind: str = field(default="multiconv", init=False)
    logs_episode_info: ClassVar[bool] = True
    reports_segment_gaps: ClassVar[bool] = True  # memory writes and answers: a gap per kind
    memory_ablations: ClassVar[tuple[str, ...]] = ("blank", "gold")  # how much the answers owe to the memory written
    memory_tokens: int | None = None  # the most tokens of one memory write (required)
    chunk_tokens: int | None = (
        None  # dataset rows with a context: tokens per chunk read (memory_recall gives its chunks)
    )
    credit: str = "all"  # all: every segment's tokens train | final: only the answer segment's (the ablation)
    weighting: str = (
        "token"  # token: token mean over the batch | episode: token mean per episode, then mean over episodes
    )

    def check(self, fail) -> None:
        from allsync.algorithms import CREDIT_RULES

        if self.credit not in CREDIT_RULES:
            fail(f"producer.credit = {self.credit!r}: use all (every segment trains) or final (only the answer)")
        if self.weighting not in WEIGHTING_AGGREGATION:
            fail(f"producer.weighting = {self.weighting!r}: use token or episode")
        if self.memory_tokens is None or self.memory_tokens < 1:
            fail(
                f"producer.kind multiconv needs producer.memory_tokens >= 1 (the most tokens of one memory write), got {self.memory_tokens}"
            )
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            fail(f"producer.chunk_tokens = {self.chunk_tokens}: must be >= 1")

    def loss_aggregation(self, loss_agg: str) -> str:
        """producer.weighting's aggregation (algorithm.loss_agg must be left at its default)."""
        return WEIGHTING_AGGREGATION[self.weighting]

    def trained_mask(self, response_mask, is_answer):
        """producer.credit: every segment's tokens (all) or only the answer segments' (final)."""
        return credit_mask(response_mask, is_answer, self.credit)

    def check_with(self, config, fail) -> None:
        a, task = config.algorithm, config.task.name
        if config.optim.balance_ranks:
            fail(
                "optim.balance_ranks with producer.kind multiconv: its per-segment logprob gaps are measured on the rows "
                "a worker generated, which balancing moves; use one or the other"
            )
        if not a.estimator.needs_groups:
            fail(
                f"producer.kind multiconv with algorithm.advantage {a.advantage}: the final reward trains every segment "
                f"through one group-relative advantage per episode; use {estimators_that(needs_groups=True)}"
            )
        if a.loss_agg != type(a).loss_agg:
            fail(
                f"algorithm.loss_agg = {a.loss_agg} with producer.kind multiconv: the aggregation is producer.weighting "
                "(token or episode)"
            )
        if task not in ("memory_recall", "dataset"):
            fail(
                f"producer.kind multiconv with task.name {task}: the problems must come in chunks: use task memory_recall, "
                "or dataset rows with a context and producer.chunk_tokens"
            )
        if (task == "dataset") != (self.chunk_tokens is not None):
            fail(
                f"producer.chunk_tokens = {self.chunk_tokens} with task.name {task}: dataset rows' contexts are cut every "
                "producer.chunk_tokens tokens (set it for dataset, leave it out for memory_recall, whose chunks are given)"
            )

    def build(self, context: ProducerContext) -> GroupRounds:
        r = context.config.rollout
        producer = MultiConversation(
            context.engine,
            context.tokenizer,
            context.score,
            Sampling.for_training(r),
            r.group_size,
            self.memory_tokens,
            self.chunk_tokens,
        )
        return GroupRounds(producer, context)

    def model_len(self, config, tokenizer, problems: list[Problem], max_position_embeddings: int) -> int:
        """The longest memory write's prompt (question, a full memory, the longest chunk) + max(rollout.max_new_tokens,
        producer.memory_tokens): a write may use memory_tokens."""
        longest = longest_conversation_tokens(tokenizer, problems, self.memory_tokens, self.chunk_tokens)
        new_tokens, name = max(
            (config.rollout.max_new_tokens, "rollout.max_new_tokens"), (self.memory_tokens, "producer.memory_tokens")
        )
        return model_len_needed(
            longest,
            new_tokens,
            max_position_embeddings,
            name,
            "the longest memory write's prompt (question, producer.memory_tokens of memory, the longest chunk)",
        )
