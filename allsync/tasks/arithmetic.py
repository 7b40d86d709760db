"""arithmetic: seeded problems with exact integer answers.

    spec = ArithmeticGenerator(max_digits=3)
    splits = make_splits(spec, train_size=20000, heldout_size=200, seed=0)
    splits.train[0]  # Problem(prompt="What is 47+385?", answer="432")

The model is asked to reply `Answer: 432` (see `format_response`), a few tokens, so generation is cheap.

Difficulty: each operand has d digits, d drawn uniformly from min_digits..max_digits, then the value
uniformly among d-digit numbers (d=1 includes 0). More digits means more carries to get right.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from allsync.tasks.problems import ANSWER_PREFIX, Problem, Splits, answer_examples, encode_problems, generated_splits
from allsync.tasks.registry import GeneratedTask, longest_reply, register_task

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticGenerator:
    """Operands of min_digits..max_digits digits combined with one of `ops` ("+", "-", "*")."""

    min_digits: int = 1
    max_digits: int = 3
    ops: tuple[str, ...] = ("+",)
    nonnegative: bool = True  # "-": put the larger operand first so answers are >= 0
    # none: the reply is `Answer: N`; verbose: a digit-by-digit sum first (verbose_reply); mixed: verbose, or for one
    # problem in COMPACT_EVERY the same columns in a few tokens (compact_reply)
    reasoning: str = "none"
    # the warm start also teaches prompts carrying a note (standard_note or a judgment, teach_notes), each followed by
    # the right reply, so that the base reads one: what NLFT's p_std and p_judge assume (recipes/nlft.py)
    reads_notes: bool = False

    def validate(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits ({self.min_digits}) <= max_digits ({self.max_digits})")
        unknown = [op for op in self.ops if op not in OPERATIONS]
        if unknown or not self.ops:
            raise ValueError(f"ops {self.ops!r}: each must be one of {sorted(OPERATIONS)}")
        if self.reasoning not in REASONING:
            raise ValueError(f"reasoning {self.reasoning!r}: use {' or '.join(REASONING)}")
        if self.reasoning != "none" and tuple(self.ops) != ("+",):
            raise ValueError(
                f"reasoning {self.reasoning} with ops {list(self.ops)}: the reasoned replies are written for '+'"
            )

    def space_size(self) -> int:
        """Distinct problems: (sum over d of count(d))^2 * len(ops), count(1) = 10, count(d) = 9 * 10^(d-1)."""
        per_operand = sum(digit_count(d) for d in range(self.min_digits, self.max_digits + 1))
        return per_operand**2 * len(self.ops)

    def max_answer_chars(self) -> int:
        """Longest answer string, from the extreme operands lo = smallest, hi = 10^max_digits - 1."""
        lo, hi = (0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)), 10**self.max_digits - 1
        results = [OPERATIONS[op](a, b) for op in self.ops for a in (lo, hi) for b in (lo, hi)]
        if self.nonnegative:
            results = [abs(r) for r in results]
        return max(len(str(r)) for r in results)

    def longest_verbose_reply(self) -> str:
        """The longest verbose reply: the largest operands' sum with the most restatements."""
        top = 10**self.max_digits - 1
        return verbose_reply(top, top, MAX_RESTATEMENTS)

    def max_response_tokens(self) -> int:
        """Tokens of the longest reply plus eos (the tokenizer is byte-level: 1 char = 1 token)."""
        if self.reasoning != "none":  # mixed: the verbose reply is the longer
            return len(self.longest_verbose_reply()) + 1
        return len(ANSWER_PREFIX) + self.max_answer_chars() + 1

    # the warm start's side (allsync.tasks.registry.WarmStartTask)
    def splits(self, train_size: int, heldout_size: int, seed: int) -> Splits:
        return make_splits(self, train_size, heldout_size, seed)

    def teacher_examples(self, tokenizer, problems: list[Problem], seed: int) -> list[tuple[list[int], int]]:
        replies = None
        if self.reasoning != "none":
            rng = random.Random(f"verbose-{seed}")
            replies = [verbose_reply(*operands(p), rng.randint(0, MAX_RESTATEMENTS)) for p in problems]
        if self.reasoning == "mixed":  # its own stream: the verbose replies are those `verbose` teaches
            short = random.Random(f"compact-{seed}")
            replies = [
                compact_reply(*operands(p)) if short.randrange(COMPACT_EVERY) == 0 else r
                for p, r in zip(problems, replies)
            ]
        if self.reads_notes:  # the replies above are the plain problems'; only the prompts gain a note
            problems = teach_notes(problems, random.Random(f"notes-{seed}"))
        return answer_examples(tokenizer, problems, replies)

    def heldout_prompts(self, tokenizer, problems: list[Problem]) -> list[list[int]]:
        return encode_problems(tokenizer, problems, with_answer=False)


