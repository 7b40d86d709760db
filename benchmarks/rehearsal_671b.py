"""The 671B DAPO config rehearsed on CPU: its topology with only the widths shrunk, under torchrun on one machine.

    python -m benchmarks.rehearsal_671b [--workers 8] [--compare-expert-parallel 4] [--nodes 1] [--out runs/rehearsal-671b]

What stays as in recipes/configs/dapo_math_deepseek_v3_671b_torch_engine.yaml and DeepSeek-V3's config.json: 61
decoder layers of which the first 3 dense, 256 routed experts and 1 shared, 8 experts a token from 4 of 8 groups
(noaux_tc), MLA with a q_lora, the FP8 release format (e4m3, 128x128 block scales), NF4 routed experts and FP8
attention/shared/dense kept as stored, LoRA rank 16 on every target with the grouped_mm expert kernel, bf16 compute,
activation checkpointing and offload, DAPO (clip-higher, token-mean, overlong shaping, dynamic sampling over 8 rounds
with the workers filling the batch together), the torch engine with 16 KV slots, math_dapo's reward on verl parquet,
the routed experts split over every worker (expert_parallel = workers), a checkpoint every step and the PEFT export.

What shrinks (SHRUNK_MODEL, shrunk_config): the widths (hidden 64, experts' 16, heads 4, MLA ranks 32), the task
(1-digit addition, a base warm-started on it for 60 steps, then written in the FP8 format), the batch (2 prompts of
4 samples a worker, replies of at most 12 tokens, 2 updates a step), the worker count and the reward's processes.

Runs (torchrun, --workers processes each):
  resumed   expert_parallel = --workers: step 1, then --resume for step 2 from step 1's checkpoint; the PEFT export
  straight  the same, steps 1-2 without stopping
  other_ep  expert_parallel = --compare-expert-parallel: step 1
Passes when the resumed run logs every metric of the straight one and exports the same adapter bit for bit, and when
other_ep's step 1 ends with an adapter within ADAPTER_TOLERANCE of the straight run's (bf16 sums in another order move
the update's statistics). Whether other_ep drew the same samples (SAMPLED's metrics) is reported, not required: the
expert dispatch sums a token's expert outputs on each rank holding them (and per node across nodes), so another EP
size groups that sum otherwise, and in bf16 a near-tie token of this random shrunk model can come out otherwise. Every worker holds 1/expert_parallel of the experts, so memory grows
as the expert-parallel size shrinks; 16 workers of 16 experts each did not fit this 2-core, 24 GiB machine
(BENCHMARKS.md). A launch whose record (LOG.json beside its log) exists is not run again.

Records each launch's wall time and the machine's peak memory in use during it (MemTotal - MemAvailable, sampled every
0.5 s, less what was in use before it) in --json (default benchmarks/measured/rehearsal_671b_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch
import yaml
from safetensors.torch import load_file

from allsync.metrics import read_records
from allsync.tasks import ArithmeticGenerator, make_splits
from benchmarks.trl_side_by_side import cpu_model
from moe_lora.tiny import TinySpec, write_fp8_copy

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "recipes" / "configs" / "dapo_math_deepseek_v3_671b_torch_engine.yaml"
RECIPE = ROOT / "recipes" / "dapo.py"
# DeepSeek-V3's topology (config.json: num_hidden_layers 61, first_k_dense_replace 3, n_routed_experts 256,
# num_experts_per_tok 8, n_group 8, topk_group 4, a q_lora_rank) with its widths shrunk
SHRUNK_MODEL = TinySpec(
    layers=61,
    dense_layers=3,
    experts=256,
    experts_per_token=8,
    n_group=8,
    topk_group=4,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=16,
    heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    shards=8,
)
WARM_START_STEPS = 60  # a weak base: about 1 group in 5 has mixed rewards (a stronger one answers alike)
TASK = ArithmeticGenerator(1, 1)
# what the samples decide: equal when two runs drew the same samples (metrics.jsonl's keys)
SAMPLED = {
    "groups_generated",
    "groups_kept",
    "groups_wanted",
    "sampling_rounds",
    "sampling_cap_hits",
    "trained_samples",
    "trained_tokens",
    "optimizer_steps",
    "empty_minibatches",
    "accuracy",
    "reward",
    "reward_errors",
    "response_length",
    "correct_per_1k_tokens",
    "truncated_fraction",
    "decode_fill",
    "continuing",
    "heldout_accuracy",
    "heldout_greedy_accuracy",
    "heldout_mean_tokens",
}
TIMES = {"step_seconds", "samples_per_second", "utilization"}
ADAPTER_TOLERANCE = 1e-3  # of the adapter's largest value: bf16 sums in another order (EP sizes) differ by ~1e-5


def build_base(out: Path) -> Path:
    """The shrunk V3 warm-started on TASK (bf16, allsync.warm_start; reused when its settings match), then written
    in the FP8 release format."""
    from allsync.warm_start import EvalSettings, TrainSettings, WarmStartSettings, warm_start

    settings = WarmStartSettings(
        model=SHRUNK_MODEL,
        task=TASK,
        steps=WARM_START_STEPS,
        train=TrainSettings(batch_size=32, lr=2e-3, warmup_steps=5),
        eval=EvalSettings(heldout_size=20, samples_per_problem=2, max_new_tokens=12),
    )
    warm = warm_start(out / "base-bf16", settings)
    fp8 = out / "base-fp8"
    if not (fp8 / "config.json").exists():
        write_fp8_copy(warm, fp8)
    return fp8


def write_data(out: Path) -> tuple[Path, Path]:
    """TASK's problems as verl parquet (recipes/arithmetic_parquet.py's rows): 400 train draws, 16 held out."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from arithmetic_parquet import verl_rows, write_parquet

    splits = make_splits(TASK, train_size=400, heldout_size=16, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    return (
        write_parquet(verl_rows(splits.train, "train"), out / "train.parquet"),
        write_parquet(verl_rows(splits.heldout, "eval"), out / "eval.parquet"),
    )


def shrunk_config(
    base: Path, data: tuple[Path, Path], out_dir: Path, workers: int, expert_parallel: int, nodes: int = 1
) -> dict:
    """The 671B torch-engine config with the base, the data, the batch, the workers (as `nodes` nodes) and the
    reward's processes replaced; every other setting as shipped."""
    config = yaml.safe_load(CONFIG.read_text())
    config["model"]["base"] = str(base)
    config["rollout"].update(prompts_per_step=2 * workers, group_size=4, max_new_tokens=12)  # 10 a worker, 16, 20,480
    # the slots share 36 pages: a row of these is one page, so 36 full-length rows as at 671B (774,144 tokens)
    config["rollout"]["kv_cache_tokens"] = 36 * 64
    # CUDA graphs and the latent attention kernel need a GPU: the rehearsal decodes with the torch path, eagerly
    config["rollout"].update(decode_graphs=False, attention_kernel="torch")
    config["algorithm"]["overlong"] = {"max_len": 12, "cache_len": 4, "factor": 1.0}  # 20,480 and 4,096
    config["optim"].update(minibatches=2, max_tokens_per_forward=64)  # 16 updates; one 21,504-token sequence
    config["parallel"].update(nodes=nodes, workers_per_node=workers // nodes, expert_parallel=expert_parallel)
    config["task"].update(train_files=[str(data[0])], eval_files=[str(data[1])])
    config["reward"]["processes"] = 1  # 4 a worker
    config["run"].update(out_dir=str(out_dir), steps=2, eval_every=2, eval_samples=2, checkpoint_every=1)
    return config


def meminfo(key: str) -> int:
    """/proc/meminfo's `key`, in bytes."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(info[key].split()[0]) * 1024


class PeakMemory:
    """The machine's memory in use (MemTotal - MemAvailable), sampled every `every` seconds in a thread; `peak` less
    what was in use at the start."""

    def __init__(self, every: float = 0.5):
        self.every, self.start, self.peak = every, self.in_use(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def in_use() -> int:
        return meminfo("MemTotal") - meminfo("MemAvailable")

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self.in_use() - self.start)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Launch:
    name: str
    seconds: float
    peak_bytes: int
    returncode: int


def launch(name: str, config: Path, workers: int, log: Path, *extra: str) -> Launch:
    """recipes/dapo.py under torchrun, `workers` processes; its wall time and peak memory, kept beside the log
    (LOG.json): a launch whose record is there is not run again (delete the run's directory and LOG.json to run it again)."""
    record = log.with_suffix(".json")
    if record.exists():
        result = Launch(**json.loads(record.read_text()))
        print(f"{name}: measured before ({record})")
        return result
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers)]
    start = time.perf_counter()
    with PeakMemory() as memory, log.open("w") as out:
        done = subprocess.run(
            [*command, str(RECIPE), "--config", str(config), *extra], check=False, stdout=out, stderr=out
        )
    result = Launch(name, time.perf_counter() - start, memory.peak, done.returncode)
    print(f"{name}: {result.seconds:.0f} s, peak {result.peak_bytes / 2**30:.1f} GiB, exit {done.returncode} ({log})")
    if done.returncode:
        raise SystemExit(f"{name} failed: see {log}")
    record.write_text(json.dumps(result.__dict__) + "\n")
    return result


def read_metrics(out_dir: Path) -> dict[int, dict]:
    """A run's metrics.jsonl (allsync.metrics.read_records) by step, a step's records (its evaluation) merged."""
    merged: dict[int, dict] = {}
    for record in read_records(out_dir / "metrics.jsonl"):
        merged.setdefault(record["step"], {}).update(record)
    return merged


def differences(a: dict, b: dict, keys: set[str] | None) -> list[str]:
    """The keys (all when None, times and the all-to-all's bytes left out) logged in both and not equal."""
    shared = (set(a) & set(b)) - TIMES - {"alltoall_bytes"}
    return [f"{key}: {a[key]} vs {b[key]}" for key in sorted(shared & keys if keys else shared) if a[key] != b[key]]


def adapter_difference(a: Path, b: Path) -> dict:
    """max |a - b| over two PEFT adapters' tensors, and relative to the largest |a|."""
    ta, tb = (load_file(str(p / "adapter_model.safetensors")) for p in (a, b))
    if set(ta) != set(tb):
        return {"same_keys": False, "relative": math.inf}
    diff = max((ta[k].float() - tb[k].float()).abs().max().item() for k in ta)
    scale = max(t.float().abs().max().item() for t in ta.values())
    return {"same_keys": True, "tensors": len(ta), "max_abs_diff": diff, "relative": diff / scale}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8, help="processes (torchrun --nproc_per_node)")
    parser.add_argument("--compare-expert-parallel", type=int, default=4, help="run B's expert-parallel size")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="parallel.nodes the workers are split into (one machine still runs them all): with 2, an EP group of "
        "more than workers / 2 spans two nodes and its dispatch goes rail then node, as EP 16 on 48 H100 does",
    )
    parser.add_argument("--out", default="runs/rehearsal-671b")
    parser.add_argument("--json", default="benchmarks/measured/rehearsal_671b_cpu.json")
    args = parser.parse_args(argv)
    workers, ep_b = args.workers, args.compare_expert_parallel
    if 256 % workers or workers % ep_b or ep_b == workers:
        parser.error("--workers must divide 256 experts; --compare-expert-parallel must divide it and differ from it")
    if args.nodes < 1 or workers % args.nodes:
        parser.error(f"--nodes {args.nodes} must divide --workers {workers}")
    out = Path(args.out)
    base = build_base(out)
    data = write_data(out / "data")
    runs = {}
    for name, ep in (("resumed", workers), ("straight", workers), ("other_ep", ep_b)):
        run_dir = out / f"{name}-ep{ep}"
        path = out / f"{name}-ep{ep}.yaml"
        path.write_text(yaml.safe_dump(shrunk_config(base, data, run_dir, workers, ep, args.nodes), sort_keys=False))
        runs[name] = (path, run_dir)
    launches = [
        launch(f"EP {workers}, step 1", runs["resumed"][0], workers, out / "resumed-1.log", "--steps", "1"),
        launch(f"EP {workers}, --resume, step 2", runs["resumed"][0], workers, out / "resumed-2.log", "--resume"),
        launch(f"EP {workers}, steps 1-2", runs["straight"][0], workers, out / "straight.log"),
        launch(f"EP {ep_b}, step 1", runs["other_ep"][0], workers, out / "other-ep.log", "--steps", "1"),
    ]
    resumed, straight, other = (read_metrics(runs[name][1]) for name in ("resumed", "straight", "other_ep"))
    checks = {
        # a checkpoint and a resume at EP W: the steps of the run that never stopped, every metric equal
        "resume_step_differences": {s: differences(resumed[s], straight[s], None) for s in (1, 2)},
        "resume_adapter": adapter_difference(runs["resumed"][1] / "adapter", runs["straight"][1] / "adapter"),
        # EP W against EP B at step 1: the samples (reported; bf16 sums grouped per rank), the update, the adapter
        "other_ep_step1_sample_differences": differences(straight[1], other[1], SAMPLED),
        "other_ep_step1_update": {
            key: [straight[1][key], other[1][key]] for key in ("loss", "grad_norm", "entropy", "approx_kl")
        },
        "other_ep_step1_adapter": adapter_difference(
            runs["straight"][1] / "checkpoints" / "step-000001" / "adapter", runs["other_ep"][1] / "adapter"
        ),
    }
    passed = (
        not any(checks["resume_step_differences"].values())
        and checks["resume_adapter"]["relative"] == 0.0
        and checks["other_ep_step1_adapter"]["relative"] < ADAPTER_TOLERANCE
    )
    result = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {meminfo('MemTotal') / 2**30:.0f} GiB",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m benchmarks.rehearsal_671b " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": SHRUNK_MODEL.__dict__,
        "workers": workers,
        "nodes": args.nodes,
        "expert_parallel": [workers, ep_b],
        "launches": [launch.__dict__ for launch in launches],
        "steps": {name: read_metrics(runs[name][1]) for name in runs},
        "checks": checks,
        "passed": passed,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("launches", "checks", "passed")}, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
