"""Rewards by name, one entry point: `score(name, response, ground_truth) -> float`.

    score("math_dapo", "...\\nAnswer: 1,000", "1000")     -> 1.0   (DAPO's rule: +1 right, -1 wrong or unparsable)
    score("math_verify", "so \\boxed{1/2}", "0.5")         -> 1.0   (math-verify, 0/1)
    score("exact", "Answer: 42", "42")                     -> 1.0   (the `Answer:` line equals the truth, 0/1)
    score("arithmetic", "Answer: 1,234", "1234")           -> 1.0   (evals.verify.is_correct, the default task's)
    score("reasoning_gym", "Answer: -4", "-4", metadata)    -> 1.0   (the generator's own score_answer, 0..1)

`reasoning_gym` needs the task entry's metadata (its `source_dataset` names the generator whose
`score_answer(answer, entry)` scores the answer; partial credit is possible). The answer is the last
`Answer:` line, else the last <answer>...</answer> (reasoning-gym's own convention).
`answer_of(name, response)` is the answer each reward reads (evaluations record it); `is_correct_score`
says which scores count as correct: above 0 (math_dapo's +1, the 0/1 rewards, user functions), and
exactly 1 for reasoning_gym, whose partial credit is not a solved problem.

`math_dapo` follows DAPO's reward as verl 0.9.1's `reward_score/math_dapo.py` computes it: keep the last 300
characters of the response, take the text after the last `Answer:` (case-insensitive, to the end of its
line), normalize it and the ground truth with the final-answer normalization of Minerva (Lewkowycz et al.,
2022), which DAPO reuses, and compare the two strings exactly. Without an `Answer:` line, the content of the last
`\\boxed{...}` in the last 100 of those characters is compared with the ground truth as written (verl 0.9's
fallback; before it such a response scored -1). Normalization, in order:
  1. keep what follows the last `=`;
  2. substitutions: drop a leading article ("an ", "a "), ".$" -> "$", drop "\\$", "\\ " and spaces,
     "mbox" -> "text", ",\\text{and}" and "\\text{and}" -> ",", "\\text{m}" -> "\\text{}";
  3. remove unit words and TeX decorations (`UNIT_AND_DECORATION_STRINGS`);
  4. keep the inside of the first $...$ span, of \\text{..}, \\textbf{..}, \\overline{..}, and of \\boxed{..}
     (greedy: up to the last closing brace);
  5. shorthand TeX: \\fracab -> \\frac{a}{b}, \\sqrta -> \\sqrt{a};
  6. drop every "$"; an answer that is digits apart from commas loses its commas ("100,000" -> "100000");
  7. strip surrounding whitespace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from evals.extract import extract_answer
from evals.verify import is_correct, math_verify_equal

DAPO_TAIL_CHARS = 300  # DAPO scores only the end of a response
STRICT_BOX_TAIL_CHARS = 100  # the boxed fallback looks at the last 100 of those 300 characters
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
UNIT_AND_DECORATION_STRINGS = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_UNWRAP = (  # (pattern, replacement) applied once each, in order
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's final-answer normalization (steps 1-7 of the module docstring)."""
    text = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        text = text.replace(old, new)
    for piece in UNIT_AND_DECORATION_STRINGS:
        text = text.replace(piece, "")
    for pattern, replacement in _UNWRAP:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_answer(response: str) -> str | None:
    """The text after the last `Answer:` in the response's last 300 characters, or None."""
    found = _ANSWER_LINE.findall(response[-DAPO_TAIL_CHARS:])
    return found[-1] if found else None


def dapo_boxed_fallback(response: str) -> str | None:
    """math_dapo's answer when no `Answer:` line is there: the last \\boxed{...} in the last 100 of the response's
    last 300 characters (verl 0.9's `is_correct_strict_box`), or None."""
    return last_boxed(response[-DAPO_TAIL_CHARS:][-STRICT_BOX_TAIL_CHARS:], commands=("\\boxed{",))


def math_dapo(response: str, ground_truth: str) -> float:
    """+1.0 when the normalized last `Answer:` equals the normalized ground truth; without an `Answer:` line,
    +1.0 when the last \\boxed{} of the response's end equals the ground truth as written (no normalization);
    else -1.0 (wrong and unparsable alike). The rule of verl 0.9.1's `reward_score/math_dapo.py`."""
    answer = dapo_answer(response)
    if answer is not None:
        return 1.0 if normalize_final_answer(answer) == normalize_final_answer(ground_truth) else -1.0
    return 1.0 if dapo_boxed_fallback(response) == ground_truth else -1.0


