"""task.reads_notes (issue 49, NLFT): the warm start teaches prompts carrying the standard answer or a judgment, each
followed by the problem's own reply, so that the base reads the notes recipes/nlft.py scores with."""

import random

from transformers import AutoTokenizer

from allsync.config import parse_config
from allsync.tasks.arithmetic import (
    NOTE_EVERY,
    ArithmeticGenerator,
    judgment,
    make_problem,
    standard_note,
    teach_notes,
    with_note,
    wrong_answer,
)
from allsync.warm_start import settings_for_run


def test_a_wrong_answer_is_wrong_and_judged_by_its_first_wrong_digit_or_its_length():
    rng = random.Random(0)
    lengths = 0
    for _ in range(500):
        truth = str(rng.randint(20, 198))
        wrong = wrong_answer(truth, rng)
        assert wrong != truth and wrong.isdigit() and not (len(wrong) > 1 and wrong[0] == "0")
        said = judgment(wrong, truth)
        if len(wrong) == len(truth):
            i = next(i for i, (a, b) in enumerate(zip(wrong, truth)) if a != b)
            assert said == f"the answer {wrong} is wrong at digit {i + 1}: {wrong[i]} should be {truth[i]}"
        else:
            lengths += 1
            assert said.endswith(f"the right one has {len(truth)}")
    assert 0.1 < lengths / 500 < 0.3


def test_one_prompt_in_four_carries_the_standard_answer_and_one_in_four_a_judgment():
    rng = random.Random(1)
    problems = [make_problem(rng.randint(10, 99), "+", rng.randint(10, 99)) for _ in range(2000)]
    noted = teach_notes(problems, random.Random(2))
    assert [n.answer for n in noted] == [p.answer for p in problems]
    standard = sum(n == with_note(p, standard_note(p.answer)) for p, n in zip(problems, noted))
    judged = sum(n.prompt.startswith(p.prompt + " (the answer ") for p, n in zip(problems, noted))
    right = sum(n == with_note(p, judgment(p.answer, p.answer)) for p, n in zip(problems, noted))
    plain = sum(n == p for p, n in zip(problems, noted))
    assert abs(standard / 2000 - 1 / NOTE_EVERY) < 0.03 and abs(judged / 2000 - 1 / NOTE_EVERY) < 0.03
    assert abs(right / max(judged, 1) - 0.2) < 0.06 and standard + judged + plain == 2000


def test_the_teacher_answers_a_noted_prompt_with_the_plain_problems_reply(tiny_bf16):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_bf16))
    problems = [make_problem(47, "+", 38), make_problem(10, "+", 11), make_problem(23, "+", 45)] * 4
    for reasoning in ("none", "verbose"):
        plain = ArithmeticGenerator(2, 2, ("+",), reasoning=reasoning).teacher_examples(tokenizer, problems, 0)
        noted = ArithmeticGenerator(2, 2, ("+",), reasoning=reasoning, reads_notes=True).teacher_examples(
            tokenizer, problems, 0
        )
        assert [f[s:] for f, s in plain] == [f[s:] for f, s in noted]
        assert any(f[:s] != g[:t] for (f, s), (g, t) in zip(plain, noted))


def test_task_reads_notes_reaches_the_warm_start_and_its_stored_settings_only_when_set():
    on = settings_for_run(
        parse_config({"model": {"warm_start": True}, "task": {"name": "arithmetic", "reads_notes": True}})
    )
    off = settings_for_run(parse_config({"model": {"warm_start": True}}))
    assert on.task.reads_notes and on.as_json()["task"]["reads_notes"] is True
    assert "reads_notes" not in off.as_json()["task"]  # bases built before the key compare alike
