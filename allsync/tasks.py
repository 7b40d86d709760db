"""Verifiable tasks as Problems (prompt, answer, metadata): seeded arithmetic, dataset files
(`dataset_splits`, rows read by evals/datasets.py) and reasoning-gym generators (`reasoning_gym_splits`).

Arithmetic: seeded problems with exact integer answers.

    spec = ArithmeticSpec(max_digits=3)
    splits = make_splits(spec, train_size=20000, heldout_size=200, seed=0)
    splits.train[0]  # Problem(prompt="What is 47+385?", answer="432")

The model is asked to reply `Answer: 432` (see `format_response`), a few tokens, so generation is cheap.

Difficulty: each operand has d digits, d drawn uniformly from min_digits..max_digits, then the value
uniformly among d-digit numbers (d=1 includes 0). More digits means more carries to get right.

Splits: the held-out set is drawn first (distinct prompts); training problems are i.i.d. draws from
the same distribution with every held-out prompt rejected, so no held-out prompt ever appears in
train (train may repeat a problem when the problem space is small).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
ANSWER_PREFIX = "Answer: "


@dataclass(frozen=True)
class Problem:
    prompt: str | tuple[tuple[str, str], ...]  # the user's text, or (role, content) messages (dataset rows)
    answer: str
    metadata: dict | None = field(default=None, compare=False)  # what the reward needs besides the answer (JSON)


@dataclass(frozen=True)
class ArithmeticSpec:
    """Operands of min_digits..max_digits digits combined with one of `ops` ("+", "-", "*")."""

    min_digits: int = 1
    max_digits: int = 3
    ops: tuple[str, ...] = ("+",)
    nonnegative: bool = True  # "-": put the larger operand first so answers are >= 0

    def validate(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits ({self.min_digits}) <= max_digits ({self.max_digits})")
        unknown = [op for op in self.ops if op not in OPERATIONS]
        if unknown or not self.ops:
            raise ValueError(f"ops {self.ops!r}: each must be one of {sorted(OPERATIONS)}")

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

    def max_response_tokens(self) -> int:
        """Tokens of the longest `Answer: N` reply plus eos (the tokenizer is byte-level: 1 char = 1 token)."""
        return len(ANSWER_PREFIX) + self.max_answer_chars() + 1


@dataclass(frozen=True)
class Splits:
    train: list[Problem]
    heldout: list[Problem]


def digit_count(d: int) -> int:
    """How many integers have exactly d digits (0 counts as one digit)."""
    return 10 if d == 1 else 9 * 10 ** (d - 1)


def random_operand(rng: random.Random, spec: ArithmeticSpec) -> int:
    d = rng.randint(spec.min_digits, spec.max_digits)
    return rng.randint(0, 9) if d == 1 else rng.randint(10 ** (d - 1), 10**d - 1)


def make_problem(a: int, op: str, b: int) -> Problem:
    return Problem(prompt=f"What is {a}{op}{b}?", answer=str(OPERATIONS[op](a, b)))


def sample_problem(rng: random.Random, spec: ArithmeticSpec) -> Problem:
    a, b = random_operand(rng, spec), random_operand(rng, spec)
    op = rng.choice(spec.ops)
    if op == "-" and spec.nonnegative and a < b:
        a, b = b, a
    return make_problem(a, op, b)


def make_splits(spec: ArithmeticSpec, train_size: int, heldout_size: int, seed: int = 0) -> Splits:
    """Seeded, disjoint splits: `heldout_size` distinct prompts, then `train_size` draws avoiding them."""
    spec.validate()
    if heldout_size > spec.space_size() // 2:
        raise ValueError(f"heldout_size {heldout_size} is more than half of the {spec.space_size()} distinct problems")
    return generated_splits(lambda rng: sample_problem(rng, spec), lambda p: p.prompt, train_size, heldout_size,
                            random.Random(f"arithmetic-{seed}"))  # fmt: skip


def generated_splits(draw, key, train_size: int, heldout_size: int, rng: random.Random) -> Splits:
    """`heldout_size` problems distinct by key(problem) drawn first, then `train_size` draws whose key is
    never a held-out one (train may repeat a problem). draw(rng) -> Problem."""
    heldout: dict = {}
    while len(heldout) < heldout_size:
        p = draw(rng)
        heldout.setdefault(key(p), p)
    train: list[Problem] = []
    while len(train) < train_size:
        p = draw(rng)
        if key(p) not in heldout:
            train.append(p)
    return Splits(train=train, heldout=list(heldout.values()))


def dataset_splits(train_files: list[str], eval_files: list[str], template: str | None, seed: int) -> tuple[Splits, list[str]]:
    """Training rows (unique over all train_files, shuffled with the seed) and evaluation rows (unique), as
    Problems, with one report line per file (rows read, unique prompts kept)."""
    from evals.datasets import DAPO_MATH_TEMPLATE, EPISODE_KEYS, load_rows

    text = DAPO_MATH_TEMPLATE if template == "dapo_math" else template
    parts, reports = [], []
    for files in (train_files, eval_files):
        seen, problems = set(), []
        for path in files:
            rows, report = load_rows(path, text)
            reports.append(report)
            for row in rows:
                if row.key not in seen:
                    seen.add(row.key)
                    metadata = {k: row.extra[k] for k in EPISODE_KEYS if k in row.extra}
                    problems.append(Problem(row.prompt, row.answer, metadata or None))
        parts.append(problems)
    random.Random(f"dataset-{seed}").shuffle(parts[0])
    return Splits(train=parts[0], heldout=parts[1]), reports


@dataclass(frozen=True)
class ReasoningGymSpec:
    """A reasoning-gym generator and its settings (a task the warm start can supervise, like ArithmeticSpec)."""

    dataset: str
    args: dict = field(default_factory=dict)
    template: str | None = None  # a text with {problem}, or None for the generator's question as is


def task_splits(task: "ArithmeticSpec | ReasoningGymSpec | MemoryRecallSpec | CalculatorSpec", train_size: int, heldout_size: int, seed: int) -> Splits:
    """Held-out problems drawn first, then training problems that are never held out, for either generated task."""
    if isinstance(task, ReasoningGymSpec):
        return reasoning_gym_splits(task.dataset, task.args, train_size, heldout_size, task.template, seed)[0]
    if isinstance(task, MemoryRecallSpec):
        return memory_recall_splits(task, train_size, heldout_size, seed)
    if isinstance(task, CalculatorSpec):
        return calculator_splits(task, train_size, heldout_size, seed)
    return make_splits(task, train_size, heldout_size, seed)


def reasoning_gym_splits(dataset: str, args: dict, train_size: int, heldout_size: int, template: str | None,
                         seed: int) -> tuple[Splits, list[str]]:  # fmt: skip
    """Problems from the reasoning-gym generator `dataset` (its kwargs in `args`): `heldout_size` unique held-out
    questions first, then `train_size` training rows whose questions are not held out (a small generator repeats
    questions, as the arithmetic task does). Each Problem keeps the entry's metadata for its `score_answer`."""
    import reasoning_gym

    generated = reasoning_gym.create_dataset(dataset, **args, seed=seed, size=4 * (train_size + heldout_size))
    heldout: dict[str, Problem] = {}
    train: list[Problem] = []
    for entry in generated:
        text = entry["question"] if template is None else template.replace("{problem}", entry["question"])
        problem = Problem(text, str(entry["answer"]), json.loads(json.dumps(entry["metadata"])))
        if len(heldout) < heldout_size:
            heldout.setdefault(text, problem)
        elif text not in heldout:
            train.append(problem)
        if len(train) == train_size:
            break
    if len(heldout) < heldout_size or len(train) < train_size:
        raise ValueError(f"reasoning-gym {dataset} {args} produced {len(heldout)} held-out and {len(train)} training problems "
                         f"in {len(generated)} draws (wanted {heldout_size} and {train_size}): its question space is too small")  # fmt: skip
    unique = len({p.prompt for p in train})
    return Splits(train, list(heldout.values())), [
        f"reasoning-gym {dataset}: {len(train)} training rows ({unique} unique questions), {len(heldout)} held-out questions"
    ]


