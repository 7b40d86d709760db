"""Verifiable tasks, one module per task: arithmetic, dataset, reasoning_gym, memory_recall, calculator.

A run's `task:` section names one (`task.name`); its other keys are the fields of the task's settings class
(allsync.tasks.registry). Each task gives the training and held-out problems as Problems (prompt, answer,
metadata), its default reward and, when it can, the warm start's teacher. To add a task: one module here (every
module of this package is imported below, so it registers), or one of your own named in run.imports, with its
settings class under `@register_task`, subclassing TaskDefaults or GeneratedTask (registry.py says what it provides).
"""

import importlib
import pkgutil

from allsync.tasks.problems import (
    ANSWER_PREFIX,
    Problem,
    Splits,
    answer_examples,
    answer_start,
    chat_messages,
    encode_problems,
    encode_prompt,
    format_response,
    generated_splits,
    load_jsonl,
    longest_prompt_tokens,
    model_len_needed,
    reward_row,
    save_jsonl,
)
from allsync.tasks.registry import TASKS, TaskSettings, WarmStartTask, register_task
from allsync.tasks.arithmetic import (
    ArithmeticGenerator,
    ArithmeticTask,
    digit_count,
    make_problem,
    make_splits,
    sample_problem,
)
from allsync.tasks.dataset import DatasetTask, dataset_splits
from allsync.tasks.reasoning_gym import ReasoningGymGenerator, ReasoningGymTask, reasoning_gym_splits
from allsync.tasks.memory_recall import (
    MemoryRecallGenerator,
    MemoryRecallTask,
    memory_recall_problem,
    memory_recall_splits,
)
from allsync.tasks.calculator import CalculatorGenerator, CalculatorTask, calculator_splits

__all__ = [
    "ANSWER_PREFIX",
    "Problem",
    "Splits",
    "answer_examples",
    "answer_start",
    "chat_messages",
    "encode_problems",
    "encode_prompt",
    "format_response",
    "generated_splits",
    "load_jsonl",
    "longest_prompt_tokens",
    "model_len_needed",
    "reward_row",
    "save_jsonl",
    "TASKS",
    "TaskSettings",
    "WarmStartTask",
    "register_task",
    "ArithmeticGenerator",
    "ArithmeticTask",
    "digit_count",
    "make_problem",
    "make_splits",
    "sample_problem",
    "DatasetTask",
    "dataset_splits",
    "ReasoningGymGenerator",
    "ReasoningGymTask",
    "reasoning_gym_splits",
    "MemoryRecallGenerator",
    "MemoryRecallTask",
    "memory_recall_problem",
    "memory_recall_splits",
    "CalculatorGenerator",
    "CalculatorTask",
    "calculator_splits",
]

for _module in pkgutil.iter_modules(__path__):  # a task module added to this folder registers itself
    importlib.import_module(f"{__name__}.{_module.name}")
