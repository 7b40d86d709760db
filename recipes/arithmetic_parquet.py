"""Write the default task's problems as verl-format parquet files, to train and evaluate on files as one
would on DAPO-Math-17k and AIME-2024.

    python recipes/arithmetic_parquet.py [--out runs/data]
    -> runs/data/arithmetic-train.parquet  (20,000 draws of 2-digit addition, repeats included)
       runs/data/arithmetic-eval.parquet   (the 200 held-out problems the warm start and RL never train on)

Rows have verl's RL layout: data_source, prompt (a list of {role, content} messages), ability,
reward_model {ground_truth, style}, extra_info {split, index}. Each file is written whole (temp file, then rename).
"""

import argparse
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from allsync.tasks import ArithmeticGenerator, Problem, make_splits
from evals.datasets import verl_schema

SCHEMA = verl_schema([("split", pa.string()), ("index", pa.int64())])


def verl_rows(problems: list[Problem], split: str) -> list[dict]:
    return [
        {
            "data_source": "allsync/arithmetic",
            "prompt": [{"content": p.prompt, "role": "user"}],
            "ability": "arithmetic",
            "reward_model": {"ground_truth": p.answer, "style": "rule"},
            "extra_info": {"split": split, "index": i},
        }
        for i, p in enumerate(problems)
    ]


def write_parquet(rows: list[dict], path: Path) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp, row_group_size=4096)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/data")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_splits(
        ArithmeticGenerator(2, 2, ("+",)), train_size=20000, heldout_size=200, seed=0
    )  # tiny_cpu.yaml's task
    for split, problems in (("train", splits.train), ("eval", splits.heldout)):
        path = write_parquet(verl_rows(problems, split), out / f"arithmetic-{split}.parquet")
        print(f"wrote {path}: {len(problems):,} rows")


if __name__ == "__main__":
    main()
