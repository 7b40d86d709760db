"""The torch engine's decode step at DeepSeek-V3's real width, against the memory-bandwidth roofline (issue 46).

    python -m benchmarks.engine_decode [--plans nf4,fp8] [--rows 32,64,128,256] [--contexts 1024,8192,20480]
                                       [--steps 8] [--device cuda] [--modes eager,fixed,graphed] [--json out.json]
                                       [--kv-cache auto,fp8] [--attention torch,triton] [--expert-kernel dequantize,triton]
                                       [--attention-blocks 16x32x8,64x32x8] [--expert-blocks 64x64x4x3x16,32x128x4x2x64]
                                       [--fp8-linear-kernel dequantize,scaled_mm]

The checkpoint of benchmarks/v3_layer_memory.py (real shapes, two decoder layers: one dense, one MoE with 256
routed experts; random weights in the real FP8 format) is loaded by the trainer's loader in each plan (nf4: routed
experts NF4, the rest FP8; fp8: all FP8), with LoRA rank 16 on the 671B config's targets (grouped_mm on CUDA), and
decoded as the engine decodes (allsync.engines.slots.decode_forward on a SlotKVCache holding the MLA latent,
attention in latent space, then sample_rows and the host read of the finish flags that the engine's loop makes).

For each R live rows and context C: the R slots are filled with random latents of C positions (a prefill of R x C
tokens would cost far more than the decode it sets up, and decode time does not depend on the cached values), then
--steps decode steps are timed one by one (after two to warm up); reported: the median step, its dense layer, MoE
layer and the rest (embedding, final norm, lm_head over the vocabulary, sampling, the host read), and R / step
tokens per second. --modes: the engine's live-slot step (eager), the fixed-shape step run eagerly (fixed: every
slot, the routed experts without a host read, all of them dequantized) and its CUDA graphs (graphed, one per span of
allsync.engines.slots.span_bucket; rollout.decode_graphs). --attention-blocks: the latent kernel's cuts to time
(moe_lora.latent_attention.KernelBlocks: heads per program, positions per block, warps), each a case of its own;
--expert-blocks likewise the NF4 expert kernel's (quant.fused_experts.ExpertBlocks: columns a program, weight columns
a step, warps, pipeline stages, an expert's rows a pass). --fp8-linear-kernel scaled_mm: the FP8 linears multiplied as FP8 GEMMs
(rollout.fp8_linear_kernel, quant.formats.fp8_gemm), a case of its own.

Roofline: a decode step must read at least the weights it uses and the cache it attends over,

    bytes = frozen weights (routed experts: only the expected distinct experts of R x top-k draws,
            E (1 - (1 - k/E)^R)) + LoRA tensors + R C (kv_lora_rank + d_rope) x 2 bytes per MLA layer
            (fp8: R C (kv_lora_rank (1 + 4 / 128) + 2 d_rope) bytes per MLA layer)

    roofline seconds = bytes / B,   B = 2 n / t of a device-to-device copy of n bytes (measured in the same run)

so measured / roofline says how far the step is from bandwidth-bound (the embedding's rows are not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from allsync.engines.graphs import GraphedStep
from allsync.engines.slots import FixedShapeStep, decode_forward, sample_rows, span_bucket
from allsync.engines.torch_engine import Sampling
from allsync.plan.torch_decode import expected_touched
from benchmarks.v3_layer_memory import PLANS, REAL_V3_TWO_LAYERS, TARGETS, Memory, free, v3_config, write_checkpoint
from moe_lora.latent_attention import KernelBlocks, kernel_blocks
from quant.fused_experts import ExpertBlocks, expert_blocks
from moe_lora.kv_caches import LatentKVCache, SlotKVCache, fp8_latent_bytes
from moe_lora.mla_decode import install_mla_decode
from quant.checkpoint_io import atomic_write_text
from quant.formats import fp8_gemm_linears
from quant.loader import byte_report, load_frozen_model


class Clock:
    """Elapsed seconds between marks: CUDA events on a GPU (read after one synchronize), perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks; the marks are cleared."""
        if self.cuda:
            torch.cuda.synchronize()
            out = [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
        else:
            out = [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []
        return out


def copy_bandwidth(device: str, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (each byte read once and written once: 2 n / t),
    the best of `repeats` after one to warm up."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    clock, best = Clock(device), float("inf")
    for _ in range(repeats + 1):
        clock.mark()
        target.copy_(source)
        clock.mark()
        best = min(best, clock.spans()[0])
    del source, target
    return 2 * nbytes / best


def weight_bytes_touched(model, rows: int) -> int:
    """Frozen bytes a decode step of `rows` rows reads (module docstring) plus every LoRA tensor's."""
    config = model.config
    touched = expected_touched(config.n_routed_experts, config.num_experts_per_tok, rows)
    total = 0
    for row in byte_report(model):
        if row.group == "embed":
            continue
        total += row.bytes * (touched / config.n_routed_experts if row.group == "routed_experts" else 1)
    lora = sum(p.nbytes for name, p in model.named_parameters() if "lora_" in name)
    return int(total) + lora


