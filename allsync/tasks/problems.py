"""What every task shares: a Problem (prompt, answer, metadata), seeded disjoint Splits, and how a problem
becomes a chat prompt, a reward row or a supervised example.

Splits: the held-out set is drawn first (distinct by a key), then training draws whose key is never a held-out
one, so no held-out problem ever appears in train (train may repeat a problem when the space is small).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ANSWER_PREFIX = "Answer: "


@dataclass(frozen=True)
class Problem:
    prompt: str | tuple[tuple[str, str], ...]  # the user's text, or (role, content) messages (dataset rows)
    answer: str
    metadata: dict | None = field(default=None, compare=False)  # what the reward needs besides the answer (JSON)


@dataclass(frozen=True)
class Splits:
    train: list[Problem]
    heldout: list[Problem]


def draws_without_news(seen: int) -> int:
    """Consecutive draws that found nothing new after which a generator counts as exhausted: 20 (seen + 1) + 1000.
    A uniform generator over N > seen keys finds an unseen one with probability >= 1/N per draw, so it misses that
    many times in a row with probability below (1 - 1/N)^(20 N) < e^-20."""
    return 20 * (seen + 1) + 1000


def generated_splits(draw, key, train_size: int, heldout_size: int, rng: random.Random) -> Splits:
    """`heldout_size` problems distinct by key(problem) drawn first, then `train_size` draws whose key is
    never a held-out one (train may repeat a problem). draw(rng) -> Problem. A generator with fewer distinct
    problems than task.heldout_size, or none left to train on, is a ValueError naming the keys (`draws_without_news`
    draws in a row found nothing new: before, the loop never returned)."""
    heldout: dict = {}
    misses = 0
    while len(heldout) < heldout_size:
        p = draw(rng)
        misses = misses + 1 if key(p) in heldout else 0
        heldout.setdefault(key(p), p)
        if misses > draws_without_news(len(heldout)):
            raise ValueError(
                f"task.heldout_size = {heldout_size}: the task's generator gives only {len(heldout)} distinct "
                f"problems (no new one in the last {misses} draws); lower task.heldout_size or widen the task"
            )
    train: list[Problem] = []
    misses = 0
    while len(train) < train_size:
        p = draw(rng)
        if key(p) not in heldout:
            train.append(p)
            misses = 0
        elif (misses := misses + 1) > draws_without_news(len(heldout)):
            raise ValueError(
                f"task.heldout_size = {heldout_size} holds out every problem the task's generator gives (no training "
                f"problem in {misses} draws), so task.train_size = {train_size} has none to draw; lower "
                "task.heldout_size or widen the task"
            )
    return Splits(train=train, heldout=list(heldout.values()))


def reward_row(problem: Problem) -> dict:
    """What a reward sees of a problem (JSON): prompt, answer and, when the task has it, metadata."""
    row = {"prompt": problem.prompt, "answer": problem.answer}
    if problem.metadata is not None:
        row["metadata"] = problem.metadata
    return row


def format_response(answer: str) -> str:
    """The assistant's reply the warm start teaches and the verifier reads: `Answer: 432`."""
    return f"{ANSWER_PREFIX}{answer}"


def chat_messages(problem: Problem, with_answer: bool = False, response: str | None = None) -> list[dict[str, str]]:
    """The problem's chat messages; with_answer adds the assistant's reply: `response`, or `Answer: N`."""
    if isinstance(problem.prompt, str):
        messages = [{"role": "user", "content": problem.prompt}]
    else:
        messages = [{"role": role, "content": content} for role, content in problem.prompt]
    if with_answer:
        messages.append({"role": "assistant", "content": response or format_response(problem.answer)})
    return messages


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The problem as the model sees it: the chat template's token ids, ending with the assistant's turn."""
    return tokenizer.apply_chat_template(
        chat_messages(problem), add_generation_prompt=True, tokenize=True, return_dict=False
    )


def longest_prompt_tokens(tokenizer, problems: Iterable[Problem]) -> int:
    """Token count of the longest encoded prompt (distinct prompt texts are encoded once)."""
    return max((len(encode_prompt(tokenizer, Problem(text, ""))) for text in {p.prompt for p in problems}), default=0)


def model_len_needed(
    longest_prompt: int,
    max_new_tokens: int,
    max_position_embeddings: int,
    new_tokens_name: str = "rollout.max_new_tokens",
    prompt_name: str = "the longest prompt",
) -> int:
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


# ------------------------------------------------------------------------------------------ supervised examples
def encode_problems(
    tokenizer, problems: list[Problem], with_answer: bool, responses: list[str] | None = None
) -> list[list[int]]:
    """Chat-formatted token ids; with_answer appends the reply (`responses[i]`, or `Answer: N`) and eos (the
    template's assistant turn)."""
    responses = responses or [None] * len(problems)
    texts = [
        tokenizer.apply_chat_template(
            chat_messages(p, with_answer, r), add_generation_prompt=not with_answer, tokenize=False
        )
        for p, r in zip(problems, responses)
    ]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def answer_start(prompt_ids: list[int], full_ids: list[int]) -> int:
    """Index of the first answer token: the prompt (ending in `<｜Assistant｜>`) must prefix the example."""
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError("the chat template's prompt is not a prefix of the full example")
    return len(prompt_ids)


def answer_examples(
    tokenizer, problems: list[Problem], responses: list[str] | None = None
) -> list[tuple[list[int], int]]:
    """(prompt + reply + eos ids, index of the first reply token) per problem: a one-step task's teacher; the reply
    is `responses[i]`, or `Answer: N`."""
    full = encode_problems(tokenizer, problems, with_answer=True, responses=responses)
    prompts = encode_problems(tokenizer, problems, with_answer=False)
    return [(f, answer_start(p, f)) for p, f in zip(prompts, full)]


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
                raise ValueError(
                    f"{path}:{n}: expected an object with keys prompt and answer, got {line.strip()[:80]!r}"
                )
            problems.append(Problem(str(row["prompt"]), str(row["answer"])))
    return problems


# ------------------------------------------------------------------------------------------ templates
def check_template(template: str | None, fail) -> None:
    """task.template is dapo_math (DAPO's math prompt), a text with {problem}, or None."""
    if template is not None and template != "dapo_math" and "{problem}" not in template:
        fail(f"task.template = {template!r}: use dapo_math or a text containing {{problem}}")


def template_text(template: str | None) -> str | None:
    """The prompt text of task.template: DAPO's math prompt for dapo_math, else the text (None: as is)."""
    from evals.datasets import DAPO_MATH_TEMPLATE

    return DAPO_MATH_TEMPLATE if template == "dapo_math" else template
