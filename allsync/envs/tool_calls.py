"""DeepSeek-V3's tool-call text, as its chat template writes it and its serving parsers read it:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>
    (more calls joined by \\n) <｜tool▁calls▁end｜>

ARGUMENTS is a JSON object on one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from moe_lora.tiny import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP

CALL = re.compile(
    re.escape(TOOL_CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(TOOL_SEP) + r"(?P<name>.*?)\n```json\n"
    r"(?P<arguments>.*?)\n```" + re.escape(TOOL_CALL_END)
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def format_tool_calls(calls: list[ToolCall]) -> str:
    """The assistant text that makes these calls."""
    body = "\n".join(
        f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{c.name}\n```json\n{json.dumps(c.arguments)}\n```{TOOL_CALL_END}"
        for c in calls
    )
    return f"{TOOL_CALLS_BEGIN}{body}{TOOL_CALLS_END}"


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """(calls, errors) in `text`: a call whose type is not function or whose arguments are not a JSON object
    is an error (named), as is a calls block with no well-formed call in it."""
    if TOOL_CALLS_BEGIN not in text:
        return [], []
    calls, errors = [], []
    for m in CALL.finditer(text):
        if m["type"] != "function":
            errors.append(f"tool call type {m['type']!r} (only function)")
            continue
        try:
            arguments = json.loads(m["arguments"])
        except json.JSONDecodeError as exc:
            errors.append(f"{m['name']}: arguments are not JSON ({exc.msg})")
            continue
        if not isinstance(arguments, dict):
            errors.append(f"{m['name']}: arguments must be a JSON object")
            continue
        calls.append(ToolCall(m["name"], arguments))
    if not calls and not errors:
        errors.append("a tool-calls block without a well-formed call")
    return calls, errors