@dataclass(frozen=True)
class MemoryRecallSpec:
    """memory_recall: `chunks` chunks of `per_chunk` assignments ("a=47 k=31 x=90") with distinct letters; the
    asked letter is in the first chunk (its first assignment with asked_first, else at a random place), and
    the last assignment of the last chunk is the decoy (the most recent one read). The question asks for
    the asked letter, so the answer needs the first chunk's assignment carried in memory to the end.
    `teacher_decoy_rate` is the warm start's noisy teacher only: the probability that its last memory write
    keeps the decoy instead of the asked assignment. (asked_first: a 2-layer tiny model does not learn to
    find a letter among three in a warm start: its first write was right 35% of the time after 2,000 steps.)"""

    chunks: int = 2
    per_chunk: int = 3
    min_value: int = 10
    max_value: int = 99
    teacher_decoy_rate: float = 0.7
    asked_first: bool = False

    def validate(self) -> None:
        if self.chunks < 2 or self.per_chunk < 2 or self.chunks * self.per_chunk > 26:
            raise ValueError(f"memory_recall: need chunks >= 2, per_chunk >= 2 and chunks x per_chunk <= 26 letters "
                             f"(got {self.chunks} x {self.per_chunk})")  # fmt: skip
        if not 0 <= self.min_value < self.max_value:
            raise ValueError(f"memory_recall: need 0 <= min_value ({self.min_value}) < max_value ({self.max_value})")
        if not 0 <= self.teacher_decoy_rate <= 1:
            raise ValueError(f"memory_recall: teacher_decoy_rate = {self.teacher_decoy_rate} must be in [0, 1]")


