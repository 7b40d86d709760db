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


from allsync.envs.tool_calls import parse_tool_calls
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
