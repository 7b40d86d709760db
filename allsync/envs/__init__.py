"""Agent environments: the protocol the multi-turn producer (allsync/producers/agent.py) drives.

    class MyEnv:
        def __init__(self, tools: list[dict], **env_kwargs): ...      # tools: OpenAI function schemas (producer.tools)
        def reset(self, row: dict) -> list[dict]: ...                 # the first messages (system / user)
        def step(self, assistant_text: str) -> tuple[list[dict] | None, float, bool]:
            ...                                                       # (observation messages, reward, done)

`row` is the problem as the reward sees it (prompt, answer, metadata); a dataset row's `env_kwargs` are
passed to the constructor. `assistant_text` is the model's reply decoded with its special tokens (but not
the end-of-sentence token that ends the turn), so
DeepSeek-V3 tool calls can be read with `allsync.envs.tool_calls.parse_tool_calls`. Observations are
messages with role "tool", "user" or "system" and a str content, appended to the conversation; the reward
counts when done is True. An observation whose first message has `"new_context": True` replaces the
conversation instead (a memory agent that starts over from its summary): the next prompt no longer
extends the row, so it starts a new segment.
The config names the class: `producer.env: "package.module:Class"` (producer.kind agent).
"""

from __future__ import annotations


class EnvError(RuntimeError):
    """An environment raised, timed out, answered malformed observations, or ran past producer.max_turns."""


def load_env_class(spec: str):
    """The class named "package.module:Class" (ValueError naming what is wrong)."""
    from evals.reward_pool import load_function

    cls = load_function(spec, "class")
    if not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ValueError(f"{spec!r}: {cls.__name__} has no reset(row) and step(assistant_text) methods")
    return cls


def check_observation(observation) -> list[dict] | None:
    """None, or a list of {role: tool | user | system, content: str[, new_context: bool]} messages; EnvError otherwise."""
    if observation is None:
        return None
    if (
        not isinstance(observation, list)
        or not observation
        or not all(
            isinstance(m, dict)
            and m.get("role") in ("tool", "user", "system")
            and isinstance(m.get("content"), str)
            and set(m) <= {"role", "content", "new_context"}
            for m in observation
        )
    ):
        raise EnvError(
            f"malformed observation {observation!r}: expected None or a list of {{role: tool | user | system, "
            "content: str}} messages"
        )
    return observation
