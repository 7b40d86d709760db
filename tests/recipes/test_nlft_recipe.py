"""recipes/nlft.py: the judgments it writes for the tiny task, and a short run of both methods end to end."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from nlft import judgment, main  # noqa: E402


@pytest.mark.parametrize(
    "answer, truth, said",
    [
        ("457", "467", "the answer 457 is wrong at digit 2: 5 should be 6"),
        ("45", "467", "the answer 45 has 2 digits, the right one has 3"),
        (None, "467", "the reply gives no answer; the answer is 467"),
    ],
)
def test_the_judgment_names_the_wrong_digit(answer, truth, said):
    assert judgment(answer, truth) == said


def test_both_methods_train_from_the_same_examples_and_are_evaluated(warm_tiny, tmp_path, capsys):
    results = main(
        ["--seeds", "0", "--epochs", "1", "--examples", "10", "--base", str(warm_tiny), "--out", str(tmp_path)]
    )
    rows = [json.loads(line) for line in (tmp_path / "seed-0" / "examples.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and all(set(r) == {"prompt", "answer", "response", "correct", "judgment"} for r in rows)
    assert all(bool(r["judgment"]) != r["correct"] for r in rows)  # a judgment for each wrong answer, none else
    for method in ("sft", "nlft"):
        assert len(results[method]) == 1 and 0 <= results[method][0]["heldout"] <= 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("NLFT vs SFT on 10 examples: held-out ")
