"""Adapter-only sync to a vLLM engine, in memory against through a directory, and what it makes for DeepSeek-V3 671B.

    python -m benchmarks.vllm_adapter_sync [--layers 4] [--repeats 3] [--json FILE]

After every update the trainer hands its adapter (float32, every expert's gate, up and down) to its vLLM engine.
Two ways, timed side by side on DeepSeek-V3's real shapes (its first `--layers` layers, the first 3 dense, the rest
MoE layers of 256 experts; LoRA rank 16 on the 671B config's targets) for one rank of expert parallelism 16
(experts 0-15), each through vLLM 0.32's own code in CPU memory (allsync.engines.vllm_lora_check.vllm_view):
  directory   `write_peft_adapter` into /dev/shm, then `LoRAModel.from_local_checkpoint` (a LoRARequest's path)
  in memory   `LoRAModel.from_lora_tensors` on the tensors (what allsync.engines.vllm_engine does now)
each followed by the packing and scaling (`_create_merged_loras_inplace`) and the copy into the MoE layers' stacked
LoRA buffers (`FusedMoEWithLoRA.set_lora`). The bytes of one rank's whole 671B adapter
(allsync.plan.weights.lora_values over all 61 layers with experts 0-15) times the seconds per byte give the predicted
sync per step. Not measured: the copy from host to GPU memory that vLLM makes when it activates the adapter on a GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from allsync.plan.weights import lora_target, lora_values
from allsync.plan.shapes import DEEPSEEK_V3
from moe_lora.adapter_io import PREFIX, Adapter, adapter_config_json, write_peft_adapter
from quant.layout import expected_tensors

TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense_mlp", "shared_experts", "routed_experts")
RANK, ALPHA, EP, EP_RANK = 16, 32, 16, 0


def v3_config(layers: int) -> dict:
    return {**DEEPSEEK_V3, "num_hidden_layers": layers}


def rank_adapter(config: dict, experts: range, seed: int = 0) -> Adapter:
    """Random LoRA (A and B) of rank RANK on TARGETS, routed experts only those in `experts`."""
    from quant.layout import parse_expert_key

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, spec in expected_tensors(config).items():
        parsed = parse_expert_key(key)
        if not spec.quantizable or lora_target(key, spec) not in TARGETS or (parsed and parsed[1] not in experts):
            continue
        module = key.removesuffix(".weight")
        out_features, in_features = spec.shape
        tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.randn(RANK, in_features, generator=gen)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = torch.randn(out_features, RANK, generator=gen)
    return Adapter(tensors, RANK, ALPHA)


def time_sync(config: dict, adapter: Adapter, root: Path) -> tuple[float, float]:
    """(seconds through a /dev/shm directory, seconds in memory) for one sync, each up to the stacked buffers."""
    from allsync.engines.vllm_lora_check import vllm_view

    directory = root / f"adapter-{time.monotonic_ns()}"
    start = time.perf_counter()
    write_peft_adapter(adapter, directory, "DeepSeek-V3")
    vllm_view(directory, config, RANK, EP, EP_RANK)
    through_directory = time.perf_counter() - start
    shutil.rmtree(directory)
    start = time.perf_counter()
    vllm_view(None, config, RANK, EP, EP_RANK, in_memory=(adapter.tensors, adapter_config_json(adapter, "DeepSeek-V3")))
    return through_directory, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="DeepSeek-V3's first N layers (3 dense, then MoE)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args(argv)
    if args.layers <= DEEPSEEK_V3["first_k_dense_replace"]:
        parser.error(f"--layers {args.layers}: at least {DEEPSEEK_V3['first_k_dense_replace'] + 1} (one MoE layer)")
    config = v3_config(args.layers)
    experts = range(EP_RANK * 256 // EP, (EP_RANK + 1) * 256 // EP)
    adapter = rank_adapter(config, experts)
    nbytes = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
    root = Path(tempfile.mkdtemp(prefix="allsync-sync-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        time_sync(config, adapter, root)  # untimed: vLLM's imports and first-call costs
        times = [time_sync(config, adapter, root) for _ in range(args.repeats)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    directory_s, memory_s = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    full_bytes = lora_values(DEEPSEEK_V3, RANK, TARGETS, experts) * 4  # float32, as the engine is handed it
    out = {
        "layers": args.layers,
        "adapter_bytes": nbytes,
        "tensors": len(adapter.tensors),
        "directory_seconds": directory_s,
        "in_memory_seconds": memory_s,
        "directory_over_in_memory": directory_s / memory_s,
        "v3_671b_rank_adapter_bytes": full_bytes,
        "v3_671b_predicted_sync_seconds_in_memory": full_bytes * memory_s / nbytes,
        "v3_671b_predicted_sync_seconds_directory": full_bytes * directory_s / nbytes,
    }
    print(
        f"{args.layers} DeepSeek-V3 layers, rank {RANK}, experts {experts.start}-{experts.stop - 1} of one EP-{EP} "
        f"rank: {nbytes / 1e6:.1f} MB in {len(adapter.tensors)} tensors (float32)"
    )
    print(
        f"through /dev/shm {directory_s * 1e3:.0f} ms, in memory {memory_s * 1e3:.0f} ms "
        f"({out['directory_over_in_memory']:.2f}x); median of {args.repeats}"
    )
    print(
        f"DeepSeek-V3 671B, one rank's adapter ({full_bytes / 1e9:.2f} GB float32): predicted sync "
        f"{out['v3_671b_predicted_sync_seconds_in_memory']:.1f} s in memory, "
        f"{out['v3_671b_predicted_sync_seconds_directory']:.1f} s through /dev/shm, per step on this machine "
        "(host side; the GPU copy not included)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
