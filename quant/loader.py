"""Streaming loader: a sharded DeepSeek-V3 checkpoint (bf16 or FP8) -> frozen model in per-group formats.

    plan = QuantPlan(routed_experts="nf4")
    model = load_frozen_model("ckpt/", plan)
    print(format_byte_report(byte_report(model)))

Steps: (1) validate config.json, the index and every shard's header against the layout the config
implies (nothing loaded yet, so bad input fails fast and names file and tensor); (2) build the
transformers model on the meta device and swap its linears/experts for frozen quantized modules;
(3) read one shard at a time, convert each tensor to its target format and place it. The checkpoint is
never held in bf16 as a whole: at most one shard is mapped and one tensor is dequantized at a time.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from quant.checkpoint_io import CheckpointError, read_config, read_weight_map
from quant.formats import QuantizedWeight, check_format, checkpoint_weight
from quant.layout import (
    FP8_BLOCK,
    QUANTIZABLE_GROUPS,
    SCALE_SUFFIX,
    TensorSpec,
    expected_tensors,
    fp8_scale_shape,
    is_moe_layer,
    parse_expert_key,
    scale_key,
)
from quant.modules import FrozenExperts, FrozenLinear

FLOAT_DTYPES = {"BF16", "F16", "F32"}
FP8_DTYPE_NAME = "F8_E4M3"
REQUIRED_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
)


@dataclass(frozen=True)
class QuantPlan:
    """Format of each quantizable module group; embeddings, norms, router and lm_head stay as stored."""

    routed_experts: str = "nf4"
    shared_experts: str = "bf16"
    attention: str = "bf16"
    dense_mlp: str = "bf16"
    double_quant: bool = False  # nf4 only: quantize the absmax statistics too (~0.5 -> 0.51 bytes/param)

    def __post_init__(self):
        for f in fields(self):
            if f.name in QUANTIZABLE_GROUPS:
                check_format(getattr(self, f.name), where=f"quant.{f.name}")

    @classmethod
    def uniform(cls, fmt: str, double_quant: bool = False) -> "QuantPlan":
        return cls(fmt, fmt, fmt, fmt, double_quant)

    def format_of(self, group: str) -> str:
        return getattr(self, group)


@dataclass(frozen=True)
class CheckpointPlan:
    """What validation learned: shard files in load order, tensors per shard, and whether it is FP8."""

    directory: Path
    config: dict
    shards: list[str]
    keys_by_shard: dict[str, list[str]]
    specs: dict[str, TensorSpec]
    fp8: bool
    largest_shard_bytes: int


# ------------------------------------------------------------------------------------------ validation
def _check_config(config: dict, path: Path) -> bool:
    """Returns whether the checkpoint is FP8; raises on keys that are missing or not DeepSeek-V3's."""
    if config.get("model_type") != "deepseek_v3":
        raise CheckpointError(f"{path}: model_type is {config.get('model_type')!r}, expected 'deepseek_v3'")
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in config]
    if missing:
        raise CheckpointError(f"{path}: missing keys {missing}")
    qc = config.get("quantization_config")
    if qc is None:
        return False
    if qc.get("quant_method") != "fp8":
        raise CheckpointError(
            f"{path}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported (only 'fp8')"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{path}: quantization_config.fmt {qc.get('fmt')!r} is not supported (only 'e4m3')")
    if list(qc.get("weight_block_size", [])) != [FP8_BLOCK, FP8_BLOCK]:
        raise CheckpointError(
            f"{path}: quantization_config.weight_block_size is {qc.get('weight_block_size')}, "
            f"only [{FP8_BLOCK}, {FP8_BLOCK}] block scales are supported"
        )
    return True


def _is_mtp_key(key: str, num_layers: int) -> bool:
    """DeepSeek-V3 ships its multi-token-prediction module as layer `num_hidden_layers`; RL never uses it."""
    parts = key.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def _expected_dtype(key: str, spec: TensorSpec | None, fp8: bool) -> set[str]:
    if spec is None:  # a scale
        return {"F32"}
    if fp8 and spec.quantizable:
        return {FP8_DTYPE_NAME}
    return FLOAT_DTYPES


def validate_checkpoint(checkpoint: str | os.PathLike) -> CheckpointPlan:
    """Check config, index and every shard header; raise CheckpointError naming the file and tensor."""
    from safetensors import safe_open

    directory = Path(checkpoint)
    config = read_config(directory)
    fp8 = _check_config(config, directory / "config.json")
    specs = expected_tensors(config)
    weight_map = {
        k: f for k, f in read_weight_map(directory).items() if not _is_mtp_key(k, config["num_hidden_layers"])
    }

    wanted = dict(specs)
    if fp8:
        wanted.update({scale_key(k): None for k, s in specs.items() if s.quantizable})
    missing = [k for k in wanted if k not in weight_map]
    if missing:
        raise CheckpointError(
            f"{directory}: the index names no shard for {len(missing)} tensor(s) the config implies, e.g. {missing[0]!r}"
        )
    unexpected = [k for k in weight_map if k not in wanted]
    if unexpected:
        raise CheckpointError(
            f"{directory}: tensor {unexpected[0]!r} (shard {weight_map[unexpected[0]]}) is not part of the "
            f"DeepSeek-V3 layout that config.json describes ({len(unexpected)} such tensors)"
        )

    keys_by_shard: dict[str, list[str]] = defaultdict(list)
    for key, shard in weight_map.items():
        keys_by_shard[shard].append(key)
    largest = 0
    for shard, keys in keys_by_shard.items():
        path = directory / shard
        if not path.exists():
            raise CheckpointError(
                f"{path}: shard file missing (the index places {len(keys)} tensors there, e.g. {keys[0]!r})"
            )
        largest = max(largest, path.stat().st_size)
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise CheckpointError(f"{path}: the index says tensor {key!r} is in this shard, but it is not")
                sl = f.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                spec = specs.get(key)
                want_shape = (
                    spec.shape
                    if spec is not None
                    else fp8_scale_shape(specs[key[: -len(SCALE_SUFFIX)] + ".weight"].shape)
                )
                if shape != want_shape:
                    what = "config.json implies" if spec is not None else f"{FP8_BLOCK}x{FP8_BLOCK} blocks imply"
                    raise CheckpointError(f"{path}: tensor {key!r} has shape {list(shape)}, {what} {list(want_shape)}")
                allowed = _expected_dtype(key, spec, fp8)
                if dtype not in allowed:
                    raise CheckpointError(
                        f"{path}: tensor {key!r} has dtype {dtype}, expected {' or '.join(sorted(allowed))}"
                    )
    shards = sorted(keys_by_shard)
    return CheckpointPlan(directory, config, shards, dict(keys_by_shard), specs, fp8, largest)


# ------------------------------------------------------------------------------------------ skeleton
def hf_config(config: dict):
    """transformers' DeepseekV3Config for the frozen model (the FP8 quantization_config is ours to apply)."""
    from transformers import DeepseekV3Config

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    hf = DeepseekV3Config(**cfg)
    hf._attn_implementation = "sdpa"
    return hf


def _module_path(key: str) -> str:
    return key.rsplit(".", 1)[0]


def build_skeleton(config: dict, specs: dict[str, TensorSpec], experts: range | None = None) -> nn.Module:
    """transformers' DeepseekV3ForCausalLM on the meta device with frozen modules in place of linears/experts
    (routed experts `experts` only, all of them when None)."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf_config(config))
    for key, spec in specs.items():
        if spec.quantizable and spec.group != "routed_experts":
            out_f, in_f = spec.shape
            model.set_submodule(_module_path(key), FrozenLinear(spec.group, in_f, out_f))
    for layer in range(config["num_hidden_layers"]):
        if is_moe_layer(config, layer):
            held = experts if experts is not None else range(config["n_routed_experts"])
            module = FrozenExperts(
                len(held), config["hidden_size"], config["moe_intermediate_size"], first_expert=held.start
            )
            model.set_submodule(f"model.layers.{layer}.mlp.experts", module)
    return model


def expert_of(key: str) -> int | None:
    """The routed expert a checkpoint key (weight or FP8 scale) belongs to, else None."""
    parsed = parse_expert_key(key[: -len(SCALE_SUFFIX)] + ".weight" if key.endswith(SCALE_SUFFIX) else key)
    return None if parsed is None else parsed[1]


def _place_kept_tensor(model: nn.Module, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Embeddings, norms, router, lm_head: unquantized, in the compute dtype (router bias float32).

    Always a copy: a tensor read from a shard may share the shard's memory map, and keeping it would
    keep the whole shard resident.
    """
    module = model.get_submodule(_module_path(key))
    name = key.rsplit(".", 1)[1]
    dtype = torch.float32 if name == "e_score_correction_bias" else dtype
    if name in module._buffers:
        module._buffers[name] = tensor.to(dtype, copy=True)
    else:
        module._parameters[name] = nn.Parameter(tensor.to(dtype, copy=True), requires_grad=False)


def _finalize(model: nn.Module, config: dict, directory: Path, device: str | torch.device = "cpu") -> nn.Module:
    from transformers import GenerationConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    model.model.rotary_emb = DeepseekV3RotaryEmbedding(model.config).to(device)  # computed, not stored
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise CheckpointError(f"{directory}: tensor {name!r} was never loaded")
    if (directory / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model.requires_grad_(False)
    return model.eval()


# ------------------------------------------------------------------------------------------ loading
def load_frozen_model(
    checkpoint: str | os.PathLike,
    plan: QuantPlan = QuantPlan(),
    compute_dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    experts: range | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Validate, then stream the checkpoint shard by shard into a frozen model in `plan`'s formats.

    compute_dtype: dtype of activations and of the unquantized tensors (bf16 as DeepSeek-V3 runs;
    float32 for exact comparisons). Quantized weights are dequantized to it on the fly.
    experts: the routed experts this process holds (expert parallelism); the others' tensors are never
    read. `model.checkpoint_bytes_read` is the number of tensor bytes read from the shards,
    `model.checkpoint_expert_bytes_read` the routed experts' share of it.
    device: where every tensor goes; safetensors reads each one straight onto it, one tensor at a time.
    """
    from safetensors import safe_open

    ckpt = validate_checkpoint(checkpoint)
    model = build_skeleton(ckpt.config, ckpt.specs, experts)
    if experts is not None:
        n = ckpt.config["n_routed_experts"]
        if not (0 <= experts.start < experts.stop <= n and experts.step == 1):
            raise ValueError(f"experts {experts} is not a block of the {n} routed experts of {ckpt.directory}")
    bytes_read = expert_bytes_read = 0
    pending_fp8: dict[str, torch.Tensor] = {}  # weights or scales whose partner lives in a later shard
    total = sum(len(v) for v in ckpt.keys_by_shard.values())
    bar = tqdm(total=total, desc="loading frozen weights", unit="tensor", disable=not progress)

    def place_quantized(key: str, weight: QuantizedWeight) -> None:
        parsed = parse_expert_key(key)
        if parsed is not None:
            layer, expert, projection = parsed
            module = model.get_submodule(f"model.layers.{layer}.mlp.experts")
            module.set_weight(expert - module.first_expert, projection, weight)
        else:
            model.get_submodule(_module_path(key)).weight_q = weight

    for shard in ckpt.shards:
        with safe_open(str(ckpt.directory / shard), framework="pt", device=str(device)) as f:
            for key in ckpt.keys_by_shard[shard]:
                bar.update(1)
                expert = expert_of(key)
                if experts is not None and expert is not None and expert not in experts:
                    continue  # another rank's expert: not read
                tensor = f.get_tensor(key)
                bytes_read += tensor.numel() * tensor.element_size()
                expert_bytes_read += tensor.numel() * tensor.element_size() if expert is not None else 0
                if key.endswith(SCALE_SUFFIX):
                    weight_key = key[: -len(SCALE_SUFFIX)] + ".weight"
                    if weight_key not in pending_fp8:
                        pending_fp8[key] = tensor
                        continue
                    key, tensor, scale = weight_key, pending_fp8.pop(weight_key), tensor
                elif not ckpt.specs[key].quantizable:
                    _place_kept_tensor(model, key, tensor, compute_dtype)
                    continue
                elif ckpt.fp8:
                    if scale_key(key) not in pending_fp8:
                        pending_fp8[key] = tensor
                        continue
                    scale = pending_fp8.pop(scale_key(key))
                else:
                    scale = None
                fmt = plan.format_of(ckpt.specs[key].group)
                place_quantized(key, checkpoint_weight(tensor, scale, fmt, plan.double_quant))
                del tensor, scale
    bar.close()
    if pending_fp8:
        raise CheckpointError(f"{ckpt.directory}: FP8 tensor {next(iter(pending_fp8))!r} has no matching weight/scale")
    model = _finalize(model, ckpt.config, ckpt.directory, device)
    model.checkpoint_bytes_read, model.checkpoint_expert_bytes_read = bytes_read, expert_bytes_read
    return model


# ------------------------------------------------------------------------------------------ bytes
@dataclass(frozen=True)
class ByteRow:
    group: str
    format: str
    params: int
    bytes: int

    @property
    def bytes_per_param(self) -> float:
        return self.bytes / max(self.params, 1)


_KEPT_GROUP_BY_PREFIX = (("model.embed_tokens", "embed"), ("lm_head", "lm_head"), ("mlp.gate.", "router"))


def _kept_group(name: str) -> str:
    for needle, group in _KEPT_GROUP_BY_PREFIX:
        if needle in name:
            return group
    return "norm"


def byte_report(model: nn.Module) -> list[ByteRow]:
    """Parameters and bytes per (module group, format), frozen quantized weights and kept tensors alike."""
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(group: str, fmt: str, params: int, nbytes: int) -> None:
        acc[(group, fmt)][0] += params
        acc[(group, fmt)][1] += nbytes

    for module in model.modules():
        if isinstance(module, FrozenLinear):
            add(module.group, module.weight_q.fmt, module.weight_q.numel, module.weight_q.nbytes)
        elif isinstance(module, FrozenExperts):
            for weights in module.weights.values():
                for w in weights:
                    add(module.group, w.fmt, w.numel, w.nbytes)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "rotary_emb" in name or "lora_" in name:
            continue
        add(_kept_group(name), str(t.dtype).replace("torch.", ""), t.numel(), t.numel() * t.element_size())
    order = {
        g: i
        for i, g in enumerate(
            ("routed_experts", "shared_experts", "attention", "dense_mlp", "embed", "lm_head", "router", "norm")
        )
    }
    return sorted(
        (ByteRow(g, f, p, b) for (g, f), (p, b) in acc.items()), key=lambda r: (order.get(r.group, 99), r.format)
    )


def format_byte_report(rows: list[ByteRow]) -> str:
    lines = [f"{'group':<16}{'format':<10}{'params':>14}{'bytes':>16}{'bytes/param':>13}"]
    for r in rows:
        lines.append(f"{r.group:<16}{r.format:<10}{r.params:>14,}{r.bytes:>16,}{r.bytes_per_param:>13.3f}")
    params, nbytes = sum(r.params for r in rows), sum(r.bytes for r in rows)
    lines.append(f"{'total':<26}{params:>14,}{nbytes:>16,}{nbytes / max(params, 1):>13.3f}")
    return "\n".join(lines)
