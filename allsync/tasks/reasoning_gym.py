"""reasoning_gym: problems from a reasoning-gym generator (the PyPI package), each keeping the entry's metadata
for the generator's own `score_answer` (reward.name: reasoning_gym)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

from allsync.tasks.problems import Problem, Splits, answer_examples, check_template, encode_problems, template_text
from allsync.tasks.registry import TaskDefaults, register_task


@dataclass(frozen=True)
class ReasoningGymGenerator:
    """A reasoning-gym generator and its settings (a task the warm start can supervise, like ArithmeticGenerator)."""

    dataset: str
    args: dict = field(default_factory=dict)
    template: str | None = None  # a text with {problem}, or None for the generator's question as is

    # the warm start's side (allsync.tasks.registry.WarmStartTask)
    def splits(self, train_size: int, heldout_size: int, seed: int) -> Splits:
        return reasoning_gym_splits(self.dataset, self.args, train_size, heldout_size, self.template, seed)[0]

    def teacher_examples(self, tokenizer, problems: list[Problem], seed: int) -> list[tuple[list[int], int]]:
        return answer_examples(tokenizer, problems)

    def heldout_prompts(self, tokenizer, problems: list[Problem]) -> list[list[int]]:
        return encode_problems(tokenizer, problems, with_answer=False)


def reasoning_gym_splits(
    dataset: str, args: dict, train_size: int, heldout_size: int, template: str | None, seed: int
) -> tuple[Splits, list[str]]:
    """Problems from the reasoning-gym generator `dataset` (its kwargs in `args`): `heldout_size` unique held-out
    questions first, then `train_size` training rows whose questions are not held out (a small generator repeats
    questions, as the arithmetic task does). Each Problem keeps the entry's metadata for its `score_answer`."""
    import reasoning_gym

    generated = reasoning_gym.create_dataset(dataset, **args, seed=seed, size=4 * (train_size + heldout_size))
    heldout: dict[str, Problem] = {}
    train: list[Problem] = []
    for entry in generated:
        text = entry["question"] if template is None else template.replace("{problem}", entry["question"])
        problem = Problem(text, str(entry["answer"]), json.loads(json.dumps(entry["metadata"])))
        if len(heldout) < heldout_size:
            heldout.setdefault(text, problem)
        elif text not in heldout:
            train.append(problem)
        if len(train) == train_size:
            break
    if len(heldout) < heldout_size or len(train) < train_size:
        raise ValueError(
            f"reasoning-gym {dataset} {args} produced {len(heldout)} held-out and {len(train)} training problems "
            f"in {len(generated)} draws (wanted {heldout_size} and {train_size}): its question space is too small"
        )
    unique = len({p.prompt for p in train})
    return Splits(train, list(heldout.values())), [
        f"reasoning-gym {dataset}: {len(train)} training rows ({unique} unique questions), {len(heldout)} held-out questions"
    ]


@register_task
@dataclass
class ReasoningGymTask(TaskDefaults):
    """task.name reasoning_gym: task.dataset names the generator, task.dataset_args its settings."""

    name: str = field(default="reasoning_gym", init=False)
    default_reward: ClassVar[str] = "reasoning_gym"  # the generator's own score_answer
    reward_needs_task: ClassVar[bool] = True  # it reads the generator's metadata
    dataset: str | None = None  # the generator's name (reasoning_gym.create_dataset), e.g. chain_sum
    dataset_args: dict[str, int | float | str | bool | list] = field(default_factory=dict)  # its settings
    template: str | None = None  # "dapo_math" (DAPO's math prompt) or a text with {problem}
    train_size: int = 20000  # generated training rows
    heldout_size: int = 200  # unique held-out questions
    seed: int = 0  # the generator's seed

    def check(self, fail) -> None:
        check_template(self.template, fail)
        if self.dataset is None:
            fail("task.name reasoning_gym needs task.dataset (a reasoning-gym generator, e.g. chain_sum)")
        import reasoning_gym

        try:
            reasoning_gym.create_dataset(self.dataset, **self.dataset_args, seed=self.seed, size=1)
        except ValueError as exc:
            fail(f"task.dataset = {self.dataset!r}: {exc}")
        except (TypeError, AssertionError) as exc:
            fail(
                f"task.dataset_args {self.dataset_args} for reasoning-gym {self.dataset}: {exc or 'rejected by its config'}"
            )

    def splits(self) -> tuple[Splits, list[str]]:
        return reasoning_gym_splits(
            self.dataset, self.dataset_args, self.train_size, self.heldout_size, template_text(self.template), self.seed
        )

    def warm_start_task(self, agent=None) -> ReasoningGymGenerator:
        return ReasoningGymGenerator(self.dataset, dict(self.dataset_args), template_text(self.template))