def memory_recall_problem(rng: random.Random, spec: MemoryRecallSpec) -> Problem:
    """One problem: prompt "Question: what is a?", answer "47", metadata chunks / gold_memory / decoy_memory."""
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", spec.chunks * spec.per_chunk)
    values = [rng.randint(spec.min_value, spec.max_value) for _ in letters]
    pairs = [f"{x}={v}" for x, v in zip(letters, values)]
    chunks = [" ".join(pairs[k * spec.per_chunk : (k + 1) * spec.per_chunk]) for k in range(spec.chunks)]
    asked = 0 if spec.asked_first else rng.randrange(spec.per_chunk)
    return Problem(f"Question: what is {letters[asked]}?", str(values[asked]),
                   {"chunks": chunks, "gold_memory": pairs[asked], "decoy_memory": pairs[-1]})  # fmt: skip


def memory_recall_splits(spec: MemoryRecallSpec, train_size: int, heldout_size: int, seed: int = 0) -> Splits:
    """Held-out problems first (distinct question and chunks), then training draws that are never held out."""
    return generated_splits(lambda rng: memory_recall_problem(rng, spec), lambda p: (p.prompt, *p.metadata["chunks"]),
                            train_size, heldout_size, random.Random(seed))  # fmt: skip


@dataclass(frozen=True)
class CalculatorSpec:
    """calculator: "What is 347*29?", an a_digits-digit times a b_digits-digit number, for a tool agent
    (allsync/envs/calculator.py). `teacher_tool_rate` is the warm start's teacher only: how often it calls the
    multiply tool; otherwise it answers at once with an estimate (the product rounded to two significant
    digits, rarely right)."""

    a_digits: int = 3
    b_digits: int = 2
    teacher_tool_rate: float = 0.3
    tools_json: str = "[]"  # the agent's tool schemas (JSON), which the prompts list: the warm start must see the same

    def validate(self) -> None:
        if not (1 <= self.a_digits <= 6 and 1 <= self.b_digits <= 6):
            raise ValueError(f"calculator: a_digits ({self.a_digits}) and b_digits ({self.b_digits}) must be in 1..6")
        if not 0 <= self.teacher_tool_rate <= 1:
            raise ValueError(f"calculator: teacher_tool_rate = {self.teacher_tool_rate} must be in [0, 1]")

    def draw(self, rng: random.Random) -> Problem:
        a = rng.randint(10 ** (self.a_digits - 1), 10**self.a_digits - 1)
        b = rng.randint(10 ** (self.b_digits - 1), 10**self.b_digits - 1)
        return Problem(f"What is {a}*{b}?", str(a * b))