REASONING = ("none", "verbose", "mixed")
MAX_RESTATEMENTS = 3
NOTE_EVERY = 4  # reads_notes: one warm-start prompt in 4 carries the standard answer, one in 4 a judgment
COMPACT_EVERY = 4  # reasoning mixed: one warm-start reply in 4 (on average) is compact_reply


def operands(problem: Problem) -> tuple[int, int]:
    """a and b of `What is a+b?`."""
    a, b = problem.prompt.removeprefix("What is ").removesuffix("?").split("+")
    return int(a), int(b)


def verbose_reply(a: int, b: int, restatements: int) -> str:
    """A long-winded sum, column by column with carries, restated `restatements` times, then the answer line:

    47+38: ones 7+8=15, write 5 carry 1. tens 4+3+1=8, write 8. so 47+38=85. again: 47+38=85.
    Answer: 85
    """
    names = ("ones", "tens", "hundreds", "thousands")
    steps = []
    for i, (x, y, carry, total) in enumerate(column_sums(a, b)):
        terms = f"{x}+{y}" + (f"+{carry}" if carry else "")
        steps.append(f"{names[i]} {terms}={total}, write {total % 10}" + (" carry 1" if total > 9 else "") + ".")
    text = f"{a}+{b}: " + " ".join(steps) + f" so {a}+{b}={a + b}." + f" again: {a}+{b}={a + b}." * restatements
    return f"{text}\n{ANSWER_PREFIX}{a + b}"


def standard_note(truth: str) -> str:
    """The note that carries the standard answer (NLFT's p_std prompt)."""
    return f"the correct answer is {truth}"


def judgment(answer: str | None, truth: str) -> str:
    """What a grader says of an answer: that it is right, or the first digit that is wrong and what it should be."""
    got = (answer or "").strip()
    if not got:
        return f"the reply gives no answer; the answer is {truth}"
    if got == truth:
        return f"the answer {truth} is right"
    if len(got) != len(truth):
        return f"the answer {got} has {len(got)} digits, the right one has {len(truth)}"
    i = next(i for i, (a, b) in enumerate(zip(got, truth)) if a != b)
    return f"the answer {got} is wrong at digit {i + 1}: {got[i]} should be {truth[i]}"


def with_note(problem: Problem, note: str) -> Problem:
    """The problem with `note` in brackets after its question."""
    return Problem(f"{problem.prompt} ({note})", problem.answer)


def wrong_answer(truth: str, rng: random.Random) -> str:
    """A plausible wrong answer: one digit changed (never to a leading zero), or one in five a digit added or
    dropped."""
    if rng.random() < 0.2:
        return truth + str(rng.randint(0, 9)) if len(truth) == 1 or rng.random() < 0.5 else truth[:-1]
    i = rng.randrange(len(truth))
    digits = [d for d in "0123456789" if d != truth[i] and not (i == 0 and d == "0" and len(truth) > 1)]
    return truth[:i] + rng.choice(digits) + truth[i + 1 :]


def teach_notes(problems: list[Problem], rng: random.Random) -> list[Problem]:
    """reads_notes: one problem in NOTE_EVERY carries standard_note, one in NOTE_EVERY the judgment of an answer
    (wrong four times in five, else the right one), the rest none; every reply stays the problem's own."""
    noted = []
    for p in problems:
        kind = rng.randrange(NOTE_EVERY)
        if kind == 0:
            p = with_note(p, standard_note(p.answer))
        elif kind == 1:
            answer = wrong_answer(p.answer, rng) if rng.random() < 0.8 else p.answer
            p = with_note(p, judgment(answer, p.answer))
        noted.append(p)
    return noted