def kv_bytes_read(config, rows: int, context: int, element_bytes: int, fp8: bool = False) -> int:
    """R C (kv_lora_rank + d_rope) x element bytes per MLA layer: the latent each step attends over (fp8: the
    kv_lora_rank values one byte each, a float32 scale per 128 of them, d_rope in the compute dtype:
    moe_lora.kv_caches.fp8_latent_bytes)."""
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    per_token = fp8_latent_bytes(rank, rope, element_bytes) if fp8 else (rank + rope) * element_bytes
    return rows * context * per_token * config.num_hidden_layers


def random_latent_pool(
    model, rows: int, context: int, capacity: int, fp8: bool = False, kernel: bool = False
) -> SlotKVCache:
    """A SlotKVCache of `rows` slots with room for `capacity` positions, each slot holding `context` random latent
    positions (shaped by a one-token prefill's LatentKVCache); fp8: stored as rollout.kv_cache_dtype fp8 stores them;
    kernel: attended with moe_lora.latent_attention's kernel (rollout.attention_kernel triton)."""
    device = model.device
    probe = LatentKVCache(reserve=0)
    model.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), past_key_values=probe, use_cache=True)
    pool = SlotKVCache(rows, capacity, model.config.kv_lora_rank if fp8 else None, kernel)
    pool.fill(0, probe, torch.zeros(rows, dtype=torch.long, device=device), torch.ones(rows, device=device).long())
    slots, positions = torch.arange(rows, device=device), torch.arange(context, device=device)
    for layer, source in zip(pool.layers, probe.layers):
        latent = torch.randn(rows, 1, context, source.keys.shape[-1], dtype=source.keys.dtype, device=device)
        layer.write(slots, positions, latent, latent[..., :0])
    pool.lengths.fill_(context)
    return pool


def layer_clock(model, clock: Clock) -> list:
    """Marks before and after every decoder layer's forward (hooks; remove them with .remove())."""
    handles = []
    for layer in model.model.layers:
        handles.append(layer.register_forward_pre_hook(lambda *_: clock.mark()))
        handles.append(layer.register_forward_hook(lambda *_: clock.mark()))
    return handles


MODES = ("eager", "fixed", "graphed")


def use_expert_kernel(model, kernel: str) -> None:
    """The routed experts' fixed-shape forward with `kernel` (rollout.frozen_expert_kernel): triton stacks each
    layer's NF4 once (quant.modules.stack_frozen_experts) and keeps it; dequantize sets it aside."""
    from quant.modules import stack_frozen_experts
    from quant.modules import FrozenExperts

    experts = [m for m in model.modules() if isinstance(m, FrozenExperts)]
    if kernel == "triton":
        for m in experts:
            m.stacked = getattr(m, "kept_stack", None)
        stack_frozen_experts(model)
        for m in experts:
            m.kept_stack = m.stacked
    else:
        for m in experts:
            m.stacked = None


def step_function(model, pool: SlotKVCache, sampling: Sampling, mode: str):
    """step(last, seeds, counts, needed) -> (tokens, logprobs) of every row, the pool's slots all live, as the engine
    decodes in `mode`: eager (slots.decode_forward of the live slots), fixed (slots.FixedShapeStep: every slot, routed
    experts in fixed shapes, span from span_bucket) or graphed (engines.graphs.GraphedStep: the fixed-shape step's CUDA
    graph per span, replayed)."""
    if mode == "eager":

        def eager(last, seeds, counts, needed):
            return sample_rows(decode_forward(model, pool, last, needed - 1).float(), seeds, counts, sampling)

        return eager
    fixed = FixedShapeStep(model, pool, sampling)
    step = GraphedStep(fixed) if mode == "graphed" else fixed
    live = torch.ones(pool.slots, dtype=torch.long, device=model.device)
    return lambda last, seeds, counts, needed: step(last, live, seeds, counts, span_bucket(needed, pool.capacity))


