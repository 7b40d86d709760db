"""dataset: training and evaluation rows read from files in verl's layout (parquet, JSONL or JSON; the rows are
read by evals/datasets.py), deduplicated by prompt; the training rows shuffled with the seed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from allsync.tasks.problems import Problem, Splits, check_template
from allsync.tasks.registry import register_task


def dataset_splits(
    train_files: list[str], eval_files: list[str], template: str | None, seed: int
) -> tuple[Splits, list[str]]:
    """Training rows (unique over all train_files, shuffled with the seed) and evaluation rows (unique), as
    Problems, with one report line per file (rows read, unique prompts kept)."""
    from evals.datasets import DAPO_MATH_TEMPLATE, EPISODE_KEYS, load_rows

    text = DAPO_MATH_TEMPLATE if template == "dapo_math" else template
    parts, reports = [], []
    for files in (train_files, eval_files):
        seen, problems = set(), []
        for path in files:
            rows, report = load_rows(path, text)
            reports.append(report)
            for row in rows:
                if row.key not in seen:
                    seen.add(row.key)
                    metadata = {k: row.extra[k] for k in EPISODE_KEYS if k in row.extra}
                    problems.append(Problem(row.prompt, row.answer, metadata or None))
        parts.append(problems)
    random.Random(f"dataset-{seed}").shuffle(parts[0])
    return Splits(train=parts[0], heldout=parts[1]), reports


@register_task
@dataclass
class DatasetTask:
    """task.name dataset: task.train_files and task.eval_files; no warm start (a dataset has no teacher)."""

    name: str = field(default="dataset", init=False)
    default_reward: ClassVar[str] = "math_dapo"  # DAPO's +1/-1 on the last "Answer:" line
    needs_producer: ClassVar[str | None] = None
    needs_producer_because: ClassVar[str] = ""
    train_files: list[str] = field(default_factory=list)  # parquet / JSONL / JSON (evals/datasets.py)
    eval_files: list[str] = field(default_factory=list)  # the held-out evaluation rows
    template: str | None = None  # "dapo_math" (DAPO's math prompt) or a text with {problem}
    seed: int = 0  # the shuffle of the training rows

    def check(self, fail) -> None:
        check_template(self.template, fail)
        if not self.train_files or not self.eval_files:
            fail("task.name dataset needs task.train_files and task.eval_files (parquet, JSONL or JSON)")

    def splits(self) -> tuple[Splits, list[str]]:
        return dataset_splits(self.train_files, self.eval_files, self.template, self.seed)

    def warm_start_task(self, agent=None) -> None:
        return None
