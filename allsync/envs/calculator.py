"""A calculator environment: multiplication a tiny model cannot do alone but can do with one tool call.

    agent:
      env: allsync.envs.calculator:Calculator
      tools:
        - {type: function, function: {name: multiply, description: "a times b",
           parameters: {type: object, properties: {a: {type: integer}, b: {type: integer}}, required: [a, b]}}}

Each reply with DeepSeek-V3 tool calls gets one tool output per call (the result, or an error text); a
reply without a call is the final answer, scored by the `exact` reward (1 when the `Answer:` line is the
row's answer, else 0; it needs no math-verify, whose timeout cannot run in the environment's thread).
"""

from __future__ import annotations

import random
import re

from allsync.envs.tool_calls import ToolCall, format_tool_calls, parse_tool_calls
from allsync.tasks import Problem, format_response
from evals.rewards import score

FUNCTIONS = {
    "multiply": lambda a, b: a * b,
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
}


class Calculator:
    def __init__(self, tools: list[dict]):
        names = [t["function"]["name"] for t in tools]
        unknown = [n for n in names if n not in FUNCTIONS]
        if unknown:
            raise ValueError(f"producer.tools names {unknown}: the calculator implements {sorted(FUNCTIONS)}")
        self.available = set(names)
        self.answer = ""

    def reset(self, row: dict) -> list[dict]:
        self.answer = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text: str) -> tuple[list[dict] | None, float, bool]:
        calls, errors = parse_tool_calls(assistant_text)
        if not calls and not errors:
            return None, score("exact", assistant_text, self.answer), True
        outputs = [f"error: {e}" for e in errors] + [self.run(c.name, c.arguments) for c in calls]
        return [{"role": "tool", "content": out} for out in outputs], 0.0, False

    def run(self, name: str, arguments: dict) -> str:
        if name not in self.available:
            return f"error: unknown tool {name!r}"
        a, b = arguments.get("a"), arguments.get("b")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)) or set(arguments) != {"a", "b"}:
            return f"error: {name} takes integers a and b"
        return str(FUNCTIONS[name](a, b))


def estimate(value: int) -> int:
    """value rounded to two significant digits: 35424 -> 35000."""
    return round(value, 2 - len(str(abs(value))))


def teacher_examples(
    tokenizer, problems: list[Problem], tools: list[dict], tool_rate: float, seed: int
) -> list[tuple[list[int], int]]:
    """The warm start's teacher on "What is a*b?": with probability tool_rate it calls multiply(a, b) and then
    answers with the tool's output (two examples: the call, and the answer after the output); otherwise it
    answers at once with an estimate. Each example is (ids, index of the first reply token); the tool output
    is part of the second example's prompt, never a target."""
    rng = random.Random(seed)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    render = lambda messages: tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False
    )  # noqa: E731
    eos = tokenizer.eos_token_id
    examples = []
    for p in problems:
        a, b = map(int, re.findall(r"\d+", p.prompt)[:2])
        messages = [{"role": "user", "content": p.prompt}]
        prompt = encode(render(messages))
        if rng.random() < tool_rate:
            call = format_tool_calls([ToolCall("multiply", {"a": a, "b": b})])
            examples.append((prompt + encode(call) + [eos], len(prompt)))
            messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": str(a * b)}]
            prompt = encode(render(messages))
            examples.append((prompt + encode(format_response(str(a * b))) + [eos], len(prompt)))
        else:
            examples.append((prompt + encode(format_response(str(estimate(a * b)))) + [eos], len(prompt)))
    return examples


def answer_prompts(tokenizer, problems: list[Problem], tools: list[dict]) -> list[list[int]]:
    """Each problem's prompt after a correct multiply call and its output: what the answer step reads."""
    out = []
    for p in problems:
        a, b = map(int, re.findall(r"\d+", p.prompt)[:2])
        messages = [
            {"role": "user", "content": p.prompt},
            {"role": "assistant", "content": format_tool_calls([ToolCall("multiply", {"a": a, "b": b})])},
            {"role": "tool", "content": str(a * b)},
        ]
        out.append(
            tokenizer(
                tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )["input_ids"]
        )
    return out