def decode_setup(model, rows: int, context: int, steps: int, mode: str, fp8: bool, attention: str):
    """(step, last, seeds, counts) for `steps` decode steps of `rows` live rows over `context` random cached positions
    (random_latent_pool with room for them), stepped as `mode` steps (step_function): each row's last token, its
    sampling seed and its drawn-token count."""
    sampling = Sampling(max_new_tokens=steps, temperature=1.0, top_p=1.0)
    pool = random_latent_pool(model, rows, context, context + steps + 1, fp8, attention == "triton")
    last = torch.randint(3, model.config.vocab_size, (rows,), device=model.device)
    seeds = torch.arange(rows, device=model.device)
    counts = torch.zeros(rows, dtype=torch.long, device=model.device)
    return step_function(model, pool, sampling, mode), last, seeds, counts


@torch.no_grad()
def decode_steps(
    model,
    rows: int,
    context: int,
    steps: int,
    mode: str = "eager",
    warmup: int = 2,
    fp8: bool = False,
    attention: str = "torch",
    expert_kernel: str = "dequantize",
) -> dict:
    """Median seconds of a decode step of `rows` live rows over `context` cached positions, split into the layers
    and the rest (module docstring; a graphed step is one replay, not split)."""
    device = str(model.device)
    step_fn, last, seeds, counts = decode_setup(model, rows, context, steps + warmup, mode, fp8, attention)
    clock = Clock(device)
    hooks = layer_clock(model, clock) if mode != "graphed" else []
    step_seconds, layer_seconds = [], []
    try:
        for step in range(steps + warmup):
            clock.mark()
            last, _ = step_fn(last, seeds, counts, context + step + 1)
            counts += 1
            (last == 0).tolist()  # the engine's loop reads the finish flags on the host every step
            clock.mark()
            spans = clock.spans()  # [pre, layer 0, between, layer 1, ..., post]
            if step >= warmup:
                step_seconds.append(sum(spans))
                layer_seconds.append(spans[1::2])
    finally:
        for h in hooks:
            h.remove()
    median = statistics.median(step_seconds)
    per_layer = [statistics.median(column) for column in zip(*layer_seconds)]
    return {
        "mode": mode,
        "kv_cache": "fp8" if fp8 else "auto",
        "attention": attention,
        "expert_kernel": expert_kernel,
        "rows": rows,
        "context": context,
        "step_ms": round(1000 * median, 3),
        "layer_ms": [round(1000 * s, 3) for s in per_layer],
        "rest_ms": round(1000 * (median - sum(per_layer)), 3),
        "tokens_per_s": round(rows / median, 1),
    }


def decode_model(ckpt: Path, name: str, device: str):
    """The checkpoint loaded by the trainer's loader in plan `name` (bf16 on a GPU, float32 on the CPU), LoRA rank 16
    on the 671B config's targets (grouped_mm on CUDA) with seeded factors, the MLA decode installed, in eval mode."""
    from moe_lora.lora import LoRAConfig, attach_lora, seeded_init_

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = load_frozen_model(ckpt, PLANS[name], progress=False, device=device, compute_dtype=dtype)
    kernel = "grouped_mm" if device.startswith("cuda") else "loop"
    attach_lora(model, LoRAConfig(16, 32.0, TARGETS, expert_kernel=kernel))
    seeded_init_(model, 0)
    install_mla_decode(model)
    return model.eval()


