"""calculator: "What is 347*29?" for a tool agent that can call multiply (allsync/envs/calculator.py)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field, replace
from typing import ClassVar

from allsync.envs.tool_calls import ToolCall, format_tool_calls
from allsync.tasks.problems import Problem, Splits, format_response, generated_splits
from allsync.tasks.registry import GeneratedTask, register_task


@dataclass(frozen=True)
class CalculatorGenerator:
    """calculator: "What is 347*29?", an a_digits-digit times a b_digits-digit number, for a tool agent
    (allsync/envs/calculator.py). `teacher_tool_rate` is the warm start's teacher only: how often it calls the
    multiply tool; otherwise it answers at once with an estimate (the product rounded to two significant
    digits, rarely right)."""

    a_digits: int = 3
    b_digits: int = 2
    teacher_tool_rate: float = 0.3
    tools_json: str = "[]"  # the agent's tool schemas (JSON), which the prompts list: the warm start must see the same

    def validate(self) -> None:
        if not (1 <= self.a_digits <= 6 and 1 <= self.b_digits <= 6):
            raise ValueError(f"calculator: a_digits ({self.a_digits}) and b_digits ({self.b_digits}) must be in 1..6")
        if not 0 <= self.teacher_tool_rate <= 1:
            raise ValueError(f"calculator: teacher_tool_rate = {self.teacher_tool_rate} must be in [0, 1]")

    def draw(self, rng: random.Random) -> Problem:
        a = rng.randint(10 ** (self.a_digits - 1), 10**self.a_digits - 1)
        b = rng.randint(10 ** (self.b_digits - 1), 10**self.b_digits - 1)
        return Problem(f"What is {a}*{b}?", str(a * b))

    # the warm start's side (allsync.tasks.registry.WarmStartTask)
    def splits(self, train_size: int, heldout_size: int, seed: int) -> Splits:
        return calculator_splits(self, train_size, heldout_size, seed)

    def teacher_examples(self, tokenizer, problems: list[Problem], seed: int) -> list[tuple[list[int], int]]:
        """Tool calls (sometimes) and answers (`calculator_teacher_examples`)."""
        return calculator_teacher_examples(
            tokenizer, problems, json.loads(self.tools_json), self.teacher_tool_rate, seed
        )

    def heldout_prompts(self, tokenizer, problems: list[Problem]) -> list[list[int]]:
        """The answer step alone, after a correct call and its output (whole episodes: the recipe)."""
        return answer_prompts(tokenizer, problems, json.loads(self.tools_json))


def calculator_splits(spec: CalculatorGenerator, train_size: int, heldout_size: int, seed: int = 0) -> Splits:
    return generated_splits(
        spec.draw, lambda p: p.prompt, train_size, heldout_size, random.Random(f"calculator-{seed}")
    )


@register_task
@dataclass
class CalculatorTask(GeneratedTask):
    """task.name calculator (with an agent section whose env is allsync.envs.calculator:Calculator)."""

    name: str = field(default="calculator", init=False)
    default_reward: ClassVar[str] = "arithmetic"  # "Answer: N" equals the product, 0/1
    needs_producer: ClassVar[str | None] = "agent"
    needs_producer_because: ClassVar[str] = (
        "a tool agent: producer.env allsync.envs.calculator:Calculator and its tools"
    )
    a_digits: int = 3  # "What is a*b?" with an a_digits-digit a and a b_digits-digit b
    b_digits: int = 2
    teacher_tool_rate: float = 0.3  # how often the warm start's teacher calls the tool
    train_size: int = 20000  # generated training problems
    heldout_size: int = 200  # unique held-out problems
    seed: int = 0  # the generated splits

    def generator(self) -> CalculatorGenerator:
        return CalculatorGenerator(self.a_digits, self.b_digits, self.teacher_tool_rate)

    def eval_reply_tokens(self, max_new_tokens: int) -> int:
        """A tool call is longer than `Answer: N` (53 tokens with the tiny model's tools): rollout.max_new_tokens."""
        return max_new_tokens

    def warm_start_task(self, agent=None) -> CalculatorGenerator:
        """The spec with the agent's tool schemas, which the prompts list: the warm start must see the same."""
        spec = self.generator()
        return spec if agent is None else replace(spec, tools_json=json.dumps(agent.tools, sort_keys=True))


def estimate(value: int) -> int:
    """value rounded to two significant digits: 35424 -> 35000."""
    return round(value, 2 - len(str(abs(value))))


def calculator_teacher_examples(
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
