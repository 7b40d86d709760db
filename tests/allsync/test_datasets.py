"""Dataset files (evals/datasets.py): verl's parquet schema built with pyarrow, plain JSONL/JSON rows, DAPO's
prompt template, deduplication by prompt, and errors that name file:row and the key."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evals.datasets import DAPO_MATH_TEMPLATE, DatasetError, load_rows, verl_schema

VERL_SCHEMA = verl_schema()


def verl_rows(unique: int, copies: int) -> list[dict]:
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": f"What is {i} + {i}?", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"{i}-{c}"},
        }
        for c in range(copies)
        for i in range(unique)
    ]


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
    assert (
        rows[0].prompt.startswith("Solve the following math problem step by step.")
        and "\n\nFind 7.\n\n" in rows[0].prompt
    )
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps([{"prompt": [{"role": "user", "content": "Hi"}], "answer": "x"}]))
    assert load_rows(messages)[0][0].prompt == (("user", "Hi"),)


def test_rows_carry_env_kwargs_and_contexts_to_the_problems(tmp_path):
    """Agent rows {prompt, answer, env_kwargs} and memory rows with a context: deduplicated by prompt and
    context, carried into Problem.metadata; a bad env_kwargs or context names file:row."""
    from allsync.tasks import dataset_splits

    path = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": "What is 3*4?", "answer": "12", "env_kwargs": {"max_calls": 2}},
        {"prompt": "Who?", "answer": "Ann", "context": "Ann wrote it."},
        {"prompt": "Who?", "answer": "Bo", "context": "Bo wrote it."},
        {"prompt": "Who?", "answer": "Bo", "context": "Bo wrote it."},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "Who?", "answer": "Cy", "context": "Cy wrote it."}) + "\n")
    splits, _ = dataset_splits([str(train)], [str(path)], None, seed=0)
    assert sorted((p.answer, json.dumps(p.metadata)) for p in splits.heldout) == [
        ("12", '{"env_kwargs": {"max_calls": 2}}'),
        ("Ann", '{"context": "Ann wrote it."}'),
        ("Bo", '{"context": "Bo wrote it."}'),
    ]
    path.write_text(json.dumps({"prompt": "x", "answer": "y", "env_kwargs": [1]}) + "\n")
    with pytest.raises(DatasetError, match=r"rows\.jsonl:0: env_kwargs must be a mapping"):
        load_rows(path)


def test_training_prompts_that_are_evaluation_prompts_are_dropped_and_counted(tmp_path):
    """Overlapping files: compared by the rendered prompt (after the template), the training rows keep none of the
    evaluation prompts and the report counts them; training files holding nothing else are refused by name."""
    from allsync.tasks import dataset_splits

    write = lambda name, numbers: tmp_path.joinpath(name).write_text(  # noqa: E731
        "".join(json.dumps({"prompt": f"Find {i}.", "answer": i}) + "\n" for i in numbers)
    )
    write("train.jsonl", range(10))
    write("eval.jsonl", [2, 3, 5, 7])
    files = lambda *names: [str(tmp_path / n) for n in names]  # noqa: E731
    splits, reports = dataset_splits(files("train.jsonl"), files("eval.jsonl"), "dapo_math", seed=0)
    assert sorted(int(p.answer) for p in splits.train) == [0, 1, 4, 6, 8, 9]
    assert sorted(int(p.answer) for p in splits.heldout) == [2, 3, 5, 7]
    assert not {p.prompt for p in splits.train} & {p.prompt for p in splits.heldout}
    assert reports[-1] == "4 training prompts are also evaluation prompts: dropped from training"
    with pytest.raises(DatasetError, match=r"task\.train_files \[.*eval\.jsonl'\]: every training prompt \(4\)"):
        dataset_splits(files("eval.jsonl"), files("eval.jsonl"), None, seed=0)


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


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_recipe_trains_on_a_verl_parquet(warm_tiny, tmp_path):
    """task.name dataset: the recipe reads verl-format train/eval files, reports the deduplication, and runs."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from allsync.tasks import ArithmeticGenerator, make_splits

    splits = make_splits(ArithmeticGenerator(1, 1), 40, 10, seed=3)
    as_verl = lambda problems: [
        {
            "data_source": "arith",
            "prompt": [{"content": p.prompt, "role": "user"}],
            "ability": "MATH",  # noqa: E731
            "reward_model": {"ground_truth": p.answer, "style": "rule"},
            "extra_info": {"index": "0"},
        }
        for p in problems
    ]
    train = write_parquet(tmp_path / "train.parquet", as_verl(splits.train) * 2)
    heldout = write_parquet(tmp_path / "eval.parquet", as_verl(splits.heldout))
    config = {
        "model": {"base": str(warm_tiny), "quant": {"routed_experts": "nf4"}},
        "lora": {"rank": 8, "alpha": 16},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "parallel": {"workers_per_node": 1},
        "task": {"name": "dataset", "train_files": [str(train)], "eval_files": [str(heldout)]},
        "run": {
            "out_dir": str(tmp_path / "out"),
            "steps": 2,
            "eval_every": 2,
            "checkpoint_every": 2,
            "export": "merged",
        },
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    recipe = Path(__file__).parents[2] / "recipes" / "dapo.py"
    done = subprocess.run(
        [sys.executable, str(recipe), "--config", str(path), "--no-ray"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    unique = len({p.prompt for p in splits.train})
    assert f"train.parquet: {2 * len(splits.train)} rows, {unique} unique prompts" in done.stdout
    assert f"held-out accuracy is greedy on {len(splits.heldout)} problems" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert (
        max(r["step"] for r in records) == 2 and sum(r.get("groups_generated", 0) for r in records) >= 8
    )  # 4 prompts x 2 steps


def test_dataset_task_config_is_checked():
    from allsync.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"task.name dataset needs task.train_files and task.eval_files"):
        parse_config({"task": {"name": "dataset", "train_files": ["a.parquet"]}})
    with pytest.raises(ConfigError, match=r"task.train_files is set but task.name is arithmetic"):
        parse_config({"task": {"train_files": ["a.parquet"]}})
    with pytest.raises(ConfigError, match=r"task.min_digits is set but task.name is dataset"):
        parse_config({"task": {"name": "dataset", "train_files": ["a"], "eval_files": ["b"], "min_digits": 2}})
    with pytest.raises(ConfigError, match=r"task.template = 'x': use dapo_math or a text containing \{problem\}"):
        parse_config({"task": {"name": "dataset", "train_files": ["a"], "eval_files": ["b"], "template": "x"}})


def test_arithmetic_parquet_example_writes_the_default_tasks_splits(tmp_path):
    """recipes/arithmetic_parquet.py (the README's parquet example): verl rows that load back as the default task."""
    import subprocess
    import sys
    from pathlib import Path

    from allsync.tasks import ArithmeticGenerator, make_splits

    script = Path(__file__).parents[2] / "recipes" / "arithmetic_parquet.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
    heldout, report = load_rows(tmp_path / "arithmetic-eval.parquet")
    splits = make_splits(ArithmeticGenerator(2, 2, ("+",)), 20000, 200, seed=0)
    assert [(r.prompt, r.answer) for r in heldout] == [((("user", p.prompt),), p.answer) for p in splits.heldout]
    train, report = load_rows(tmp_path / "arithmetic-train.parquet")
    assert report.startswith("arithmetic-train.parquet: 20,000 rows, ")
    assert {r.prompt[0][1] for r in train} == {p.prompt for p in splits.train}
    assert oct((tmp_path / "arithmetic-eval.parquet").stat().st_mode & 0o777) == "0o644"
