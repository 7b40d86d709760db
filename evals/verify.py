"""Verification of an extracted answer against the gold one, and the RL reward built on it.

    is_equivalent("432", "432")      -> True    (exact match, no parsing)
    is_equivalent("1,234", "1234")   -> True    (integers compared as integers)
    is_equivalent("0.5", "1/2")      -> True    (math_verify: parse both, then verify)
    answer_reward("Answer: 432", problem with answer "432") -> 1.0

Fast paths first: identical strings are equal; two plain integers (optional sign, optional thousands
commas) are compared as integers and never reach math_verify. Everything else goes through the real
math_verify (`parse` + `verify`). math_verify's timeout uses signal.alarm, which only works in the
main thread; elsewhere it runs without one (answers are at most MAX_ANSWER_CHARS long).
"""

from __future__ import annotations

import re
import threading
from typing import Protocol

from evals.extract import extract_answer

_INTEGER = re.compile(r"^[+-]?\d{1,3}(,\d{3})+$|^[+-]?\d+$")
MATH_VERIFY_TIMEOUT_S = 5


class HasAnswer(Protocol):
    answer: str


def as_integer(text: str) -> int | None:
    """'-1,234' -> -1234; None unless the whole string is a plain integer."""
    text = text.strip()
    return int(text.replace(",", "")) if _INTEGER.match(text) else None


def _timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_verify_equal(gold: str, predicted: str) -> bool:
    """math_verify.verify(parse(gold), parse(predicted)); unparsable input is simply not equal."""
    from math_verify import parse, verify

    timeout = _timeout()
    gold_parsed = parse(gold, parsing_timeout=timeout)
    pred_parsed = parse(predicted, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def is_equivalent(predicted: str, gold: str) -> bool:
    """Exact match, then integer comparison, then math_verify."""
    if predicted.strip() == gold.strip():
        return True
    pred_int, gold_int = as_integer(predicted), as_integer(gold)
    if pred_int is not None and gold_int is not None:
        return pred_int == gold_int
    return math_verify_equal(gold, predicted)


def is_correct(response: str, gold: str) -> bool:
    """The response's extracted answer is equivalent to `gold`; no `Answer:` is incorrect."""
    predicted = extract_answer(response)
    return predicted is not None and is_equivalent(predicted, gold)


def answer_reward(response: str, problem: HasAnswer) -> float:
    """1.0 when the response's answer verifies against problem.answer, else 0.0 (format failures too)."""
    return 1.0 if is_correct(response, problem.answer) else 0.0
