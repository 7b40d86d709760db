"""Measured GPU memory of real-size DeepSeek-V3 layers as the trainer holds them (issue 25's check on a GPU).

    python -m benchmarks.v3_layer_memory [--plans nf4,fp8] [--seqs 4096,21504] [--json out.json]

A DeepSeek-V3 checkpoint with the real shapes (hidden 7168, 128 heads, MLA ranks 1536/512, vocab 129,280, 256
routed experts of 2048, one shared expert) but two decoder layers, the first dense (intermediate 18,432) and
the second MoE, is written in the real on-disk format (FP8 e4m3 weights with 128x128 block scales, sharded
safetensors) into --ckpt, then loaded onto the GPU by the trainer's own loader, once per quantization plan:

    nf4  routed experts NF4, shared experts / attention / dense MLP FP8 (the 671B config's plan)
    fp8  every quantizable weight FP8 as stored

For each plan it measures (torch.cuda.memory_allocated differences, so the caching allocator's rounding is
in them): the frozen model's bytes (also with only routed experts 0-15, what one rank of expert-parallel size
16 holds); LoRA (rank 16, alpha 32, the 671B config's targets, expert kernel grouped_mm) parameters; then one
forward+backward of DAPO's loss path (`forward_pass`: decoder, chunked token logprobs from lm_head) on one
sequence of each --seqs length, with and without activation checkpointing: the peak above what was resident
and the seconds; the LoRA gradients; AdamW's state after one step. Next to each it prints what the tensors
themselves hold (byte_report, parameter nbytes). A case that runs out of memory is recorded as such.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from allsync.plan.shapes import DEEPSEEK_V3, tiny_spec_fields
from quant.checkpoint_io import atomic_output_dir, atomic_write_text, split_into_shards, write_shards
from quant.formats import fp8_block_quantize
from quant.layout import expected_tensors, scale_key
from quant.loader import QuantPlan, byte_report, load_frozen_model

REAL_V3_TWO_LAYERS = tiny_spec_fields(DEEPSEEK_V3, layers=2, dense_layers=1, experts=256, fp8=True)
VOCAB = DEEPSEEK_V3["vocab_size"]
PLANS = {"nf4": QuantPlan("nf4", "fp8", "fp8", "fp8"), "fp8": QuantPlan.uniform("fp8")}
TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense_mlp", "shared_experts", "routed_experts")
EP16_EXPERTS = range(0, 16)


def v3_config(shape: dict, max_positions: int) -> dict:
    from moe_lora.tiny import TinySpec, tiny_config

    config = tiny_config(TinySpec(**shape), vocab_size=VOCAB)
    config["max_position_embeddings"] = max_positions
    return config


def write_checkpoint(out: Path, config: dict, device: str, seed: int = 0) -> Path:
    """Every tensor of `config` drawn on `device` (linears N(0, 1/fan_in), FP8-quantized with block scales),
    written as 4 safetensors shards with their index; nothing is written if it exists."""
    if (out / "config.json").exists():
        return out
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for key, spec in expected_tensors(config).items():
        shape = spec.shape
        if key.endswith("e_score_correction_bias"):
            tensors[key] = torch.zeros(shape, dtype=torch.float32)
        elif len(shape) == 1:
            tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) / shape[1] ** 0.5
            if spec.quantizable:
                q, s = fp8_block_quantize(w)
                tensors[key], tensors[scale_key(key)] = q.cpu(), s.cpu()
            else:
                tensors[key] = w.to(torch.bfloat16).cpu()
            del w
    with atomic_output_dir(out, overwrite=False) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_shards(tmp, split_into_shards(tensors, 4))
    return out


class Memory:
    """torch.cuda.memory_allocated on CUDA; on CPU every reading is None (nothing to measure)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def allocated(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def free(memory: Memory) -> None:
    gc.collect()
    if memory.cuda:
        torch.cuda.empty_cache()


def load_measured(ckpt: Path, plan: QuantPlan, device: str, memory: Memory, experts: range | None):
    """The frozen model loaded in `plan` (routed experts `experts` only, None: all) and what loading it allocated
    (`measured`) against what its tensors hold (`tensors`, `by_group`: byte_report)."""
    free(memory)
    before = memory.allocated()
    t0 = time.perf_counter()
    model = load_frozen_model(ckpt, plan, progress=False, experts=experts, device=device)
    seconds = time.perf_counter() - t0
    rows = {f"{r.group}:{r.format}": r.bytes for r in byte_report(model)}
    return model, {
        "measured": delta(memory.allocated(), before),
        "tensors": sum(rows.values()),
        "by_group": rows,
        "load_seconds": round(seconds, 2),
    }


def train_step_bytes(
    model, optimizer, seq: int, checkpointing: bool, device: str, memory: Memory, offload: bool = False
) -> dict:
    """One forward+backward of -mean(token logprob) on one sequence of `seq` random tokens; offload: the forward's
    saved tensors in (pinned) host memory (optim.activation_offload)."""
    from allsync.update.forward import checkpointed_decoder_layers, forward_pass, saved_on_host
    from allsync.update.sequences import SequenceBatch

    optimizer.zero_grad(set_to_none=True)
    free(memory)
    ids = torch.randint(0, VOCAB, (1, seq), device=device)
    batch = SequenceBatch(ids, torch.ones_like(ids), torch.ones(1, seq - 1, device=device))
    resident = memory.allocated()
    memory.reset_peak()
    t0 = time.perf_counter()
    try:
        with checkpointed_decoder_layers(model, checkpointing), saved_on_host(offload):
            loss = -forward_pass(model, batch).logprobs.mean()
        loss.backward()
        del loss
    except torch.OutOfMemoryError as e:
        optimizer.zero_grad(set_to_none=True)
        free(memory)
        return {"seq": seq, "checkpointing": checkpointing, "offload": offload, "oom": str(e).split("\n")[0][:200]}
    if memory.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "seq": seq,
        "checkpointing": checkpointing,
        "offload": offload,
        "seconds": round(seconds, 3),
        "peak_above_resident": delta(memory.peak(), resident),
        "grads_measured": delta(memory.allocated(), resident),
        "grads_tensors": sum(p.grad.nbytes for p in params if p.grad is not None),
    }


