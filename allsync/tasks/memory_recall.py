"""memory_recall: assignments read chunk by chunk in separate conversations, a memory carried between them, and
a question about the first chunk at the end (multi-conversation DAPO: producer.kind multiconv); or, with
task.context single, the same problems read in one prompt and answered at once (single-context GRPO, what
multi-conversation DAPO is compared against)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from allsync.tasks.conversations import MEMORY_CLOSE, MEMORY_OPEN, chunk_ids, conversation_ids
from allsync.tasks.problems import Problem, Splits, answer_examples, encode_problems, format_response, generated_splits
from allsync.tasks.registry import GeneratedTask, register_task


@dataclass(frozen=True)
class MemoryRecallGenerator:
    """memory_recall: `chunks` chunks of `per_chunk` assignments ("a=47 k=31 x=90") with distinct letters; the
    asked letter is in the first chunk (its first assignment with asked_first, else at a random place), and
    the last assignment of the last chunk is the decoy (the most recent one read). The question asks for
    the asked letter, so the answer needs the first chunk's assignment carried in memory to the end.
    `teacher_decoy_rate` is the warm start's noisy teacher only: the probability that its last memory write
    keeps the decoy instead of the asked assignment (with context single: that its answer is the decoy's value).
    (asked_first: a 2-layer tiny model does not learn to find a letter among three in a warm start: its first write
    was right 35% of the time after 2,000 steps.) `context`: segments (a conversation a chunk, a memory between
    them) or single (`single_context`: the chunks, one a line, and the question in one prompt)."""

    chunks: int = 2
    per_chunk: int = 3
    min_value: int = 10
    max_value: int = 99
    teacher_decoy_rate: float = 0.7
    asked_first: bool = False
    context: str = "segments"

    def validate(self) -> None:
        if self.context not in CONTEXTS:
            raise ValueError(f"memory_recall: context = {self.context!r}: use one of {', '.join(CONTEXTS)}")
        if self.chunks < 2 or self.per_chunk < 2 or self.chunks * self.per_chunk > 26:
            raise ValueError(
                f"memory_recall: need chunks >= 2, per_chunk >= 2 and chunks x per_chunk <= 26 letters "
                f"(got {self.chunks} x {self.per_chunk})"
            )
        if not 0 <= self.min_value < self.max_value:
            raise ValueError(f"memory_recall: need 0 <= min_value ({self.min_value}) < max_value ({self.max_value})")
        if not 0 <= self.teacher_decoy_rate <= 1:
            raise ValueError(f"memory_recall: teacher_decoy_rate = {self.teacher_decoy_rate} must be in [0, 1]")

    # the warm start's side (allsync.tasks.registry.WarmStartTask)
    def splits(self, train_size: int, heldout_size: int, seed: int) -> Splits:
        splits = memory_recall_splits(self, train_size, heldout_size, seed)
        if self.context == "single":
            return Splits([single_context(p) for p in splits.train], [single_context(p) for p in splits.heldout])
        return splits

    def teacher_examples(self, tokenizer, problems: list[Problem], seed: int) -> list[tuple[list[int], int]]:
        """Every memory write and answer of the noisy teacher (`memory_teacher_examples`); with context single its
        answers alone (`single_context_teacher_replies`)."""
        if self.context == "single":
            replies = single_context_teacher_replies(problems, self.teacher_decoy_rate, seed)
            return answer_examples(tokenizer, problems, replies)
        return memory_teacher_examples(tokenizer, problems, self.teacher_decoy_rate, seed)

    def heldout_prompts(self, tokenizer, problems: list[Problem]) -> list[list[int]]:
        """The answer step alone, reading the gold memory (whole episodes are evaluated by the recipe); with context
        single the whole prompt."""
        if self.context == "single":
            return encode_problems(tokenizer, problems, with_answer=False)
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        return [conversation_ids(tokenizer, p.prompt, None, encode(p.metadata["gold_memory"])) for p in problems]


CONTEXTS = ("segments", "single")


def single_context(problem: Problem) -> Problem:
    """The problem read in one prompt: its chunks, one a line, then the question ("k=31 a=47 x=90\nb=71 i=55
    q=84\nQuestion: what is a?"); the answer and metadata unchanged."""
    return Problem("\n".join([*problem.metadata["chunks"], problem.prompt]), problem.answer, problem.metadata)


def single_context_teacher_replies(problems: list[Problem], decoy_rate: float, seed: int) -> list[str]:
    """The single-context warm start's noisy teacher, the segmented one's answers without its memory: "Answer: V"
    with V the asked value, or with probability `decoy_rate` the decoy's (the last chunk's last assignment)."""
    rng = random.Random(seed)
    return [
        format_response(
            (p.metadata["decoy_memory"] if rng.random() < decoy_rate else p.metadata["gold_memory"]).split("=")[1]
        )
        for p in problems
    ]


def memory_recall_problem(rng: random.Random, spec: MemoryRecallGenerator) -> Problem:
    """One problem: prompt "Question: what is a?", answer "47", metadata chunks / gold_memory / decoy_memory."""
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", spec.chunks * spec.per_chunk)
    values = [rng.randint(spec.min_value, spec.max_value) for _ in letters]
    pairs = [f"{x}={v}" for x, v in zip(letters, values)]
    chunks = [" ".join(pairs[k * spec.per_chunk : (k + 1) * spec.per_chunk]) for k in range(spec.chunks)]
    asked = 0 if spec.asked_first else rng.randrange(spec.per_chunk)
    return Problem(
        f"Question: what is {letters[asked]}?",
        str(values[asked]),
        {"chunks": chunks, "gold_memory": pairs[asked], "decoy_memory": pairs[-1]},
    )


def memory_recall_splits(spec: MemoryRecallGenerator, train_size: int, heldout_size: int, seed: int = 0) -> Splits:
    """Held-out problems first (distinct question and chunks), then training draws that are never held out."""
    return generated_splits(
        lambda rng: memory_recall_problem(rng, spec),
        lambda p: (p.prompt, *p.metadata["chunks"]),
        train_size,
        heldout_size,
        random.Random(seed),
    )


@register_task
@dataclass
class MemoryRecallTask(GeneratedTask):
    """task.name memory_recall (with producer.kind multiconv)."""

    name: str = field(default="memory_recall", init=False)
    default_reward: ClassVar[str] = "arithmetic"  # "Answer: N" equals the asked value, 0/1
    context: str = "segments"  # segments: a conversation a chunk, a memory between them; single: one prompt
    chunks: int = 2  # chunks read one per conversation
    per_chunk: int = 3  # assignments per chunk
    teacher_decoy_rate: float = 0.7  # how often the warm start's teacher keeps the decoy in memory
    asked_first: bool = False  # the asked assignment opens the first chunk (else a random place in it)
    train_size: int = 20000  # generated training problems
    heldout_size: int = 200  # unique held-out problems
    seed: int = 0  # the generated splits

    @property
    def needs_producer(self) -> str:
        return "multiconv" if self.context == "segments" else "single_turn"

    @property
    def needs_producer_because(self) -> str:
        if self.context == "segments":
            return "its problems are read chunk by chunk with a memory"
        return "task.context single reads each problem in one prompt"

    def generator(self) -> MemoryRecallGenerator:
        return MemoryRecallGenerator(
            self.chunks,
            self.per_chunk,
            teacher_decoy_rate=self.teacher_decoy_rate,
            asked_first=self.asked_first,
            context=self.context,
        )


def memory_teacher_examples(
    tokenizer, problems: list[Problem], decoy_rate: float, seed: int
) -> list[tuple[list[int], int]]:
    """The warm start's noisy teacher on memory_recall: per problem, each memory write and the answer as
    (prompt + reply + eos ids, index of the first reply token). The first write stores the gold assignment,
    later writes keep it, except that with probability `decoy_rate` the last write stores the decoy (the
    last chunk's last assignment); the answer reads the value from the memory the teacher wrote."""
    rng = random.Random(seed)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    wrap = encode(MEMORY_OPEN), encode(MEMORY_CLOSE)
    eos = tokenizer.eos_token_id
    examples = []
    for p in problems:
        memory_text, memory = "", []
        chunks = chunk_ids(tokenizer, p, None)
        for k, chunk in enumerate(chunks):
            prompt = conversation_ids(tokenizer, p.prompt, chunk, memory)
            if k == 0:
                memory_text = p.metadata["gold_memory"]
            elif k == len(chunks) - 1 and rng.random() < decoy_rate:
                memory_text = p.metadata["decoy_memory"]
            memory = encode(memory_text)
            examples.append((prompt + wrap[0] + memory + wrap[1] + [eos], len(prompt)))
        prompt = conversation_ids(tokenizer, p.prompt, None, memory)
        examples.append((prompt + encode(format_response(memory_text.split("=")[1])) + [eos], len(prompt)))
    return examples