def measure_plan(
    ckpt: Path,
    name: str,
    rows: list[int],
    contexts: list[int],
    steps: int,
    device: str,
    bandwidth,
    modes=("eager",),
    kv_caches=("auto",),
    attentions=("torch",),
    expert_kernels=("dequantize",),
    attention_blocks=(KernelBlocks(),),
    expert_cuts=(ExpertBlocks(),),
    fp8_linear_kernels=("dequantize",),
):
    memory = Memory(device)
    free(memory)
    model = decode_model(ckpt, name, device)
    dtype = model.dtype
    element = torch.tensor([], dtype=dtype).element_size()
    cases = []
    for r in rows:
        for c in contexts:
            variants = [
                (m, k, a, x, b, e, f)
                for m in modes
                for k in kv_caches
                for a in attentions
                for x in expert_kernels
                for b in (attention_blocks if a == "triton" else (None,))  # the cuts are the latent kernel's
                for e in (expert_cuts if x == "triton" else (None,))  # and the NF4 expert kernel's
                for f in fp8_linear_kernels
            ]
            for mode, kv, attention, experts, blocks, cut, linears in variants:
                if experts == "triton" and mode == "eager":
                    continue  # the kernel is the fixed-shape step's
                free(memory)
                use_expert_kernel(model, experts)
                labels = {"expert_kernel": experts} | ({"blocks": cuts_name(blocks)} if blocks else {})
                labels |= {"expert_blocks": cuts_name(cut)} if cut else {}
                labels |= {"fp8_linear_kernel": linears} if linears != "dequantize" else {}
                try:
                    with (
                        kernel_blocks(blocks or KernelBlocks()),
                        expert_blocks(cut or ExpertBlocks()),
                        fp8_gemm_linears(linears == "scaled_mm"),
                    ):
                        case = decode_steps(model, r, c, steps, mode, fp8=kv == "fp8", attention=attention)
                    case |= labels
                except torch.OutOfMemoryError as e:
                    oom = {"mode": mode, "kv_cache": kv, "attention": attention} | labels
                    oom |= {"rows": r, "context": c}
                    oom["oom"] = str(e).split("\n")[0][:200]
                    cases.append(oom)
                    print(format_case(name, cases[-1]), flush=True)
                    continue
                touched = weight_bytes_touched(model, r) + kv_bytes_read(model.config, r, c, element, kv == "fp8")
                case["bytes_read"] = touched
                case["roofline_ms"] = round(1000 * touched / bandwidth, 3)
                case["over_roofline"] = round(case["step_ms"] / case["roofline_ms"], 2)
                cases.append(case)
                print(format_case(name, case), flush=True)
    del model
    free(memory)
    return {"plan": name, "compute_dtype": str(dtype).replace("torch.", ""), "cases": cases}


def cuts_name(cuts) -> str:
    """A kernel's cuts (KernelBlocks, ExpertBlocks) as its fields joined by x: 64x32x8 (--attention-blocks),
    64x64x4x3x16 (--expert-blocks)."""
    return "x".join(str(v) for v in dataclasses.astuple(cuts))


def cuts_of(text: str, kind, flag: str) -> list:
    """`flag` CUTSxCUTS...[,...]: each item the fields of `kind` (a dataclass that refuses what its kernel cannot run)."""
    fields = [f.name.upper() for f in dataclasses.fields(kind)]
    try:
        items = [[int(v) for v in item.split("x")] for item in text.split(",")]
        if any(len(item) != len(fields) for item in items):
            raise ValueError(f"{len(fields)} numbers each")
        return [kind(*item) for item in items]
    except ValueError as e:
        raise SystemExit(f"{flag}: use {'x'.join(fields)}[,...], got {text!r} ({e})") from None


def format_case(plan: str, case: dict) -> str:
    attention = case.get("attention", "torch") + (f"[{case['blocks']}]" if "blocks" in case else "")
    experts = case.get("expert_kernel", "dequantize") + (
        f"[{case['expert_blocks']}]" if "expert_blocks" in case else ""
    )
    linears = "fp8-gemm " if case.get("fp8_linear_kernel") == "scaled_mm" else ""
    head = (
        f"{plan:4} {case.get('mode', 'eager'):7} {case.get('kv_cache', 'auto'):4} {attention:6} "
        f"{experts:10} {linears}"
        f"rows {case['rows']:4} context {case['context']:6}"
    )
    if "oom" in case:
        return f"{head}: out of memory"
    layers = " + ".join(f"{ms:.2f}" for ms in case["layer_ms"]) or "one replay"
    return (
        f"{head}: step {case['step_ms']:8.2f} ms "
        f"(layers {layers}, rest {case['rest_ms']:.2f}), {case['tokens_per_s']:9.1f} tok/s, "
        f"roofline {case['roofline_ms']:7.2f} ms ({case['over_roofline']}x)"
    )


