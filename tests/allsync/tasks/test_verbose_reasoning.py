"""task.reasoning verbose and mixed (balanced reasoning, issues 27 and 49): the replies the warm start teaches, their
bounds, the refusals."""

import random

import pytest
from transformers import AutoTokenizer

from allsync.config import ConfigError, parse_config
from allsync.tasks.arithmetic import (
    COMPACT_EVERY,
    MAX_RESTATEMENTS,
    ArithmeticGenerator,
    compact_reply,
    make_problem,
    operands,
    verbose_reply,
)
from evals.rewards import score


def test_the_verbose_reply_sums_column_by_column_and_ends_with_the_answer_line():
    assert verbose_reply(47, 38, 1) == (
        "47+38: ones 7+8=15, write 5 carry 1. tens 4+3+1=8, write 8. so 47+38=85. again: 47+38=85.\nAnswer: 85"
    )
    assert verbose_reply(99, 99, 0).startswith(
        "99+99: ones 9+9=18, write 8 carry 1. tens 9+9+1=19, write 9 carry 1. hundreds 0+0+1=1, write 1. so 99+99=198."
    )
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        reply = verbose_reply(a, b, rng.randint(0, MAX_RESTATEMENTS))
        assert score("arithmetic", reply, str(a + b)) == 1.0  # the default task's reward reads the answer line


def test_the_longest_reply_bounds_the_task_and_the_teacher_writes_it(tiny_bf16):
    spec = ArithmeticGenerator(2, 2, ("+",), reasoning="verbose")
    assert spec.max_response_tokens() == len(verbose_reply(99, 99, MAX_RESTATEMENTS)) + 1
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_bf16))
    problems = [make_problem(47, "+", 38), make_problem(10, "+", 11)]
    assert [operands(p) for p in problems] == [(47, 38), (10, 11)]
    for full, start in spec.teacher_examples(tokenizer, problems, seed=0):
        reply = tokenizer.decode(full[start:], skip_special_tokens=True)
        assert reply.split(":")[0] in ("47+38", "10+11") and "\nAnswer: " in reply


@pytest.mark.parametrize(
    "task, message",
    [
        ({"reasoning": "terse"}, r"reasoning 'terse': use none or verbose or mixed"),
        ({"reasoning": "verbose", "ops": ["+", "*"]}, r"reasoning verbose with ops \['\+', '\*'\]"),
    ],
)
def test_reasoning_is_checked_naming_the_value(tiny_bf16, task, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"model": {"base": str(tiny_bf16)}, "task": {"name": "arithmetic", **task}})


def test_the_compact_reply_is_the_verbose_ones_columns_in_a_few_tokens():
    assert compact_reply(47, 38) == "47+38: 7+8=15 4+3+1=8\nAnswer: 85"
    assert compact_reply(99, 99) == "99+99: 9+9=18 9+9+1=19 0+0+1=1\nAnswer: 198"
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        assert score("arithmetic", compact_reply(a, b), str(a + b)) == 1.0
        assert len(compact_reply(a, b)) < 0.5 * len(verbose_reply(a, b, 0))


def test_mixed_reasoning_teaches_the_verbose_replies_and_about_one_compact_reply_in_four(tiny_bf16):
    """reasoning mixed: each problem's reply is verbose's own (the same restatements) or, for about one problem in
    COMPACT_EVERY, compact_reply; the bound is verbose's longest reply."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_bf16))
    rng = random.Random(1)
    problems = [make_problem(rng.randint(10, 99), "+", rng.randint(10, 99)) for _ in range(400)]
    verbose = ArithmeticGenerator(2, 2, ("+",), reasoning="verbose")
    mixed = ArithmeticGenerator(2, 2, ("+",), reasoning="mixed")
    assert mixed.max_response_tokens() == verbose.max_response_tokens()
    compact = 0
    for p, (v, _), (m, start) in zip(
        problems, verbose.teacher_examples(tokenizer, problems, 0), mixed.teacher_examples(tokenizer, problems, 0)
    ):
        reply = tokenizer.decode(m[start:], skip_special_tokens=True)
        if m != v:
            assert reply == compact_reply(*operands(p))
            compact += 1
    assert abs(compact / len(problems) - 1 / COMPACT_EVERY) < 0.06
    with pytest.raises(ConfigError, match=r"reasoning mixed with ops"):
        parse_config(
            {"model": {"base": str(tiny_bf16)}, "task": {"name": "arithmetic", "reasoning": "mixed", "ops": ["-"]}}
        )
