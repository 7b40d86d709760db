"""Reading a DAPO-Math-17k-sized parquet: time and peak memory of `evals.datasets.load_rows`.

    python benchmarks/datasets.py [--unique 17917] [--copies 100] [--prompt-chars 900] [--dir DIR]

Writes (once, into --dir, default a temp folder) a parquet in verl's RL layout shaped like the released
DAPO-Math-17k: `unique` prompts of about `prompt-chars` characters wrapped in DAPO's math prompt, each
repeated `copies` times in shuffled order (1,791,700 rows by default), in row groups of 10,000. Then, in a
fresh process, loads it with `load_rows` and reports rows read, unique rows kept, seconds, and the peak
resident memory of that process next to the file's size and the bytes of the kept prompts.
Last line: `load_rows: N rows -> U unique in S s, peak RSS R MB (file F MB)`.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file, this folder would shadow the allsync package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from evals.datasets import DAPO_MATH_TEMPLATE, verl_schema  # noqa: E402


def write_dapo_like(path: Path, unique: int, copies: int, prompt_chars: int, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = verl_schema()
    rng = random.Random(seed)
    words = ["triangle", "integer", "sum", "of", "the", "let", "find", "positive", "real", "number", "such", "that"]
    problems = [f"Problem {i}: " + " ".join(rng.choice(words) for _ in range(prompt_chars // 7)) for i in range(unique)]
    order = [i for i in range(unique) for _ in range(copies)]
    rng.shuffle(order)
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, len(order), 10_000):
            chunk = order[start : start + 10_000]
            rows = [
                {
                    "data_source": "math_dapo",
                    "prompt": [{"content": DAPO_MATH_TEMPLATE.replace("{problem}", problems[i]), "role": "user"}],
                    "ability": "MATH",
                    "reward_model": {"ground_truth": str(i), "style": "rule-lighteval/MATH_v2"},
                    "extra_info": {"index": f"{i}-{start + j}"},
                }
                for j, i in enumerate(chunk)
            ]
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
    return path


def measure(path: str) -> dict:
    """In this process: load_rows, seconds and peak RSS (ru_maxrss, KiB on Linux)."""
    from evals.datasets import load_rows

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    rows, report = load_rows(path)
    seconds = time.perf_counter() - start
    kept = sum(len(c.encode()) for r in rows for _, c in r.prompt)
    return {
        "report": report,
        "unique": len(rows),
        "seconds": round(seconds, 1),
        "kept_prompt_bytes": kept,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_mb": before / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unique", type=int, default=17917)
    parser.add_argument("--copies", type=int, default=100)
    parser.add_argument("--prompt-chars", type=int, default=900)
    parser.add_argument("--dir", help="where the parquet is written (reused when there)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: measure this file in this process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="allsync-dataset-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"dapo-like-{args.unique}x{args.copies}.parquet"
    if not path.exists():
        start = time.perf_counter()
        write_dapo_like(path, args.unique, args.copies, args.prompt_chars)
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    done = subprocess.run(
        [sys.executable, __file__, "--measure", str(path)], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    size_mb = path.stat().st_size / 2**20
    print(result["report"])
    print(
        f"kept prompts: {result['kept_prompt_bytes'] / 2**20:.1f} MB; process RSS before loading {result['rss_before_mb']:.0f} MB"
    )
    print(
        f"load_rows: {args.unique * args.copies:,} rows -> {result['unique']:,} unique in {result['seconds']} s, "
        f"peak RSS {result['peak_rss_mb']:.0f} MB (file {size_mb:.0f} MB)"
    )


if __name__ == "__main__":
    main()