def ints(text: str, flag: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if min(values) < 1:
        raise SystemExit(f"{flag}: every value must be at least 1, got {text!r}")
    return values


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default="nf4,fp8")
    ap.add_argument("--rows", default="32,64,128,256")
    ap.add_argument("--contexts", default="1024,8192,20480")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ckpt", default="/tmp/v3-two-layers-decode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copy-bytes", type=int, default=2**31, help="bytes of the bandwidth-measuring copy")
    ap.add_argument("--shape", default=None, help="JSON overrides of the shape (a small one for a CPU run)")
    ap.add_argument("--modes", default="eager", help=f"decode steps to time, of {', '.join(MODES)}")
    ap.add_argument("--kv-cache", default="auto", help="the slots' latent: auto (compute dtype), fp8, or both")
    ap.add_argument("--attention", default="torch", help="rollout.attention_kernel: torch, triton, or both")
    ap.add_argument(
        "--expert-kernel",
        default="dequantize",
        help="rollout.frozen_expert_kernel (fixed and graphed steps): dequantize, triton, or both",
    )
    ap.add_argument(
        "--attention-blocks",
        default=cuts_name(KernelBlocks()),
        help="the latent kernel's heads per program, positions per block and warps to time, HxNxW[,HxNxW...]",
    )
    ap.add_argument(
        "--expert-blocks",
        default=cuts_name(ExpertBlocks()),
        help="the NF4 expert kernel's columns a program, depth a step, warps, stages and rows a pass, NxKxWxSxM[,...]",
    )
    ap.add_argument(
        "--fp8-linear-kernel",
        default="dequantize",
        help="rollout.fp8_linear_kernel: dequantize, scaled_mm (FP8 GEMMs for the FP8 linears), or both",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    attention_blocks = cuts_of(args.attention_blocks, KernelBlocks, "--attention-blocks")
    expert_cuts = cuts_of(args.expert_blocks, ExpertBlocks, "--expert-blocks")
    modes, kv_caches, attentions = args.modes.split(","), args.kv_cache.split(","), args.attention.split(",")
    expert_kernels = args.expert_kernel.split(",")
    if any(x not in ("dequantize", "triton") for x in expert_kernels):
        raise SystemExit(f"--expert-kernel: use dequantize, triton or dequantize,triton, got {args.expert_kernel!r}")
    fp8_linear_kernels = args.fp8_linear_kernel.split(",")
    if any(f not in ("dequantize", "scaled_mm") for f in fp8_linear_kernels):
        raise SystemExit(f"--fp8-linear-kernel: use dequantize, scaled_mm or both, got {args.fp8_linear_kernel!r}")
    if any(a not in ("torch", "triton") for a in attentions):
        raise SystemExit(f"--attention: use torch, triton or torch,triton, got {args.attention!r}")
    if any(k not in ("auto", "fp8") for k in kv_caches):
        raise SystemExit(f"--kv-cache: use auto, fp8 or auto,fp8, got {args.kv_cache!r}")
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: unknown mode in {args.modes!r}; known: {', '.join(MODES)}")
    if "triton" in attentions + expert_kernels and not args.device.startswith("cuda"):
        from quant.fused_experts import interpreted

        if not interpreted():
            raise SystemExit("--attention/--expert-kernel triton: Triton needs --device cuda (or TRITON_INTERPRET=1)")
    if "graphed" in modes and not args.device.startswith("cuda"):
        raise SystemExit("--modes graphed: CUDA graphs need --device cuda")
    rows, contexts = ints(args.rows, "--rows"), ints(args.contexts, "--contexts")
    if args.steps < 1:
        raise SystemExit(f"--steps: must be at least 1, got {args.steps}")
    unknown = [p for p in args.plans.split(",") if p not in PLANS]
    if unknown:
        raise SystemExit(f"--plans: unknown plan {unknown[0]!r}; known: {', '.join(PLANS)}")
    shape = {**REAL_V3_TWO_LAYERS, **(json.loads(args.shape) if args.shape else {})}
    config = v3_config(shape, max(contexts) + args.steps + 3)
    t0 = time.perf_counter()
    ckpt = write_checkpoint(Path(args.ckpt), config, args.device)
    bandwidth = copy_bandwidth(args.device, args.copy_bytes)
    out = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": shape,
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "write_seconds": round(time.perf_counter() - t0, 1),
        "plans": [],
    }
    print(f"checkpoint {ckpt}; copy bandwidth {out['copy_bandwidth_GBps']} GB/s", flush=True)
    for name in args.plans.split(","):
        out["plans"].append(
            measure_plan(
                ckpt,
                name,
                rows,
                contexts,
                args.steps,
                args.device,
                bandwidth,
                modes,
                kv_caches,
                attentions,
                expert_kernels,
                attention_blocks,
                expert_cuts,
                fp8_linear_kernels,
            )
        )
        if args.json:
            atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