def calculator_splits(spec: CalculatorSpec, train_size: int, heldout_size: int, seed: int = 0) -> Splits:
    return generated_splits(spec.draw, lambda p: p.prompt, train_size, heldout_size, random.Random(f"calculator-{seed}"))


def reward_row(problem: Problem) -> dict:
    """What a reward sees of a problem (JSON): prompt, answer and, when the task has it, metadata."""
    row = {"prompt": problem.prompt, "answer": problem.answer}
    if problem.metadata is not None:
        row["metadata"] = problem.metadata
    return row


def format_response(answer: str) -> str:
    """The assistant's reply the warm start teaches and the verifier reads: `Answer: 432`."""
    return f"{ANSWER_PREFIX}{answer}"


def chat_messages(problem: Problem, with_answer: bool = False) -> list[dict[str, str]]:
    if isinstance(problem.prompt, str):
        messages = [{"role": "user", "content": problem.prompt}]
    else:
        messages = [{"role": role, "content": content} for role, content in problem.prompt]
    if with_answer:
        messages.append({"role": "assistant", "content": format_response(problem.answer)})
    return messages


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The problem as the model sees it: the chat template's token ids, ending with the assistant's turn."""
    return tokenizer.apply_chat_template(chat_messages(problem), add_generation_prompt=True, tokenize=True, return_dict=False)


def longest_prompt_tokens(tokenizer, problems: Iterable[Problem]) -> int:
    """Token count of the longest encoded prompt (distinct prompt texts are encoded once)."""
    return max((len(encode_prompt(tokenizer, Problem(text, ""))) for text in {p.prompt for p in problems}), default=0)


def model_len_needed(longest_prompt: int, max_new_tokens: int, max_position_embeddings: int,
                     new_tokens_name: str = "rollout.max_new_tokens", prompt_name: str = "the longest prompt") -> int:  # fmt: skip
    """Context a rollout engine needs: longest prompt + the most new tokens of one call (a T-PPO window's
    prompt is the prompt plus the response so far, so the same bound holds). An engine with less would end
    responses early as "length" (vLLM does so silently) and overlong shaping would see wrong lengths; a
    model past its max_position_embeddings is outside what it was trained for: ValueError naming both."""
    needed = longest_prompt + max_new_tokens
    if needed > max_position_embeddings:
        raise ValueError(
            f"{new_tokens_name} = {max_new_tokens} plus {prompt_name} ({longest_prompt} tokens) is {needed} "
            f"tokens, more than the checkpoint's max_position_embeddings ({max_position_embeddings})"
        )
    return needed


# ------------------------------------------------------------------------------------------ files
def save_jsonl(problems: Iterable[Problem], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    return path


def load_jsonl(path: str | os.PathLike) -> list[Problem]:
    problems = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or set(row) != {"prompt", "answer"}:
                raise ValueError(f"{path}:{n}: expected an object with keys prompt and answer, got {line.strip()[:80]!r}")
            problems.append(Problem(str(row["prompt"]), str(row["answer"])))
    return problems