def measure_plan(
    ckpt: Path, name: str, plan: QuantPlan, seqs: list[int], rank: int, device: str, offload: bool = False
) -> dict:
    from moe_lora.lora import LoRAConfig, attach_lora, seeded_init_

    memory = Memory(device)
    shard, shard_frozen = load_measured(ckpt, plan, device, memory, EP16_EXPERTS)
    del shard
    model, frozen = load_measured(ckpt, plan, device, memory, None)
    before = memory.allocated()
    kernel = "grouped_mm" if device.startswith("cuda") else "loop"
    attach_lora(model, LoRAConfig(rank, 2.0 * rank, TARGETS, expert_kernel=kernel))
    seeded_init_(model, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    lora = {
        "measured": delta(memory.allocated(), before),
        "tensors": sum(p.nbytes for p in params),
        "params": sum(p.numel() for p in params),
    }
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    variants = [(True, False), (False, False)] + ([(True, True)] if offload else [])  # (checkpointing, offload)
    steps = []
    for s, (c, o) in ((s, v) for s in seqs for v in variants):
        print(f"  {name}: a {s:,}-token step, checkpointing {c}, offload {o} ...", end=" ", flush=True)
        steps.append(train_step_bytes(model, optimizer, s, c, device, memory, o))
        print(steps[-1].get("seconds", "out of memory"), "s", flush=True)
    done = [s for s in steps if "oom" not in s]
    before = memory.allocated()
    if done:  # gradients are present from the last step that ran: one AdamW step makes its state
        if steps[-1].get("oom"):
            train_step_bytes(model, optimizer, seqs[0], True, device, memory)
            before = memory.allocated()
        optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    adam = {"measured": delta(memory.allocated(), before), "tensors": sum(t.nbytes for t in state)}
    del model, optimizer, params, state
    free(memory)
    return {
        "plan": name,
        "frozen": frozen,
        "frozen_ep16_shard": shard_frozen,
        "lora": lora,
        "steps": steps,
        "adamw": adam,
    }


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f}"


def format_report(result: dict) -> str:
    lines = [f"plan {result['plan']}: GiB measured (tensors)"]
    for key in ("frozen", "frozen_ep16_shard", "lora", "adamw"):
        r = result[key]
        lines.append(f"  {key:<18} {gib(r['measured']):>9} ({gib(r['tensors'])})")
    for s in result["steps"]:
        tag = f"seq {s['seq']:>6} ckpt {'on ' if s['checkpointing'] else 'off'}{' offload' if s.get('offload') else ''}"
        if "oom" in s:
            lines.append(f"  {tag}: out of memory")
        else:
            lines.append(
                f"  {tag}: peak above resident {gib(s['peak_above_resident'])} GiB, grads {gib(s['grads_measured'])}"
                f" ({gib(s['grads_tensors'])}), {s['seconds']:.2f} s"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default="nf4,fp8")
    ap.add_argument("--seqs", default="4096,21504")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--ckpt", default="/tmp/v3-two-layers")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="JSON overrides of the shape (a small one for a CPU run)")
    ap.add_argument("--offload", action="store_true", help="also a checkpointed step with activation offload")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shape = {**REAL_V3_TWO_LAYERS, **(json.loads(args.shape) if args.shape else {})}
    seqs = [int(s) for s in args.seqs.split(",")]
    unknown = [p for p in args.plans.split(",") if p not in PLANS]
    if unknown:
        raise SystemExit(f"--plans: unknown plan {unknown[0]!r}; known: {', '.join(PLANS)}")
    config = v3_config(shape, max(seqs))
    t0 = time.perf_counter()
    ckpt = write_checkpoint(Path(args.ckpt), config, args.device)
    out = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "shape": shape,
        "vocab": VOCAB,
        "rank": args.rank,
        "targets": TARGETS,
        "write_seconds": round(time.perf_counter() - t0, 1),
        "plans": [],
    }
    print(f"checkpoint {ckpt} written in {out['write_seconds']} s", flush=True)
    for name in args.plans.split(","):
        result = measure_plan(ckpt, name, PLANS[name], seqs, args.rank, args.device, args.offload)
        out["plans"].append(result)
        print(format_report(result), flush=True)
        if args.json:
            atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