def column_sums(a: int, b: int) -> list[tuple[int, int, int, int]]:
    """(x, y, carry in, total) per column of a+b, ones first, up to the last carry."""
    columns, carry, i = [], 0, 0
    while a // 10**i or b // 10**i or carry or i == 0:
        x, y = a // 10**i % 10, b // 10**i % 10
        columns.append((x, y, carry, x + y + carry))
        carry, i = (x + y + carry) // 10, i + 1
    return columns


def compact_reply(a: int, b: int) -> str:
    """The columns of verbose_reply without the words, the write-down or a restatement:

    47+38: 7+8=15 4+3+1=8
    Answer: 85
    """
    sums = " ".join(f"{x}+{y}" + (f"+{c}" if c else "") + f"={t}" for x, y, c, t in column_sums(a, b))
    return f"{a}+{b}: {sums}\n{ANSWER_PREFIX}{a + b}"


def digit_count(d: int) -> int:
    """How many integers have exactly d digits (0 counts as one digit)."""
    return 10 if d == 1 else 9 * 10 ** (d - 1)


def random_operand(rng: random.Random, spec: ArithmeticGenerator) -> int:
    d = rng.randint(spec.min_digits, spec.max_digits)
    return rng.randint(0, 9) if d == 1 else rng.randint(10 ** (d - 1), 10**d - 1)


def make_problem(a: int, op: str, b: int) -> Problem:
    return Problem(prompt=f"What is {a}{op}{b}?", answer=str(OPERATIONS[op](a, b)))


def sample_problem(rng: random.Random, spec: ArithmeticGenerator) -> Problem:
    a, b = random_operand(rng, spec), random_operand(rng, spec)
    op = rng.choice(spec.ops)
    if op == "-" and spec.nonnegative and a < b:
        a, b = b, a
    return make_problem(a, op, b)


def make_splits(spec: ArithmeticGenerator, train_size: int, heldout_size: int, seed: int = 0) -> Splits:
    """Seeded, disjoint splits: `heldout_size` distinct prompts, then `train_size` draws avoiding them."""
    spec.validate()
    if heldout_size > spec.space_size() // 2:
        raise ValueError(f"heldout_size {heldout_size} is more than half of the {spec.space_size()} distinct problems")
    return generated_splits(
        lambda rng: sample_problem(rng, spec),
        lambda p: p.prompt,
        train_size,
        heldout_size,
        random.Random(f"arithmetic-{seed}"),
    )


@register_task
@dataclass
class ArithmeticTask(GeneratedTask):
    """task.name arithmetic: generated problems (ArithmeticGenerator), `Answer: N` replies."""

    name: str = field(default="arithmetic", init=False)
    default_reward: ClassVar[str] = "arithmetic"  # "Answer: N" equals the sum, 0/1
    min_digits: int = 1
    max_digits: int = 3
    ops: list[str] = field(default_factory=lambda: ["+"])
    train_size: int = 20000  # generated training rows
    heldout_size: int = 200  # unique held-out problems
    seed: int = 0  # the generated splits

    # verbose: the warm start teaches a digit-by-digit sum before the answer (balanced reasoning); mixed: that, or for
    # one problem in four the same sums in a few tokens (a base that knows a short correct reasoning)
    reasoning: str = "none"
    # the warm start also teaches prompts carrying the standard answer or a judgment of an answer, each followed by
    # the right reply (a base that reads a note: what recipes/nlft.py's p_std and p_judge assume)
    reads_notes: bool = False

    def generator(self) -> ArithmeticGenerator:
        return ArithmeticGenerator(
            self.min_digits, self.max_digits, tuple(self.ops), reasoning=self.reasoning, reads_notes=self.reads_notes
        )

    def longest_reply(self, tokenizer, problems: list[Problem]) -> tuple[int, str]:
        """Verbose reasoning: the verbose reply of the largest operands with the most restatements; else the
        longest `Answer: N`."""
        if self.reasoning == "none":
            return super().longest_reply(tokenizer, problems)
        return longest_reply(tokenizer, [self.generator().longest_verbose_reply()])

    def eval_reply_tokens(self, max_new_tokens: int) -> int | None:
        """Verbose reasoning (a digit-by-digit sum before the answer) is evaluated with rollout.max_new_tokens."""
        return max_new_tokens if self.reasoning != "none" else None
