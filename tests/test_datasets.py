"""Dataset files (evals/datasets.py): verl's parquet schema built with pyarrow, plain JSONL/JSON rows, DAPO's
prompt template, deduplication by prompt, and errors that name file:row and the key."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evals.datasets import DAPO_MATH_TEMPLATE, DatasetError, load_rows

VERL_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])  # fmt: skip


def verl_rows(unique: int, copies: int) -> list[dict]:
    return [
        {"data_source": "math_dapo", "prompt": [{"content": f"What is {i} + {i}?", "role": "user"}], "ability": "MATH",
         "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": f"{i}-{c}"}}
        for c in range(copies) for i in range(unique)
    ]  # fmt: skip


def write_parquet(path, rows, schema=VERL_SCHEMA):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=100)
    return path


def test_verl_parquet_loads_and_deduplicates(tmp_path):
    path = write_parquet(tmp_path / "dapo.parquet", verl_rows(10, 100))  # 1,000 rows, 10 prompts
    rows, report = load_rows(path)
    assert len(rows) == 10
    assert report == "dapo.parquet: 1,000 rows, 10 unique prompts (990 duplicates dropped)"
    assert rows[3].prompt == (("user", "What is 3 + 3?"),) and rows[3].answer == "6"
    assert rows[3].data_source == "math_dapo" and rows[3].extra == {"index": "3-0"}  # the first copy wins


def test_plain_rows_with_dapo_template(tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Find {i}.", "answer": i}) for i in (7, 8, 7)) + "\n")
    rows, report = load_rows(path, template=DAPO_MATH_TEMPLATE)
    assert [r.answer for r in rows] == ["7", "8"] and "3 rows, 2 unique" in report
    assert rows[0].prompt.startswith("Solve the following math problem step by step.") and "\n\nFind 7.\n\n" in rows[0].prompt
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps([{"prompt": [{"role": "user", "content": "Hi"}], "answer": "x"}]))
    assert load_rows(messages)[0][0].prompt == (("user", "Hi"),)


def test_bad_files_and_rows_name_file_row_and_key(tmp_path):
    rows = verl_rows(3, 1)
    rows[2]["reward_model"] = {"ground_truth": None, "style": "rule"}
    with pytest.raises(DatasetError, match=r"bad\.parquet:2: key 'reward_model\.ground_truth' is missing"):
        load_rows(write_parquet(tmp_path / "bad.parquet", rows))
    schema = pa.schema([("question", pa.string())])
    with pytest.raises(DatasetError, match=r"other\.parquet: columns \['question'\]: need 'prompt'"):
        load_rows(write_parquet(tmp_path / "other.parquet", [{"question": "q"}], schema))
    lines = tmp_path / "rows.jsonl"
    lines.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": [{"role": "user"}], "answer": "2"}\n')
    with pytest.raises(DatasetError, match=r"rows\.jsonl:1: prompt\[0\] must be \{role: str, content: str\}"):
        load_rows(lines)
    lines.write_text('{"prompt": "a"}\n')
    with pytest.raises(DatasetError, match=r"rows\.jsonl:0: no 'reward_model' \(verl layout\) or 'answer'"):
        load_rows(lines)
    lines.write_text('{"prompt": "a", "answer": "1"}\nnot json\n')
    with pytest.raises(DatasetError, match=r"rows\.jsonl:1: not a JSON line"):
        load_rows(lines)
    with pytest.raises(DatasetError, match=r"data\.csv: unknown dataset format '\.csv'"):
        (tmp_path / "data.csv").write_text("x")
        load_rows(tmp_path / "data.csv")
    with pytest.raises(DatasetError, match=r"missing\.parquet: dataset file not found"):
        load_rows(tmp_path / "missing.parquet")
