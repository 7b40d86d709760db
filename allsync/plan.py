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
DeepSeek-V3 layers on an H200 (benchmarks/measured/v3_layer_memory_h200.json, BENCHMARKS.md). Not modelled yet:
activations, the rollout engine's own weights and KV cache, and the step time.
"""

from __future__ import annotations

from collections import defaultdict

from quant.layout import FP8_BLOCK, expected_tensors, is_moe_layer, parse_expert_key
from quant.loader import QuantPlan

NF4_BLOCK = 64
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
LORA_VALUE_BYTES = 4  # LoRAConfig.dtype: A and B in float32
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
        blocks = -(-n // NF4_BLOCK)
        absmax = blocks + 4 * -(-blocks // 256) + 4 if double_quant else 4 * blocks
        return -(-n // 2) + absmax
    if fmt == "int8":
        return n + 4 * out_dim
    raise ValueError(f"unknown format {fmt!r}")


def frozen_bytes(config: dict, plan: QuantPlan, compute_dtype: str = "bfloat16", experts: range | None = None) -> dict:
    """Bytes of the frozen model a worker holds, per group: routed_experts, shared_experts, attention, dense_mlp
    (in their formats), embeddings (embed + lm_head) and norms_and_router (compute dtype; the router's bias float32).
    experts: the routed experts this worker holds (None: all)."""
    out: dict[str, int] = defaultdict(int)
    for key, spec in expected_tensors(config).items():
        parsed = parse_expert_key(key)
        if parsed is not None and experts is not None and parsed[1] not in experts:
            continue
        if spec.quantizable:
            out[spec.group] += weight_bytes(spec.shape, plan.format_of(spec.group), plan.double_quant)
            continue
        numel = 1
        for d in spec.shape:
            numel *= d
        value_bytes = 4 if key.endswith("e_score_correction_bias") else DTYPE_BYTES[compute_dtype]
        out[KEPT_GROUPS.get(spec.group, "norms_and_router")] += numel * value_bytes
    return dict(out)


def lora_values(config: dict, rank: int, targets: tuple[str, ...], experts_held: int | None = None) -> int:
    """LoRA values (A and B) a worker holds: r (in + out) per adapted weight; routed experts for the experts held."""
    total = 0
    for key, spec in expected_tensors(config).items():
        if not spec.quantizable:
            continue
        target = key.rsplit(".", 2)[-2] if spec.group == "attention" else spec.group
        if target not in targets:
            continue
        parsed = parse_expert_key(key)
        if parsed is not None and experts_held is not None and parsed[1] >= experts_held:
            continue  # every worker holds experts_held experts of each layer: count the first experts_held
        total += rank * (spec.shape[0] + spec.shape[1])
    return total


def worker_bytes(run, model_config: dict) -> dict[str, int]:
    """Per worker of `run` (a RunConfig) on the checkpoint `model_config`: the frozen groups, `lora`, `lora_grads`
    and `optimizer` (AdamW), in bytes. With parallel.expert_parallel = k each worker holds n_routed_experts / k."""
    ep = run.parallel.expert_parallel
    held = (
        model_config["n_routed_experts"] // ep
        if any(is_moe_layer(model_config, layer) for layer in range(model_config["num_hidden_layers"]))
        else None
    )
    experts = range(held) if held is not None and ep > 1 else None
    out = frozen_bytes(model_config, run.model.quant.plan(), run.model.compute_dtype, experts)
    values = lora_values(model_config, run.lora.rank, tuple(run.lora.targets), held if ep > 1 else None)
    out.update(
        lora=values * LORA_VALUE_BYTES, lora_grads=values * LORA_VALUE_BYTES, optimizer=2 * values * LORA_VALUE_BYTES
    )
    return out
