"""dataset: training and evaluation rows read from files in verl's layout (parquet, JSONL or JSON; the rows are
read by evals/datasets.py), deduplicated by prompt; the training rows shuffled with the seed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from allsync.tasks.problems import Problem, Splits, check_template
from allsync.tasks.registry import TaskDefaults, register_task


def unique_rows(files: list[str], template: str | None, excluded: set[str]) -> tuple[list, list[str], int]:
    """The rows of `files` unique by prompt (evals.datasets.Row.key: the rendered text, and the context when there is
    one), skipping those whose key is in `excluded`; one report line per file; how many were skipped."""
    from evals.datasets import load_rows

    seen, kept, reports, skipped = set(), [], [], 0
    for path in files:
        rows, report = load_rows(path, template)
        reports.append(report)
        for row in rows:
            if row.key in seen:
                continue
            seen.add(row.key)
            if row.key in excluded:
                skipped += 1
            else:
                kept.append(row)
    return kept, reports, skipped


def dataset_splits(
    train_files: list[str], eval_files: list[str], template: str | None, seed: int
) -> tuple[Splits, list[str]]:
    """Evaluation rows (unique) and training rows (unique over all train_files, without any whose prompt is also an
    evaluation prompt, shuffled with the seed), as Problems, with one report line per file (rows read, unique
    prompts kept) and one counting the training prompts dropped as evaluation prompts: trained on, they would make
    the held-out accuracy a training accuracy. Training files holding nothing else are an error naming them."""
    from evals.datasets import DAPO_MATH_TEMPLATE, EPISODE_KEYS, DatasetError

    text = DAPO_MATH_TEMPLATE if template == "dapo_math" else template
    heldout_rows, reports, _ = unique_rows(eval_files, text, set())
    train_rows, train_reports, overlap = unique_rows(train_files, text, {row.key for row in heldout_rows})
    reports += train_reports
    if overlap:
        reports.append(f"{overlap:,} training prompts are also evaluation prompts: dropped from training")
    if not train_rows:
        raise DatasetError(
            f"task.train_files {train_files}: every training prompt ({overlap:,}) is also in task.eval_files"
            if overlap
            else f"task.train_files {train_files}: no training rows"
        )
    problem = lambda row: Problem(  # noqa: E731
        row.prompt, row.answer, {k: row.extra[k] for k in EPISODE_KEYS if k in row.extra} or None
    )
    train = [problem(row) for row in train_rows]
    random.Random(f"dataset-{seed}").shuffle(train)
    return Splits(train=train, heldout=[problem(row) for row in heldout_rows]), reports


@register_task
@dataclass
class DatasetTask(TaskDefaults):
    """task.name dataset: task.train_files and task.eval_files; no warm start (a dataset has no teacher)."""

    name: str = field(default="dataset", init=False)
    default_reward: ClassVar[str] = "math_dapo"  # DAPO's +1/-1 on the last "Answer:" line
    has_teacher: ClassVar[bool] = False  # rows of a file: no generator to teach the warm start from
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
