"""Rewards by name (evals/rewards.py): DAPO's math rule case by case, math-verify's equivalences, the registry."""

import pytest

from evals.rewards import dapo_answer, normalize_final_answer, score

# (response, ground truth, DAPO score): each line exercises one normalization rule or one parsing rule
MATH_DAPO_CASES = [
    ("Answer: 42", "42", 1.0),
    ("Answer: 41", "42", -1.0),  # wrong
    ("The answer is 42", "42", -1.0),  # no `Answer:` line and nothing boxed: unparsable scores like wrong
    ("answer: 4", "4", 1.0),  # case-insensitive marker
    ("ANSWER : 4", "4", 1.0),  # spaces before the colon
    ("Answer: 3\nAnswer: 4", "4", 1.0),  # the last `Answer:` counts
    ("Answer: 4\nAnswer: 3", "4", -1.0),
    ("Answer:  7 ", "7", 1.0),  # surrounding spaces
    ("Answer: 1,000", "1000", 1.0),  # thousands commas
    ("Answer: 1,234,567", "1234567", 1.0),
    ("Answer: 100000", "100,000", 1.0),  # commas in the ground truth too
    ("Answer: 2,\\text{and}3", "2,3", 1.0),  # ",\text{and}" -> "," (then digits-and-commas lose the commas)
    ("Answer: $42$", "42", 1.0),  # inside $...$
    ("Answer: the value is $42$ here", "42", 1.0),  # only the $...$ span is kept
    ("Answer: \\boxed{42}", "42", 1.0),  # \boxed{}
    ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # \boxed{} is greedy to the last brace
    ("Answer: \\text{5}", "5", 1.0),  # \text{}
    ("Answer: \\textbf{7}", "7", 1.0),  # \textbf{}
    ("Answer: \\overline{3}", "3", 1.0),  # \overline{}
    ("Answer: \\mbox{5}", "5", 1.0),  # mbox -> text, then \text{} unwrapped
    ("Answer: x = 3", "3", 1.0),  # what follows the last "="
    ("Answer: = 9", "9", 1.0),
    ("Answer: 42 degrees", "42", 1.0),  # units
    ("Answer: 5 cm", "5", 1.0),
    ("Answer: 12 inches", "12", 1.0),
    ("Answer: 3 mph", "3", 1.0),
    ("Answer: 5 dollars", "5", 1.0),
    ("Answer: 10 points", "10", 1.0),
    ("Answer: 90^\\circ", "90", 1.0),  # degree signs
    ("Answer: 90^{\\circ}", "90", 1.0),
    ("Answer: \\$5", "5", 1.0),  # escaped dollar
    ("Answer: a 5", "5", 1.0),  # a leading article
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),  # shorthand \frac
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0),  # shorthand \sqrt
    ("Answer: 1/2", "\\frac{1}{2}", -1.0),  # equal values, different strings: DAPO compares strings
    ("Answer: 5.", "5", -1.0),  # a trailing period is kept (only ".$" is rewritten)
    ("Answer: $5.$", "5", 1.0),  # ... there it is: ".$" -> "$"
    ("Answer: 7\n" + "x" * 400, "7", -1.0),  # only the last 300 characters are read
    ("x" * 400 + "\nAnswer: 7", "7", 1.0),
]


# Without an `Answer:` line, verl 0.9's fallback: the last \boxed{} in the last 100 characters, compared as written.
# Every expected score below is what verl 0.9.1's own `verl.utils.reward_score.math_dapo.compute_score` returned for
# the case (2026-11-26); a grid of 2,420 such cases (20 templates x 11 answers x 11 truths) agreed with it everywhere.
VERL_0_9_CASES = [
    ("The final answer is \\boxed{42}", "42", 1.0),
    ("The final answer is \\boxed{42}", "41", -1.0),
    ("so $\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}", 1.0),
    ("\\boxed{09}", "9", -1.0),  # the boxed content is not normalized
    ("\\boxed{1,000}", "1000", -1.0),
    ("\\boxed{ 42 }", "42", -1.0),
    ("\\boxed{42} meters", "42", 1.0),
    ("first \\boxed{1} then \\boxed{42}", "42", 1.0),  # the last box
    ("first \\boxed{42} then \\boxed{1}", "42", -1.0),
    ("\\fbox{42}", "42", -1.0),  # \boxed only
    ("\\boxed{42", "42", -1.0),  # unbalanced
    ("\\boxed{42}" + " filler" * 20, "42", -1.0),  # the box is not in the last 100 characters
    ("Answer: \\boxed{42}", "42", 1.0),
    ("\\boxed{42} Answer: 5", "42", -1.0),  # an `Answer:` line wins over any box
    ("Answer: 5 \\boxed{42}", "42", -1.0),
    ("Answer: 42" + " x" * 100, "42", -1.0),  # the rest of the line belongs to the answer
    ("\\boxed{\\text{(B)}}", "\\text{(B)}", 1.0),
    ("Answer: \\text{(B)}", "(B)", 1.0),
]


@pytest.mark.parametrize("response, truth, expected", MATH_DAPO_CASES + VERL_0_9_CASES)
def test_math_dapo(response, truth, expected):
    assert score("math_dapo", response, truth) == expected


def test_math_dapo_reads_the_boxed_fallback_as_its_answer():
    from evals.rewards import answer_of

    assert answer_of("math_dapo", "so \\boxed{7}.") == "7"
    assert answer_of("math_dapo", "\\boxed{7}\nAnswer: 8") == "8"
    assert answer_of("math_dapo", "no answer") is None


def test_normalization_steps():
    assert normalize_final_answer("\\boxed{100,000}") == "100000"
    assert normalize_final_answer("  $\\frac{3}{4}$ ") == "\\frac{3}{4}"
    assert normalize_final_answer("5\\text{ cm}^2") == "5"  # spaces go first, then "cm", then "\text{}^2"
    assert dapo_answer("no marker") is None
    assert dapo_answer("Answer: 3 apples\nmore text") == "3 apples"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the result is \\boxed{1/2}", "0.5", 1.0),  # \boxed first, equal values
        ("Answer: \\frac{2}{4}", "1/2", 1.0),  # the `Answer:` line when nothing is boxed
        ("\\boxed{\\frac{1}{2}} and later Answer: 3", "0.5", 1.0),  # the box wins over the line
        ("\\boxed{3}", "4", 0.0),
        ("I do not know", "3", 0.0),
        ("Answer: 2\\sqrt{2}", "\\sqrt{8}", 1.0),  # simplified
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # expanded
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),  # sets in any order
        ("Answer: 50\\%", "0.5", 1.0),  # percent
    ],
)
def test_math_verify(response, truth, expected):
    assert score("math_verify", response, truth) == expected


def test_exact_and_arithmetic():
    assert score("exact", "Answer: 42", "42") == 1.0
    assert score("exact", "Answer: 1,234", "1234") == 0.0  # exact means exact
    assert score("arithmetic", "Answer: 1,234", "1234") == 1.0  # the default task compares numbers
    assert score("arithmetic", "no answer", "3") == 0.0


def test_unknown_reward_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown reward 'f1'; known: math_dapo, math_verify, exact, arithmetic"):
        score("f1", "Answer: 1", "1")
