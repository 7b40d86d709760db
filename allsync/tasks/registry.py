"""The task registry: a run's `task:` section names a task (`task.name`), and the module of that task registers
the settings class that holds the section's other keys.

A task's settings class is a dataclass whose fields are its YAML keys (plus `name`, a field with init=False
whose default is the task's name), registered with `@register_task`. It provides:

    default_reward                  (class attribute) reward.name when the config names none
    check(fail)                     refuse a bad value, naming the key (fail(message) raises)
    splits() -> (Splits, lines)     the training and held-out problems, and report lines for the log
    warm_start_task(agent)          what the warm start supervises (a WarmStartTask), or None when it cannot

and, from `TaskDefaults` (subclass it and override what differs), what the loop asks of a task instead of naming it:

    needs_producer, needs_producer_because   the producer.kind the task must run with (None: any), and why
    has_teacher                     the warm start can supervise it (warm_start_task gives a WarmStartTask)
    reward_needs_task               default_reward reads this task's own metadata (no other task can score with it,
                                    and this task scores with no other reward but a reward.function)
    eval_reply_tokens(max_new)      the token budget of the warm start's held-out evaluation: None for the
                                    default (12, `Answer: NNN` + eos), else e.g. rollout.max_new_tokens
    longest_reply(tokenizer, problems)  (tokens, text) of the longest correct reply one generate call writes, eos
                                    included: `Answer: <the longest answer>` by default; the run refuses a
                                    rollout.max_new_tokens or an overlong window that would cut or penalize it

A WarmStartTask is a frozen dataclass whose fields are the warm start's settings of the task (they go into the
warm start's cache key, warm_start.json), with

    splits(train_size, heldout_size, seed) -> Splits            held-out problems first, from the seed alone
    teacher_examples(tokenizer, problems, seed) -> [(ids, k)]   supervised examples, targets from index k on
    heldout_prompts(tokenizer, problems) -> [ids]               what the warm start's evaluation generates from
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from allsync.tasks.problems import Problem, Splits, format_response

TASKS: dict[str, type] = {}


class WarmStartTask(Protocol):
    def splits(self, train_size: int, heldout_size: int, seed: int) -> Splits: ...

    def teacher_examples(self, tokenizer, problems: list[Problem], seed: int) -> list[tuple[list[int], int]]: ...

    def heldout_prompts(self, tokenizer, problems: list[Problem]) -> list[list[int]]: ...


class TaskDefaults:
    """The answers of a task with short `Answer: N` replies that any producer runs and any reward scores (see the
    module docstring); a task's settings class subclasses it and overrides what differs."""

    needs_producer: ClassVar[str | None] = None
    needs_producer_because: ClassVar[str] = ""
    has_teacher: ClassVar[bool] = True
    reward_needs_task: ClassVar[bool] = False

    def eval_reply_tokens(self, max_new_tokens: int) -> int | None:
        """The warm start's evaluation budget: None, the default (a short `Answer: N` reply)."""
        return None

    def longest_reply(self, tokenizer, problems: list[Problem]) -> tuple[int, str]:
        """The `Answer: <answer>` reply of the problems' longest answer: (its tokens + eos, its text)."""
        return longest_reply(tokenizer, {format_response(p.answer) for p in problems})


class TaskSettings(Protocol):
    name: str
    default_reward: str
    needs_producer: str | None
    needs_producer_because: str
    has_teacher: bool
    reward_needs_task: bool

    def eval_reply_tokens(self, max_new_tokens: int) -> int | None: ...

    def longest_reply(self, tokenizer, problems: list[Problem]) -> tuple[int, str]: ...

    def check(self, fail) -> None: ...

    def splits(self) -> tuple[Splits, list[str]]: ...

    def warm_start_task(self, agent=None) -> WarmStartTask | None: ...


class GeneratedTask(TaskDefaults):
    """The side of a generated task's settings that follows from its `generator()` (a WarmStartTask): the generator's
    validation as the check, its seeded splits of task.train_size / heldout_size / seed, and the generator as what the
    warm start supervises."""

    def check(self, fail) -> None:
        try:
            self.generator().validate()
        except ValueError as exc:
            fail(f"task: {exc}")

    def splits(self) -> tuple[Splits, list[str]]:
        return self.generator().splits(self.train_size, self.heldout_size, self.seed), []

    def warm_start_task(self, agent=None) -> WarmStartTask:
        return self.generator()


def longest_reply(tokenizer, replies) -> tuple[int, str]:
    """(tokens + 1 for eos, text) of the reply that encodes to the most tokens; (0, "") for none."""
    replies = sorted(replies)
    if not replies:
        return 0, ""
    counts = [len(ids) + 1 for ids in tokenizer(replies, add_special_tokens=False)["input_ids"]]
    best = max(range(len(replies)), key=counts.__getitem__)
    return counts[best], replies[best]


def register_task(cls: type) -> type:
    """Class decorator: `cls.name` becomes a value of task.name."""
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} is registered twice ({TASKS[cls.name].__module__} and {cls.__module__})")
    TASKS[cls.name] = cls
    return cls
