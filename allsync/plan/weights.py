"""What one worker holds in memory for a run, computed from the checkpoint's config.json (issue 25, first part).

The tensors come from the loader's own layout (`quant.layout.expected_tensors`), the formats from the run's
`model.quant`, the experts a worker holds from its expert-parallel layout, so the plan and the loader cannot
disagree on what exists. Bytes per tensor, as `QuantizedWeight.nbytes` and the loader count them:

    frozen weight [out, in]  bf16  2 out in
                             fp8   out in + 4 ceil(out / 128) ceil(in / 128)            (e4m3 + float32 block scales)
                             nf4   ceil(out in / 2) + 4 ceil(out in / 64)                (packed + float32 absmax)
                                   with double_quant: ceil(out in / 2) + n + 4 ceil(n / 256) + 4, n = ceil(out in / 64)
                             int8  out in + 4 out                                        (row absmax)
    kept tensors             embeddings, lm_head, norms, router in model.compute_dtype; the router's bias float32
    LoRA on [out, in]        r (in + out) values in float32; routed experts: per expert held, per projection
    gradients                as many float32 values as LoRA; AdamW state: two (exp_avg, exp_avg_sq)

Checked against measurement: the tiny configs' loaded models (tests/allsync/test_plan.py) and two real-size
DeepSeek-V3 layers on an H200 (benchmarks/measured/v3_layer_memory_h200.json, BENCHMARKS.md). The activations, the
engine's KV cache and the verdict are in activations.py and fit.py.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from quant.formats import NF4_BLOCKSIZE
from quant.layout import FP8_BLOCK, TensorSpec, expected_tensors, parse_expert_key
from quant.loader import QuantPlan

LORA_VALUE_BYTES = torch.float32.itemsize  # LoRAConfig.dtype: A and B in float32
FROZEN_PARTS = ("routed_experts", "shared_experts", "attention", "dense_mlp", "embeddings", "norms_and_router")
KEPT_GROUPS = {"embed": "embeddings", "lm_head": "embeddings", "norm": "norms_and_router", "router": "norms_and_router"}


def weight_bytes(shape: tuple[int, int], fmt: str, double_quant: bool = False) -> int:
    """Bytes of one frozen [out, in] weight in `fmt` (formulas in the module docstring)."""
    out_dim, in_dim = shape
    n = out_dim * in_dim
    if fmt == "bf16":
        return 2 * n
    if fmt == "fp8":
        return n + 4 * -(-out_dim // FP8_BLOCK) * -(-in_dim // FP8_BLOCK)
    if fmt == "nf4":
        blocks = -(-n // NF4_BLOCKSIZE)
        absmax = blocks + 4 * -(-blocks // 256) + 4 if double_quant else 4 * blocks
        return -(-n // 2) + absmax
    if fmt == "int8":
        return n + 4 * out_dim
    raise ValueError(f"unknown format {fmt!r}")


def lora_target(key: str, spec: TensorSpec) -> str:
    """The lora.targets name of a checkpoint weight: attention weights by their projection, the rest by group."""
    return key.rsplit(".", 2)[-2] if spec.group == "attention" else spec.group


@dataclass(frozen=True)
class TensorKind:
    """What the byte counts need of a checkpoint tensor; tensors alike are counted together."""

    group: str
    shape: tuple[int, ...]
    quantizable: bool
    target: str  # lora_target
    float32: bool  # kept in float32 whatever the compute dtype (the router's bias)
    routed: bool  # one of a routed expert's tensors (held only by the workers holding that expert)
    projection: str | None = None  # a routed expert's gate, up or down


@functools.lru_cache(maxsize=32)
def _tensor_kinds(config_json: str) -> tuple[tuple[TensorKind, int], ...]:
    """Every tensor of expected_tensors(config) by kind, with its count; a routed kind's count is per expert. Cached:
    the 671B checkpoint has 1.4M tensor keys and a plan search asks for them many times."""
    config = json.loads(config_json)
    counts: Counter = Counter()
    for key, spec in expected_tensors(config).items():
        expert = parse_expert_key(key)
        kind = TensorKind(
            spec.group,
            tuple(spec.shape),
            spec.quantizable,
            lora_target(key, spec),
            key.endswith("e_score_correction_bias"),
            expert is not None,
            expert[2] if expert is not None else None,
        )
        counts[kind] += 1
    experts = config.get("n_routed_experts") or 1
    return tuple((kind, n // experts if kind.routed else n) for kind, n in counts.items())


def tensor_kinds(config: dict, experts: range | None = None) -> list[tuple[TensorKind, int]]:
    """(kind, how many such tensors a worker holding routed experts `experts` (None: all) holds)."""
    total = config.get("n_routed_experts") or 0
    held_count = total if experts is None else sum(1 for e in experts if 0 <= e < total)
    return [
        (kind, n * held_count if kind.routed else n)
        for kind, n in _tensor_kinds(json.dumps(config, sort_keys=True, default=str))
    ]


def frozen_bytes(config: dict, plan: QuantPlan, compute_dtype: str = "bfloat16", experts: range | None = None) -> dict:
    """Bytes of the frozen model a worker holds, per group: routed_experts, shared_experts, attention, dense_mlp
    (in their formats), embeddings (embed + lm_head) and norms_and_router (compute dtype; the router's bias float32).
    experts: the routed experts this worker holds (None: all)."""
    out: dict[str, int] = defaultdict(int)
    for kind, n in tensor_kinds(config, experts):
        if not n:
            continue
        if kind.quantizable:
            out[kind.group] += n * weight_bytes(kind.shape, plan.format_of(kind.group), plan.double_quant)
            continue
        value_bytes = (torch.float32 if kind.float32 else getattr(torch, compute_dtype)).itemsize
        out[KEPT_GROUPS.get(kind.group, "norms_and_router")] += n * math.prod(kind.shape) * value_bytes
    return dict(out)


def dequantized_values(config: dict, plan: QuantPlan, experts: range | None = None) -> tuple[int, int]:
    """(routed, other): how many values of quantized weights (any format but bf16) a worker holding routed experts
    `experts` (None: all) holds, the routed experts' apart: what a dequantize-then-multiply forward (quant.formats.
    frozen_linear, quant.fixed_shape_experts.dequantized) writes in the compute dtype and reads back at every call."""
    routed = other = 0
    for kind, n in tensor_kinds(config, experts):
        if n and kind.quantizable and plan.format_of(kind.group) != "bf16":
            if kind.routed:
                routed += n * math.prod(kind.shape)
            else:
                other += n * math.prod(kind.shape)
    return routed, other


def fp8_gemm_values(config: dict, plan: QuantPlan) -> int:
    """Values of the frozen weights the torch engine multiplies as FP8 GEMMs with rollout.fp8_linear_kernel scaled_mm
    (quant.formats.fp8_gemm on FP8 tensor cores), read as stored instead of dequantized: every non-routed FP8 weight
    of whole 128 x 128 blocks but kv_b_proj (whose W_UK and W_UV the latent decode absorbs, dequantized:
    moe_lora.mla_decode). DeepSeek-V3: q_a, q_b, o_proj, the dense MLP and the shared experts, 13.9 of its 15.2
    billion non-routed FP8 values (kv_b_proj 1.0, kv_a_proj_with_mqa's 576 rows are not whole blocks)."""
    return sum(
        n * math.prod(kind.shape)
        for kind, n in tensor_kinds(config)
        if n
        and kind.quantizable
        and not kind.routed
        and kind.target != "kv_b_proj"
        and plan.format_of(kind.group) == "fp8"
        and all(d % FP8_BLOCK == 0 for d in kind.shape)
    )


def lora_values(
    config: dict, rank: int, targets: tuple[str, ...], experts: range | None = None, expert_layout: str = "per_expert"
) -> int:
    """LoRA values (A and B) a worker holds: r (in + out) per adapted weight; routed experts only those in `experts`,
    in `expert_layout` (routed_lora_values)."""
    plain = sum(
        n * rank * (kind.shape[0] + kind.shape[1])
        for kind, n in tensor_kinds(config, experts)
        if kind.quantizable and kind.target in targets and not kind.routed
    )
    if "routed_experts" not in targets:
        return plain
    return plain + sum(routed_lora_values(config, rank, experts, expert_layout))


def routed_lora_values(config: dict, rank: int, experts: range | None, expert_layout: str) -> tuple[int, int]:
    """(values held per expert, values the layer's experts share) of the routed-expert LoRA of a worker holding
    `experts` (None: all). per_expert: r (in + out) per expert and projection, nothing shared. shared_outer
    (moe_lora.lora_layers): per expert B of gate and up (r x moe_inter each) and A of down (r x moe_inter); once per
    MoE layer, on every worker holding any of its experts, A of gate and up (r x hidden each) and B of down
    (r x hidden)."""
    per_expert = shared = 0
    total = config.get("n_routed_experts") or 0
    held = total if experts is None else sum(1 for e in experts if 0 <= e < total)
    for kind, n in tensor_kinds(config, experts):
        if not (kind.routed and kind.quantizable) or not n:
            continue
        out_f, in_f = kind.shape
        if expert_layout == "per_expert":
            per_expert += n * rank * (out_f + in_f)
            continue
        own, common = (out_f, in_f) if kind.projection in ("gate", "up") else (in_f, out_f)
        per_expert += n * rank * own
        shared += n // held * rank * common
    return per_expert, shared


def held_experts(model_config: dict, expert_parallel: int) -> range | None:
    """The routed experts the busiest GPU holds under expert parallelism (a block of ceil(n_routed_experts / EP), as
    vLLM places experts that do not split evenly; the trainer's EP divides them; None: all)."""
    return range(-(-model_config["n_routed_experts"] // expert_parallel)) if expert_parallel > 1 else None


def stored_plan(model_config: dict) -> QuantPlan:
    """The formats the checkpoint stores its quantizable weights in (what vLLM serves): FP8 blocks or bf16."""
    return QuantPlan.uniform("fp8" if model_config.get("quantization_config") else "bf16")


def trainer_bytes(run, model_config: dict, expert_parallel: int, quant: QuantPlan | None = None) -> dict[str, int]:
    """The trainer's resident bytes per GPU, by part: the frozen groups (in `quant`, default model.quant's formats),
    LoRA, its gradients and AdamW's two moments, with n_routed_experts / expert_parallel experts per GPU."""
    experts = held_experts(model_config, expert_parallel)
    parts = frozen_bytes(model_config, quant or run.model.quant.plan(), run.model.compute_dtype, experts)
    values = lora_values(model_config, run.lora.rank, tuple(run.lora.targets), experts, run.lora.expert_layout)
    per_gpu = {name: parts.get(name, 0) for name in FROZEN_PARTS}
    per_gpu.update(
        lora=values * LORA_VALUE_BYTES, lora_grads=values * LORA_VALUE_BYTES, optimizer=2 * values * LORA_VALUE_BYTES
    )
    return per_gpu


def critic_bytes(run, model_config: dict) -> dict[str, int]:
    """PPO / T-PPO's critic (allsync/update/critic.py) per GPU: its adapter (the policy's rank and targets but the routed
    experts, replicated) and its value head (hidden + 1), with gradients and AdamW's two moments, all float32:
    4 x values x 4 B. {} without a critic."""
    if not run.algorithm.uses_critic:
        return {}
    targets = tuple(t for t in run.lora.targets if t != "routed_experts")
    values = lora_values(model_config, run.lora.rank, targets) + model_config["hidden_size"] + 1
    return {"critic": 4 * values * LORA_VALUE_BYTES}


def graphed_expert_bytes(run, model_config: dict, expert_parallel: int) -> int:
    """The torch engine's fixed-shape decode step (rollout.decode_graphs) dequantizes each MoE layer's held routed
    experts to bf16 stacks (quant.fixed_shape_experts: gate and up [E_held, 2I, H], then down [E_held, H, I]), which
    the graphs' memory pool holds during generation (freed layer by layer, so one layer's at a time):
        held x 3 x hidden x moe_intermediate x 2 B      (DeepSeek-V3 at EP 16: 1.41 GB)
    0 without the graphed step, or with rollout.frozen_expert_kernel triton (the NF4 bytes read in place)."""
    r = run.rollout
    if r.engine != "torch" or not r.decode_graphs or r.frozen_expert_kernel == "triton":
        return 0
    held = model_config["n_routed_experts"] // max(expert_parallel, 1)
    return held * 3 * model_config["hidden_size"] * model_config["moe_intermediate_size"] * 2


def engine_bytes(model_config: dict, expert_parallel: int) -> dict[str, int]:
    """vLLM's own copy of the base per GPU, by group: the checkpoint's tensors as stored, n_routed_experts / EP
    experts."""
    experts = held_experts(model_config, expert_parallel)
    return frozen_bytes(model_config, stored_plan(model_config), "bfloat16", experts)
