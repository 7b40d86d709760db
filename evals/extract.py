"""Answer extraction: the text after the last `Answer:` marker of a response.

    extract_answer("Answer: 432")               -> "432"
    extract_answer("3+4 is 7. Answer: 7.")     -> "7"
    extract_answer("I think 7")                 -> None   (no marker: a format failure)

The answer runs to the end of its line; surrounding spaces, `$` signs and one trailing period are
dropped. Answers longer than MAX_ANSWER_CHARS count as a format failure (they are never verified, which
also bounds the work math_verify can be asked to do).
"""

from __future__ import annotations

import re

ANSWER_MARKER = "Answer:"
MAX_ANSWER_CHARS = 64
_ANSWER = re.compile(r"Answer:[ \t]*([^\n]*)")


def clean_answer(raw: str) -> str:
    """Strip spaces, enclosing `$...$` and one trailing period: ' $432$. ' -> '432'."""
    text = raw.strip()
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    if len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text


def extract_answer(text: str) -> str | None:
    """The cleaned answer after the last `Answer:` marker; None when there is none or it is empty/too long."""
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    answer = clean_answer(matches[-1])
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return None
    return answer
