"""allsync.tasks: seeded arithmetic problems, disjoint splits, JSONL round trip."""

import json
import random

import pytest

from allsync.tasks import (
    ArithmeticGenerator,
    Problem,
    chat_messages,
    digit_count,
    format_response,
    load_jsonl,
    make_problem,
    make_splits,
    sample_problem,
    save_jsonl,
)
from evals import answer_reward


def test_make_problem_answers():
    assert make_problem(47, "+", 385) == Problem("What is 47+385?", "432")
    assert make_problem(12, "-", 30).answer == "-18"
    assert make_problem(12, "*", 31).answer == "372"


def test_space_size():
    assert digit_count(1) == 10 and digit_count(3) == 900
    assert ArithmeticGenerator(2, 2).space_size() == 90 * 90
    assert ArithmeticGenerator(1, 2, ops=("+", "-")).space_size() == 100 * 100 * 2


def test_longest_answer():
    assert ArithmeticGenerator(2, 2).max_answer_chars() == 3  # 99+99 = 198
    assert ArithmeticGenerator(2, 2).max_response_tokens() == 12  # "Answer: 198" + eos
    assert ArithmeticGenerator(1, 3, ops=("-",), nonnegative=False).max_answer_chars() == 4  # 0-999
    assert ArithmeticGenerator(1, 3, ops=("-",)).max_answer_chars() == 3
    assert ArithmeticGenerator(2, 3, ops=("+", "*")).max_answer_chars() == 6  # 999*999 = 998001


def test_operands_respect_digits():
    rng = random.Random(0)
    spec = ArithmeticGenerator(min_digits=2, max_digits=3, ops=("-",))
    for _ in range(500):
        p = sample_problem(rng, spec)
        a, b = p.prompt.removeprefix("What is ").removesuffix("?").split("-")
        assert 10 <= int(b) <= int(a) <= 999  # nonnegative: larger operand first
        assert int(p.answer) == int(a) - int(b) >= 0


def test_splits_are_seeded_and_disjoint():
    spec = ArithmeticGenerator(min_digits=2, max_digits=2)
    s1 = make_splits(spec, train_size=3000, heldout_size=200, seed=0)
    s2 = make_splits(spec, train_size=3000, heldout_size=200, seed=0)
    s3 = make_splits(spec, train_size=3000, heldout_size=200, seed=1)
    assert s1 == s2 and s1.heldout != s3.heldout
    assert len(s1.train) == 3000 and len(s1.heldout) == 200
    held = {p.prompt for p in s1.heldout}
    assert len(held) == 200  # distinct
    assert not held & {p.prompt for p in s1.train}
    assert all(answer_reward(format_response(p.answer), p) == 1.0 for p in s1.train[:50] + s1.heldout[:50])


def test_splits_refuse_a_heldout_set_that_eats_the_space():
    with pytest.raises(ValueError, match="more than half"):
        make_splits(ArithmeticGenerator(1, 1), train_size=10, heldout_size=60)  # only 100 problems exist


def test_spec_validation():
    with pytest.raises(ValueError):
        ArithmeticGenerator(min_digits=3, max_digits=2).validate()
    with pytest.raises(ValueError):
        ArithmeticGenerator(ops=("/",)).validate()


def test_chat_messages():
    p = Problem("What is 1+2?", "3")
    assert chat_messages(p) == [{"role": "user", "content": "What is 1+2?"}]
    assert chat_messages(p, with_answer=True)[1] == {"role": "assistant", "content": "Answer: 3"}


def test_jsonl_roundtrip(tmp_path):
    problems = make_splits(ArithmeticGenerator(), train_size=20, heldout_size=5, seed=3).train
    path = save_jsonl(problems, tmp_path / "sub" / "train.jsonl")
    assert load_jsonl(path) == problems
    assert json.loads(path.read_text().splitlines()[0]) == {"prompt": problems[0].prompt, "answer": problems[0].answer}


def test_jsonl_rejects_other_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_jsonl(path)


def test_generated_splits_refuse_a_generator_with_too_few_problems_naming_the_keys():
    """A generator of 5 distinct problems: 4 held out leave one to train on; 5 leave none and 6 cannot be drawn.
    Both are refused naming task.heldout_size (before: the loop never returned)."""
    import random

    from allsync.tasks import Problem, generated_splits

    def draw(rng):
        n = rng.randrange(5)
        return Problem(f"say {n}", str(n))

    splits = generated_splits(draw, lambda p: p.prompt, 20, 4, random.Random(0))
    (left,) = {p.prompt for p in splits.train}
    assert len(splits.heldout) == 4 and left not in {p.prompt for p in splits.heldout} and len(splits.train) == 20
    with pytest.raises(ValueError, match=r"task\.heldout_size = 5 holds out every problem .* task\.train_size = 20"):
        generated_splits(draw, lambda p: p.prompt, 20, 5, random.Random(0))
    with pytest.raises(
        ValueError, match=r"task\.heldout_size = 6: the task's generator gives only 5 distinct problems"
    ):
        generated_splits(draw, lambda p: p.prompt, 20, 6, random.Random(0))
