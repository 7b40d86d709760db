"""task.reasoning verbose (balanced reasoning, issue 27): the reply the warm start teaches, its bounds, its refusals."""

import random

import pytest
from transformers import AutoTokenizer

from allsync.config import ConfigError, parse_config
from allsync.tasks.arithmetic import MAX_RESTATEMENTS, ArithmeticGenerator, make_problem, operands, verbose_reply
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
        ({"reasoning": "terse"}, r"reasoning 'terse': use none or verbose"),
        ({"reasoning": "verbose", "ops": ["+", "*"]}, r"reasoning verbose with ops \['\+', '\*'\]"),
    ],
)
def test_reasoning_is_checked_naming_the_value(tiny_bf16, task, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"model": {"base": str(tiny_bf16)}, "task": {"name": "arithmetic", **task}})