def last_boxed(text: str, commands: tuple[str, ...] = ("\\boxed{", "\\fbox{")) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}; `commands`), braces balanced, or None."""
    start = max(text.rfind(command) for command in commands)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def math_verify_reward(response: str, ground_truth: str) -> float:
    """1.0 when math-verify finds the response's answer equal to the ground truth: the last \\boxed{} first,
    else the `Answer:` line, else the whole response (math-verify's own extraction); 0.0 otherwise."""
    gold = (
        ground_truth if "$" in ground_truth or "\\boxed" in ground_truth else f"${ground_truth}$"
    )  # LaTeX for math-verify
    candidate = last_boxed(response)
    if candidate is None:
        candidate = extract_answer(response)
    if candidate is not None:
        return 1.0 if math_verify_equal(gold, f"${candidate}$") else 0.0
    return 1.0 if math_verify_equal(gold, response) else 0.0


def exact(response: str, ground_truth: str) -> float:
    """1.0 when the `Answer:` line, stripped, equals the ground truth, stripped."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and answer.strip() == ground_truth.strip() else 0.0


def arithmetic(response: str, ground_truth: str) -> float:
    """The default task's reward: the `Answer:` is the same number (or verifies) (evals.verify.is_correct)."""
    return 1.0 if is_correct(response, ground_truth) else 0.0


_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def tagged_or_marked_answer(response: str) -> str | None:
    """The `Answer:` line's answer (evals.extract), else the last <answer>...</answer>, stripped."""
    answer = extract_answer(response)
    if answer is None and (tags := _ANSWER_TAG.findall(response)):
        answer = tags[-1].strip()
    return answer


def reasoning_gym_reward(response: str, ground_truth: str, metadata: dict | None) -> float:
    """The reasoning-gym generator's `score_answer` (in [0, 1]) of the response's answer; 0 without one."""
    if not metadata or "source_dataset" not in metadata:
        raise ValueError("the reasoning_gym reward needs the task entry's metadata with its source_dataset")
    import reasoning_gym

    answer = tagged_or_marked_answer(response)
    if answer is None:
        return 0.0
    scorer = reasoning_gym.get_score_answer_fn(metadata["source_dataset"])
    return float(scorer(answer, {"question": "", "answer": ground_truth, "metadata": metadata}))


@dataclass(frozen=True)
class Reward:
    """A reward by name and what its callers ask of it, so that none branches on the name.

    compute: (response, ground_truth) -> float, or (response, ground_truth, metadata) with needs_metadata.
    answer: the answer it reads from a response (None: none found), which evaluations record.
    wrong: what a wrong or unparsable answer scores (a sample whose reward raised scores this with on_error wrong).
    correct_at: the least score that counts as a solved problem; None: any score above 0.
    """

    compute: Callable[..., float]
    answer: Callable[[str], str | None] = extract_answer
    wrong: float = 0.0
    correct_at: float | None = None
    needs_metadata: bool = False

    def is_correct(self, score_value: float) -> bool:
        return score_value > 0 if self.correct_at is None else score_value >= self.correct_at


def dapo_answer_or_boxed(response: str) -> str | None:
    """math_dapo's answer: the last `Answer:` line's, else the last \\boxed{...} near the end."""
    answer = dapo_answer(response)
    return answer if answer is not None else dapo_boxed_fallback(response)


def boxed_or_marked(response: str) -> str | None:
    """math_verify's answer: the last \\boxed{...}, else the `Answer:` line's."""
    boxed = last_boxed(response)
    return boxed if boxed is not None else extract_answer(response)


REWARDS: dict[str, Reward] = {
    "math_dapo": Reward(math_dapo, dapo_answer_or_boxed, wrong=-1.0),
    "math_verify": Reward(math_verify_reward, boxed_or_marked),
    "exact": Reward(exact),
    "arithmetic": Reward(arithmetic),
    # partial credit is not a solved problem
    "reasoning_gym": Reward(reasoning_gym_reward, tagged_or_marked_answer, correct_at=1.0, needs_metadata=True),
}


def scored_in_the_pool(response: str, ground_truth: str) -> float:
    """A reward.function is called by evals.reward_pool with the row, never through a Reward entry."""
    raise ValueError("a reward.function is scored by evals.reward_pool, not by evals.rewards.score")


# what a reward.function is taken to be by its callers: wrong at 0, correct above 0, its answer the `Answer:` line
USER_FUNCTION = Reward(scored_in_the_pool)


def reward_entry(name: str) -> Reward:
    """The registered reward `name`; a name that is not one (a user's reward.function) reads as USER_FUNCTION."""
    return REWARDS.get(name, USER_FUNCTION)


def wrong_score(name: str) -> float:
    """What a wrong answer scores under `name` (-1 for math_dapo, 0 for the others and for user functions)."""
    return reward_entry(name).wrong


def is_correct_score(name: str, score_value: float) -> bool:
    """Whether a score under reward `name` is a correct answer: exactly 1 for reasoning_gym, else above 0."""
    return reward_entry(name).is_correct(score_value)


def answer_of(name: str, response: str) -> str | None:
    """The answer reward `name` reads from the response (None: none found)."""
    return reward_entry(name).answer(response)


def score(name: str, response: str, ground_truth: str, metadata: dict | None = None) -> float:
    """The named reward of one response (`metadata`: the task entry's, for a reward that needs it)."""
    try:
        reward = REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known: {', '.join(REWARDS)}") from None
    args = (response, ground_truth, metadata) if reward.needs_metadata else (response, ground_truth)
    return reward.compute(*args)
