"""The whole-step oracle for refactors: every shipped tiny config gives the same numbers and the same adapter bytes.

    python -m benchmarks.step_oracle record DIR [--steps 30] [--only NAME ...]
    python -m benchmarks.step_oracle check DIR  [--only NAME ...]

`record` runs `python recipes/dapo.py --config C --steps N --out-dir DIR/runs/<name>` for each
recipes/configs/tiny_cpu*.yaml (two Ray workers, one compute thread each, the warm start at two threads), and
again with `--no-ray` where the config allows one in-process worker (no expert parallelism), and writes
DIR/oracle.json: per run, every metrics.jsonl row without its timing keys, and the SHA-256 of each file of the
exported adapter. `check` runs the same commands in a scratch folder and compares with DIR/oracle.json: it
prints each run's first difference and exits 1 if there is one. The warm-started bases are the ones cached
under runs/ (built on the first run): the oracle checks the RL step, not the warm start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "recipes" / "configs").glob("tiny_cpu*.yaml"))
TIMING_WORDS = ("seconds", "per_second", "utilization", "waited", "_time")


def runs(only: list[str] | None) -> list[tuple[str, Path, bool]]:
    """(run name, config, in-process) for each shipped tiny config, plus its --no-ray run where one is allowed."""
    out = []
    for config in CONFIGS:
        name = config.stem
        if only and name not in only:
            continue
        out.append((name, config, False))
        if (yaml.safe_load(config.read_text()).get("parallel") or {}).get("expert_parallel", 1) == 1:
            out.append((f"{name}-no-ray", config, True))
    return out


def without_timing(row: dict) -> dict:
    """A metrics row without the keys that measure time (they differ from run to run)."""
    return {k: v for k, v in row.items() if not any(word in k for word in TIMING_WORDS)}


def file_digests(folder: Path, root: Path = ROOT) -> dict[str, str]:
    """SHA-256 of each file; in adapter_config.json the base's path is taken relative to the tree `root`, so that two
    checkouts of the same commit give the same digest."""
    digests = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        data = path.read_bytes()
        if path.name == "adapter_config.json":
            config = json.loads(data)
            base = Path(config.get("base_model_name_or_path") or "")
            if base.is_absolute() and base.is_relative_to(root):
                config["base_model_name_or_path"] = str(base.relative_to(root))
            data = json.dumps(config, sort_keys=True).encode()
        digests[path.name] = hashlib.sha256(data).hexdigest()
    return digests


def run_one(config: Path, in_process: bool, out_dir: Path, steps: int) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)  # a run of this oracle's own scratch folder, never a user's run
    command = [
        sys.executable,
        "recipes/dapo.py",
        "--config",
        str(config),
        "--steps",
        str(steps),
        "--out-dir",
        str(out_dir),
    ]
    done = subprocess.run(command + (["--no-ray"] if in_process else []), cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [
        without_timing(json.loads(line))
        for line in (out_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return {"metrics": rows, "adapter": file_digests(out_dir / "adapter")}


def first_difference(want: dict, got: dict) -> str | None:
    """Where two runs first differ (adapter files, then metrics rows in order), or None."""
    if want["adapter"] != got["adapter"]:
        return f"adapter files: {want['adapter']} != {got['adapter']}"
    for i, (a, b) in enumerate(zip(want["metrics"], got["metrics"])):
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            return f"metrics row {i} (step {a.get('step')}): " + ", ".join(
                f"{k} {a.get(k)} != {b.get(k)}" for k in keys[:5]
            )
    if len(want["metrics"]) != len(got["metrics"]):
        return f"{len(want['metrics'])} metrics rows != {len(got['metrics'])}"
    return None


def prepare_data() -> None:
    """The files the parquet config trains on (recipes/arithmetic_parquet.py, the README's step before it)."""
    if not (ROOT / "runs" / "data" / "arithmetic-train.parquet").exists():
        subprocess.run([sys.executable, "recipes/arithmetic_parquet.py", "--out", "runs/data"], cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("record", "check"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", nargs="*", help="config names (file stems) to run; default: all")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from quant.checkpoint_io import atomic_write_text

    oracle_path = args.dir / "oracle.json"
    if args.mode == "record":
        args.dir.mkdir(parents=True, exist_ok=True)
        recorded, steps, scratch = {}, args.steps, args.dir / "runs"
    else:
        stored = json.loads(oracle_path.read_text())
        recorded, steps, scratch = stored["runs"], stored["steps"], Path(tempfile.mkdtemp(prefix="oracle-"))
    prepare_data()
    results, failures = {}, 0
    for name, config, in_process in tqdm(runs(args.only), desc=f"oracle {args.mode}", unit="run"):
        results[name] = run_one(config, in_process, scratch / name, steps)
        if args.mode == "record":  # each run kept as soon as it is done
            atomic_write_text(oracle_path, json.dumps({"steps": steps, "runs": results}, indent=1))
        if args.mode == "check":
            if name not in recorded:
                print(f"{name}: not in {oracle_path}")
                continue
            difference = first_difference(recorded[name], results[name])
            failures += difference is not None
            print(f"{name}: {'same numbers and adapter bytes' if difference is None else difference}")
    if args.mode == "record":
        print(f"wrote {oracle_path}: {len(results)} runs of {steps} steps")
    else:
        print(f"step oracle: {len(results) - failures} of {len(results)} runs the same")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
