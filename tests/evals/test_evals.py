"""evals: answer extraction, verification (exact, integer, math_verify), reward, metrics with hand-computed values."""

import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evals import (
    answer_reward,
    avg_at_k,
    correct_per_1k_tokens,
    extract_answer,
    is_correct,
    is_equivalent,
    mean_pass_at_k,
    pass_at_k,
    summarize,
)
from evals.verify import as_integer


class Gold:
    def __init__(self, answer):
        self.answer = answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: 432", "432"),
        ("Answer:432", "432"),
        ("3+4 is 7. Answer: 7.", "7"),
        ("Answer: 1\nthen Answer: -12 ", "-12"),  # the last marker wins
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("Answer: 12\nmore text", "12"),  # the answer ends at its line
        ("I think 7", None),
        ("Answer:   ", None),
        ("answer: 7", None),  # the marker is case-sensitive, as the warm start teaches it
        ("Answer: " + "9" * 65, None),  # longer than MAX_ANSWER_CHARS
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_integer_fast_path():
    assert as_integer("-1,234") == -1234 and as_integer("+07") == 7
    assert as_integer("12,34") is None and as_integer("1.5") is None and as_integer("12a") is None
    assert is_equivalent("1,234", "1234") and is_equivalent("007", "7")
    assert not is_equivalent("433", "432") and not is_equivalent("-432", "432")


def test_math_verify_path():
    assert is_equivalent("0.5", "1/2")
    assert is_equivalent("\\frac{1}{2}", "0.5")
    assert is_equivalent("432.0", "432")
    assert not is_equivalent("0.25", "1/2")
    assert not is_equivalent("banana", "432")


def test_math_verify_in_a_thread():
    """math_verify's signal timeout only works in the main thread; ours falls back to no timeout."""
    results = []
    worker = threading.Thread(target=lambda: results.append(is_equivalent("0.5", "1/2")))
    worker.start()
    worker.join()
    assert results == [True]


def test_answer_reward():
    p = Gold("432")
    assert answer_reward("Answer: 432", p) == 1.0
    assert answer_reward("Answer: 432.", p) == 1.0
    assert answer_reward("Answer: 433", p) == 0.0
    assert answer_reward("432", p) == 0.0  # no marker: format failure
    assert answer_reward("Answer: 4", p) == 0.0  # truncated
    assert is_correct("Answer: 1/2", "0.5")


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 1, 0.4),  # pass@1 = c/n
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (4, 0, 2, 0.0),
        (4, 3, 2, 1.0),  # n - c < k
        (16, 1, 16, 1.0),
        (100, 1, 10, 0.1),  # 1 - C(99,10)/C(100,10) = 10/100
    ],
)
def test_pass_at_k_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_binomials(nck):
    n, c, k = nck
    exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-9)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        pass_at_k(5, 2, 6)


def test_mean_pass_at_k_and_avg_at_k():
    per_problem = [[True, False, False, True, False], [False] * 5, [True] * 5]
    assert mean_pass_at_k(per_problem, 2) == pytest.approx((0.7 + 0.0 + 1.0) / 3)
    assert avg_at_k(per_problem) == pytest.approx((2 + 0 + 5) / 15)
    assert avg_at_k([[True, False, False, False]]) == 0.25
    with pytest.raises(ValueError):
        avg_at_k([[True], [True, False]])  # every problem needs the same k


def test_correct_per_1k_tokens():
    # 3 correct of 4, 10+20+30+40 = 100 tokens -> 30 per 1k; = 1000 * 0.75 / 25
    correct, lengths = [True, True, False, True], [10, 20, 30, 40]
    assert correct_per_1k_tokens(correct, lengths) == pytest.approx(30.0)
    s = summarize(correct, [True, True, True, False], lengths)
    assert (s.samples, s.accuracy, s.format_rate, s.mean_length) == (4, 0.75, 0.75, 25.0)
    assert s.correct_per_1k_tokens == pytest.approx(1000 * s.accuracy / s.mean_length)
    assert correct_per_1k_tokens([False], [0]) == 0.0


def test_evals_imports_neither_allsync_quant_nor_moe_lora():
    import subprocess
    import sys

    code = "import sys, evals; print(sorted(m for m in sys.modules if m.split('.')[0] in ('allsync', 'quant', 'moe_lora')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
