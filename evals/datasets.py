"""RL datasets from files: verl's row layout (DAPO-Math-17k, AIME-2024) or plain rows; parquet, JSONL, JSON.

    rows, report = load_rows("dapo-math-17k.parquet", template=DAPO_MATH_TEMPLATE)
    print(report)   # "dapo-math-17k.parquet: 1,791,700 rows, 17,917 unique prompts (1,773,783 duplicates dropped)"

Layouts, detected per file from its columns:
- verl: `prompt` (list of {role, content}), `reward_model` {ground_truth, style}, and optionally `data_source`,
  `ability`, `extra_info`. The ground truth is reward_model.ground_truth.
- plain: `prompt` (a string, or a list of {role, content}) and `answer` (a string).
Either may carry `env_kwargs` (a mapping: the agent environment's keyword arguments) and `context` (a long
document that multi-conversation DAPO reads chunk by chunk), at the top of a plain row or in `extra_info`.
A `template` ("...{problem}...") turns a plain string prompt into its text (DAPO's math prompt below).
Rows are deduplicated by prompt text (the first row wins): DAPO-Math-17k's parquet holds about 17k prompts
about 100 times each. Parquet is read lazily in record batches (a 1.79M-row file never becomes 1.79M Python
rows at once), and only unique rows are kept. A file, column or row that does not fit is an error naming
file:row and the key, raised before anything is returned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

DAPO_MATH_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
BATCH_ROWS = 8192


def verl_schema(extra_info_fields: list | None = None):
    """The pyarrow schema of verl's RL rows (what DAPO-Math-17k ships), with `extra_info` holding the given
    (name, pyarrow type) fields (default: index as a string)."""
    import pyarrow as pa

    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct(extra_info_fields or [("index", pa.string())])),
        ]
    )


class DatasetError(ValueError):
    """A dataset file, column or row that does not fit; the message names file:row and key."""


@dataclass(frozen=True)
class Row:
    prompt: str | tuple[tuple[str, str], ...]  # the text, or (role, content) messages
    answer: str
    data_source: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> str:
        """What deduplication compares: the prompt's text (messages joined role: content), and the row's
        context when it has one (one question asked of several documents is several problems)."""
        text = (
            self.prompt
            if isinstance(self.prompt, str)
            else "\n".join(f"{role}: {content}" for role, content in self.prompt)
        )
        return text if "context" not in self.extra else f"{text}\n{self.extra['context']}"


def _messages(value, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(
            f"{where}: prompt must be a non-empty list of {{role, content}} messages, got {type(value).__name__}"
        )
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: prompt[{i}] must be {{role: str, content: str}}, got {m!r}"[:300])
        out.append((m["role"], m["content"]))
    return tuple(out)


EPISODE_KEYS = ("env_kwargs", "context")  # a row's agent environment arguments, and the document memory agents read


def parse_row(record: dict, where: str, template: str | None = None) -> Row:
    """One record in verl's layout or the plain one; DatasetError naming `where` (file:row) and the key."""
    if "prompt" not in record or record["prompt"] is None:
        raise DatasetError(f"{where}: key 'prompt' is missing")
    prompt = record["prompt"]
    if "reward_model" in record:  # verl
        reward_model = record["reward_model"]
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise DatasetError(f"{where}: key 'reward_model.ground_truth' is missing")
        answer = reward_model["ground_truth"]
        prompt = _messages(prompt, where)
    elif "answer" in record:
        answer = record["answer"]
        if isinstance(prompt, str):
            prompt = template.replace("{problem}", prompt) if template else prompt
        else:
            prompt = _messages(prompt, where)
    else:
        raise DatasetError(f"{where}: no 'reward_model' (verl layout) or 'answer' (plain layout) key")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or str(answer) == "":
        raise DatasetError(
            f"{where}: the answer ({'reward_model.ground_truth' if 'reward_model' in record else 'answer'}) "
            f"must be a non-empty string, got {answer!r}"
        )
    extra = dict(record.get("extra_info") or {}) if isinstance(record.get("extra_info"), dict) else {}
    extra.update({k: record[k] for k in EPISODE_KEYS if record.get(k) is not None})  # plain rows carry them at the top
    if not isinstance(extra.get("env_kwargs", {}), dict):
        raise DatasetError(
            f"{where}: env_kwargs must be a mapping (the agent environment's keyword arguments), got {extra['env_kwargs']!r}"
        )
    if not isinstance(extra.get("context", ""), str):
        raise DatasetError(
            f"{where}: context must be a string (the document read chunk by chunk), got {type(extra['context']).__name__}"
        )
    return Row(prompt, str(answer), str(record.get("data_source") or ""), extra)


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    """(row number from 0, record) of a parquet, JSONL or JSON file, read lazily where the format allows."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            handle = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends
            raise DatasetError(f"{path}: not a readable parquet file ({exc})") from exc
        columns = set(handle.schema_arrow.names)
        if "prompt" not in columns or not ({"reward_model", "answer"} & columns):
            raise DatasetError(
                f"{path}: columns {sorted(columns)}: need 'prompt' and 'reward_model' (verl) or 'answer'"
            )
        number = 0
        for batch in handle.iter_batches(batch_size=BATCH_ROWS):
            for record in batch.to_pylist():
                yield number, record
                number += 1
    elif suffix == ".jsonl":
        with path.open() as f:
            for number, line in enumerate(f):
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{path}:{number}: not a JSON line ({exc})") from exc
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a JSON dataset is a list of rows, got {type(data).__name__}")
        yield from enumerate(data)
    else:
        raise DatasetError(f"{path}: unknown dataset format {suffix!r} (use .parquet, .jsonl or .json)")


def load_rows(path: str | Path, template: str | None = None) -> tuple[list[Row], str]:
    """The unique rows of a dataset file, in file order, and a one-line report of what was dropped."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    seen: set[str] = set()
    rows: list[Row] = []
    total = 0
    for number, record in _records(path):
        total += 1
        if not isinstance(record, dict):
            raise DatasetError(f"{path}:{number}: a row must be an object, got {type(record).__name__}")
        row = parse_row(record, f"{path}:{number}", template)
        if row.key not in seen:
            seen.add(row.key)
            rows.append(row)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    report = f"{path.name}: {total:,} rows, {len(rows):,} unique prompts ({total - len(rows):,} duplicates dropped)"
    return rows, report
