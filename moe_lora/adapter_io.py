"""LoRA adapters on disk: PEFT's format in, PEFT/vLLM adapters and merged checkpoints out.

An `Adapter` holds tensors under PEFT's key names in the per-expert layout vLLM serves:
    base_model.model.<module>.lora_A.weight  [r, in]     base_model.model.<module>.lora_B.weight  [out, r]
with <module> e.g. `model.layers.3.self_attn.q_a_proj` or `model.layers.3.mlp.experts.17.down_proj`.
The adapted weight is W + s * B @ A with s = alpha / r (rsLoRA: alpha / sqrt(r)).

lora.expert_layout shared_outer shares A of gate/up and B of down among a layer's experts; the per-expert form
repeats them for every expert (what PEFT and vLLM load). Its compact form (`allsync export --compact`, marked by
adapter_config.json's "allsync_expert_layout": "shared_outer") holds each shared factor once,
    base_model.model.model.layers.L.mlp.experts.shared.{gate,up}_proj.lora_A.weight, ...experts.shared.down_proj.lora_B.weight,
and is expanded on read; a consumer that reads the directory itself (vLLM) is refused it, with the command that
writes the per-expert form.

PEFT's fused `target_parameters` layout (transformers' stacked experts) is converted on read:
    gate_up:  A [E*r, H] -> A_e = A.view(E, r, H)[e];  B [2I, E*r] -> B_e = B.view(2I, r, E)[:, :, e],
              gate gets (A_e, B_e[:I]) and up gets (A_e, B_e[I:]) (the fused weight is cat(gate, up)).
    down:     A [E*r, I], B [H, E*r] the same way.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_lora.lora import EXPERT_FACTOR_KEY, shared_copies, unequal_copy
from moe_lora.lora_layers import SHARED_OUTER
from quant.checkpoint_io import INDEX_NAME, atomic_output_dir, read_config, read_weight_map
from quant.formats import checkpoint_weight, fp8_block_dequantize, fp8_block_quantize
from quant.layout import FP8_QUANTIZATION_CONFIG, SCALE_SUFFIX, expected_tensors, scale_key
from quant.loader import QuantPlan

PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# vLLM's accepted max_lora_rank values (vllm/config/lora.py).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM loads LoRA on kv_b_proj but never applies it (its MLA absorbs kv_b_proj into the attention kernel).
VLLM_IGNORED_TARGETS = ("kv_b_proj",)
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
COMPACT_LAYOUT_KEY = "allsync_expert_layout"  # adapter_config.json: "shared_outer" marks the compact form
_FUSED_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.mlp\.experts(?P<inner>\.base_layer)?\.lora_(?P<ab>[AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter that does not fit its base, or that a consumer (vLLM) would refuse; names key and shapes."""


@dataclass
class Adapter:
    tensors: dict[str, torch.Tensor]
    r: int
    lora_alpha: float
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """s = alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def modules(self) -> list[str]:
        """Adapted module paths (e.g. model.layers.1.mlp.experts.3.gate_proj), sorted."""
        return sorted({m.group("module") for k in self.tensors if (m := _LORA_KEY.match(k))})

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[f"{PREFIX}{module}.lora_A.weight"], self.tensors[f"{PREFIX}{module}.lora_B.weight"]

    def delta(self, module: str) -> torch.Tensor:
        """s * B @ A in float32, [out, in]."""
        a, b = self.pair(module)
        return self.scale * (b.float() @ a.float())


# --------------------------------------------------------------------------------------------- reading
def resolve_adapter_dir(src: str | os.PathLike) -> Path:
    """A PEFT adapter directory, or a training checkpoint holding one in `adapter/`."""
    src = Path(src)
    for candidate in (src, src / "adapter"):
        if (candidate / ADAPTER_CONFIG).exists():
            return candidate
    raise AdapterError(
        f"{src}: no {ADAPTER_CONFIG} here or in {src / 'adapter'} (expected a PEFT adapter or a training checkpoint)"
    )


def read_adapter(src: str | os.PathLike, base_config: dict) -> Adapter:
    """Read a PEFT adapter (per-expert or fused layout), convert to per-expert, and check it fits the base."""
    directory = resolve_adapter_dir(src)
    config_path = directory / ADAPTER_CONFIG
    cfg = json.loads(config_path.read_text())
    for key in ("r", "lora_alpha"):
        if key not in cfg:
            raise AdapterError(f"{config_path}: missing {key!r}")
    if cfg.get("use_dora"):
        raise AdapterError(f"{config_path}: use_dora is true; DoRA adapters are not supported")
    weights = directory / ADAPTER_WEIGHTS
    if not weights.exists():
        raise AdapterError(f"{weights}: missing")
    tensors = load_file(weights)
    layout = cfg.get(COMPACT_LAYOUT_KEY, "per_expert")
    if layout == "shared_outer":
        tensors = expanded_tensors(tensors, base_config["n_routed_experts"], str(weights))
    elif layout != "per_expert":
        raise AdapterError(f"{config_path}: {COMPACT_LAYOUT_KEY} {layout!r}: known are per_expert and shared_outer")
    tensors = fused_to_per_expert(tensors, base_config, int(cfg["r"]))
    adapter = Adapter(tensors, int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False)))
    check_fits_base(adapter, base_config, source=str(weights))
    return adapter


def is_compact(directory: str | os.PathLike) -> bool:
    """Whether the adapter directory holds shared_outer's compact form (adapter_config.json says so)."""
    cfg = json.loads((resolve_adapter_dir(directory) / ADAPTER_CONFIG).read_text())
    return cfg.get(COMPACT_LAYOUT_KEY, "per_expert") == "shared_outer"


def compact_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert form of a shared_outer adapter with each shared factor once a layer (`...experts.shared....`):
    every expert's copy must be equal (else the adapter was not trained shared_outer: AdapterError naming the key)."""
    groups = shared_copies(tensors)
    for keys in groups.values():
        if (other := unequal_copy(tensors, keys)) is not None:
            m = EXPERT_FACTOR_KEY.match(other)
            raise AdapterError(
                f"{other} differs from {keys[0]}: a compact (shared_outer) adapter needs every expert's copy of "
                f"{m['p']}_proj.lora_{m['ab']} equal; this adapter was trained per_expert"
            )
    copied = {key for keys in groups.values() for key in keys}
    return {k: t for k, t in tensors.items() if k not in copied} | {
        one: tensors[keys[0]] for one, keys in groups.items()
    }


def expanded_tensors(
    tensors: dict[str, torch.Tensor], experts: int, source: str = "adapter"
) -> dict[str, torch.Tensor]:
    """The inverse of compact_tensors: each `...experts.shared....` factor copied to experts 0..experts-1."""
    out = {}
    for key, t in tensors.items():
        m = EXPERT_FACTOR_KEY.match(key)
        if m is None or m["e"] != "shared":
            out[key] = t
            continue
        if (m["p"], m["ab"]) not in SHARED_OUTER:
            raise AdapterError(f"{source}: {key}: shared_outer shares only A of gate/up and B of down")
        for e in range(experts):  # a copy each: safetensors refuses to write tensors that share memory
            out[f"{m['experts']}.{e}.{m['p']}_proj.lora_{m['ab']}.weight"] = t.clone()
    return out


def fused_to_per_expert(tensors: dict[str, torch.Tensor], config: dict, r: int) -> dict[str, torch.Tensor]:
    """Convert PEFT `target_parameters` expert keys to per-expert keys (other keys pass through)."""
    out, fused = {}, {}
    for key, t in tensors.items():
        m = _FUSED_KEY.match(key)
        if m is None:
            out[key] = t
        else:
            fused.setdefault((int(m.group("layer")), m.group("inner") or ""), {})[m.group("ab")] = t
    hidden, inter, experts = config["hidden_size"], config["moe_intermediate_size"], config["n_routed_experts"]
    for (layer, inner), ab in fused.items():
        where = f"{PREFIX}model.layers.{layer}.mlp.experts{inner}.lora_A.weight"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: fused expert adapter needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != experts * r or b.shape[1] != experts * r:
            raise AdapterError(
                f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not hold {experts} experts x rank {r}"
            )
        a_e, b_e = a.view(experts, r, a.shape[1]), b.view(b.shape[0], r, experts)
        is_gate_up = fused_projection(a.shape[1], b.shape[0], hidden, inter, where) == "gate_up"
        for e in range(experts):
            base = f"{PREFIX}model.layers.{layer}.mlp.experts.{e}"
            ae, be = a_e[e].contiguous(), b_e[:, :, e].contiguous()
            if is_gate_up:
                for proj, rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter))):
                    out[f"{base}.{proj}_proj.lora_A.weight"] = ae.clone()
                    out[f"{base}.{proj}_proj.lora_B.weight"] = be[rows].contiguous()
            else:
                out[f"{base}.down_proj.lora_A.weight"] = ae
                out[f"{base}.down_proj.lora_B.weight"] = be
    return out


def fused_projection(in_features: int, out_features: int, hidden: int, inter: int, where: str) -> str:
    """Which fused expert tensor a PEFT `target_parameters` pair adapts, from lora_A's columns (in) and lora_B's rows
    (out): gate_up_proj maps hidden -> 2 x moe_intermediate, down_proj moe_intermediate -> hidden. Both shapes are
    needed: with hidden == moe_intermediate the inputs agree and the outputs differ (and the other way round for
    hidden == 2 x moe_intermediate); the two can never agree in both."""
    shapes = {"gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
    matches = [name for name, shape in shapes.items() if shape == (in_features, out_features)]
    if not matches:
        raise AdapterError(
            f"{where}: maps {in_features} -> {out_features} features; the base's gate_up_proj maps "
            f"{hidden} -> {2 * inter} and its down_proj {inter} -> {hidden}"
        )
    return matches[0]


def check_fits_base(adapter: Adapter, config: dict, source: str = "adapter") -> None:
    """Every LoRA pair targets a quantizable base weight, with A [r, in] and B [out, r]."""
    specs = expected_tensors(config)
    for key, t in adapter.tensors.items():
        m = _LORA_KEY.match(key)
        if m is None:
            raise AdapterError(
                f"{source}: {key!r} is not a LoRA tensor name (base_model.model.<module>.lora_A/B.weight)"
            )
        base_key = m.group("module") + ".weight"
        spec = specs.get(base_key)
        if spec is None or not spec.quantizable:
            raise AdapterError(f"{source}: {key!r} targets {base_key!r}, which is not an adaptable weight of this base")
        out_f, in_f = spec.shape
        want = (adapter.r, in_f) if m.group("ab") == "A" else (out_f, adapter.r)
        if tuple(t.shape) != want:
            raise AdapterError(
                f"{source}: {key!r} has shape {list(t.shape)}, base weight {base_key} {list(spec.shape)} needs {list(want)}"
            )
        partner = key[: -len("lora_A.weight")] + ("lora_B.weight" if m.group("ab") == "A" else "lora_A.weight")
        if partner not in adapter.tensors:
            raise AdapterError(f"{source}: {key!r} has no partner {partner!r}")


def attach_adapter(model: torch.nn.Module, adapter: Adapter) -> torch.nn.Module:
    """Attach LoRA to `model` (a `quant.loader.load_frozen_model` model) on the targets `adapter` adapts and
    load its tensors: a module of an adapted target that the adapter leaves out gets B = 0 (no change), as
    PEFT and vLLM treat a module without LoRA. Errors name the tensor that does not fit."""
    from moe_lora.lora import PEFT_PREFIX, LoRAConfig, attach_lora, load_lora_state_dict, lora_state_dict, target_of

    adapted = set(adapter.modules())
    targets = sorted(
        {
            target_of(name, m)
            for name, m in model.named_modules()
            if target_of(name, m) is not None and any(a == name or a.startswith(name + ".") for a in adapted)
        }
    )
    if not targets:
        raise AdapterError(f"the adapter's {len(adapted)} modules match no adaptable module of the model")
    attach_lora(model, LoRAConfig(adapter.r, adapter.lora_alpha, tuple(targets), use_rslora=adapter.use_rslora))
    full = {
        k: (adapter.tensors[k] if k in adapter.tensors else torch.zeros_like(v))
        for k, v in lora_state_dict(model).items()
    }
    extra = [k for k in adapter.tensors if k not in full]
    if extra:
        raise AdapterError(
            f"adapter tensor {extra[0]!r} has no place in the model ({len(extra)} such; prefix {PEFT_PREFIX})"
        )
    load_lora_state_dict(model, full)
    return model


# --------------------------------------------------------------------------------------------- writing
def with_all_expert_projections(adapter: Adapter, config: dict, experts: range | None = None) -> Adapter:
    """vLLM needs, in every MoE layer that has expert LoRA, all three projections of every expert it holds (`experts`;
    None: all of them): zeros fill gaps."""
    specs = expected_tensors(config)
    tensors = dict(adapter.tensors)
    layers = {int(m.split(".")[2]) for m in adapter.modules() if ".mlp.experts." in m}
    for layer in sorted(layers):
        for e in experts if experts is not None else range(config["n_routed_experts"]):
            for proj in ("gate", "up", "down"):
                module = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                if f"{PREFIX}{module}.lora_A.weight" not in tensors:
                    out_f, in_f = specs[module + ".weight"].shape
                    tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.zeros(adapter.r, in_f)
                    tensors[f"{PREFIX}{module}.lora_B.weight"] = torch.zeros(out_f, adapter.r)
    return Adapter(tensors, adapter.r, adapter.lora_alpha, adapter.use_rslora)


def check_vllm_servable(adapter: Adapter) -> None:
    """What vLLM would drop or refuse, as an error that points to the merged export instead."""
    if adapter.r not in VLLM_RANKS:
        raise AdapterError(
            f"rank {adapter.r} is not one vLLM accepts ({', '.join(map(str, VLLM_RANKS))}); "
            "use `--format merged` to serve this adapter folded into the weights"
        )
    ignored = [m for m in adapter.modules() if m.rsplit(".", 1)[1] in VLLM_IGNORED_TARGETS]
    if ignored:
        raise AdapterError(
            f"{PREFIX}{ignored[0]}.lora_A.weight: vLLM loads LoRA on kv_b_proj but never applies it (its MLA absorbs "
            "kv_b_proj), so the served model would silently differ; use `--format merged` for this adapter"
        )


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def peft_targets(adapter: Adapter) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) that make PEFT on transformers 5 apply every module of the adapter, and
    nothing it lacks. PEFT (0.21) rewrites a DeepSeek-V3 adapter's `*gate_proj` / `*up_proj` / `*down_proj` targets
    into the routed experts' fused parameters (and converts their per-expert keys), so
      - routed experts:            the names gate_proj, up_proj, down_proj (PEFT's own conversion of v4-style keys);
      - dense MLP, shared experts: their weights as target_parameters (`model.layers.0.mlp.down_proj.weight`), which
                                   PEFT leaves alone; its wrapper adds s B @ A to the [out, in] weight, keys unchanged;
      - attention:                 each adapted module's full path, so a layer without it is not targeted (PEFT
                                   would warn of missing keys and add an adapter of its own there).
    vLLM reads the tensors' keys, not these lists."""
    modules = adapter.modules()
    is_mlp = lambda m: m.rsplit(".", 1)[1] in MLP_PROJECTIONS  # noqa: E731
    routed = sorted({m.rsplit(".", 1)[1] for m in modules if is_mlp(m) and ".mlp.experts." in m})
    dense = [f"{m}.weight" for m in modules if is_mlp(m) and ".mlp.experts." not in m]
    return [m for m in modules if not is_mlp(m)] + routed, dense


def adapter_config_json(adapter: Adapter, base_model: str) -> dict:
    target_modules, target_parameters = peft_targets(adapter)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.r,
        "lora_alpha": adapter.lora_alpha,
        "use_rslora": adapter.use_rslora,
        "target_modules": target_modules,
        "target_parameters": target_parameters or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "modules_to_save": None,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def write_peft_adapter(
    adapter: Adapter, out: str | os.PathLike, base_model: str, overwrite: bool = False, compact: bool = False
) -> Path:
    """adapter_config.json + adapter_model.safetensors, written atomically; compact: shared_outer's compact form
    (module docstring; compact_tensors refuses an adapter whose experts' copies differ before anything is written)."""
    config = adapter_config_json(adapter, base_model)
    tensors = adapter.tensors
    if compact:
        tensors, config[COMPACT_LAYOUT_KEY] = compact_tensors(tensors), "shared_outer"
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(tmp / ADAPTER_WEIGHTS))
    return Path(out)


def export_peft(
    adapter: Adapter, base: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False, compact: bool = False
) -> Path:
    """A PEFT adapter that PEFT loads onto the bf16 base and vLLM serves (checked before anything is written);
    compact: shared_outer's compact form instead (read back by read_adapter; PEFT and vLLM need the per-expert one)."""
    config = read_config(base)
    check_fits_base(adapter, config)
    check_vllm_servable(adapter)
    full = with_all_expert_projections(adapter, config)
    return write_peft_adapter(full, out, str(Path(base).resolve()), overwrite, compact)


def _read_tensor(base: Path, weight_map: dict[str, str], key: str) -> torch.Tensor:
    with safe_open(str(base / weight_map[key]), framework="pt") as f:
        return f.get_tensor(key)


def stored_weight(t: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    """A checkpoint weight as stored, in float32: FP8 blocks dequantized exactly (Q * scale_inv), else cast."""
    return t.float() if scale_inv is None else fp8_block_dequantize(t, scale_inv)


def trained_weight(t: torch.Tensor, scale_inv: torch.Tensor | None, fmt: str, double_quant: bool) -> torch.Tensor:
    """dequant(quant(W)) in float32: the weight a frozen module in `fmt` holds, converted exactly as the loader
    converts it (`checkpoint_weight`), so it equals that module's `weight_q.dequantize(float32)` bit for bit."""
    return checkpoint_weight(t, scale_inv, fmt, double_quant).dequantize(torch.float32)


def merged_tensors(
    key: str,
    t: torch.Tensor,
    scale_inv: torch.Tensor | None,
    quantizable: bool,
    adapted: torch.Tensor | None,
    dtype: str,
) -> dict[str, torch.Tensor]:
    """The output tensors of one base weight `t` (`scale_inv`: its FP8 block scales, None for a floating weight).

    Adapted (`adapted` = W' in float32, given): written as bf16, or as FP8 blocks with fresh scales.
    Not adapted: FP8 weights (scale_inv given; the quantizable groups' and the MTP layer's alike) are
    dequantized for a bf16 output and copied byte for byte with their scales for an fp8 one; floating
    weights of the quantizable groups are cast to bf16, or block-quantized for fp8; the rest is copied.
    """
    if adapted is not None:
        w = adapted
    elif scale_inv is not None:
        if dtype == "fp8":
            return {key: t, scale_key(key): scale_inv}
        w = stored_weight(t, scale_inv)
    elif quantizable:
        w = t.float()
    else:
        return {key: t}
    if dtype == "fp8":
        q, new_scale_inv = fp8_block_quantize(w)
        return {key: q, scale_key(key): new_scale_inv}
    return {key: w.to(torch.bfloat16)}


def export_merged(
    adapter: Adapter,
    base: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "bf16",
    trained_plan: QuantPlan | None = None,
    overwrite: bool = False,
) -> Path:
    """A full checkpoint with W' = W_into + s B A folded in, sharded like the base, in bf16 or FP8 128x128 blocks.

    W_into, for each adapted weight W of the base checkpoint:
      trained_plan None (default): W as the checkpoint stores it (FP8 blocks dequantized exactly). This is
        the full-precision base plus the adapter; it is not the model that was trained when training froze
        W in a lossy format (e.g. NF4 routed experts): it differs by dequant(quant(W)) - W per adapted weight.
        It is the default because an adapter does not record the formats it was trained in.
      trained_plan given: dequant(quant(W)) in the format `trained_plan` gives W's group (pass the run's
        `model.quant`), converted by the loader's own code, so W_into is bit for bit the weight the trainer's
        frozen module held and W' is the weight the trained model applied (up to the output dtype's rounding).
    Weights without an adapter are not re-quantized to the training formats: a bf16 output holds them as
    stored (FP8 ones dequantized, the multi-token-prediction layer's included: no float8 tensor and no
    weight_scale_inv is left), an fp8 output copies FP8 ones with their scales byte for byte and
    block-quantizes floating ones of the quantizable groups. Shard by shard: each output shard holds the
    weights of the same base shard (plus, for fp8, their scales).
    """
    if dtype not in ("bf16", "fp8"):
        raise AdapterError(f"merged dtype {dtype!r}: choose bf16 or fp8")
    base = Path(base)
    config = read_config(base)
    check_fits_base(adapter, config)
    specs = expected_tensors(config)
    weight_map = read_weight_map(base)
    adapted = set(adapter.modules())
    shards = sorted({f for k, f in weight_map.items() if not k.endswith(SCALE_SUFFIX)})

    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        new_map: dict[str, str] = {}
        total = 0
        for shard in shards:
            tensors: dict[str, torch.Tensor] = {}
            for key in [k for k, f in weight_map.items() if f == shard and not k.endswith(SCALE_SUFFIX)]:
                t = _read_tensor(base, weight_map, key)
                scale_inv = _read_tensor(base, weight_map, scale_key(key)) if scale_key(key) in weight_map else None
                spec, module = specs.get(key), key[: -len(".weight")]
                new_weight = None
                if module in adapted:  # check_fits_base: an adapted weight is a quantizable group's
                    if trained_plan is None:
                        into = stored_weight(t, scale_inv)
                    else:
                        into = trained_weight(
                            t, scale_inv, trained_plan.format_of(spec.group), trained_plan.double_quant
                        )
                    new_weight = into + adapter.delta(module)
                quantizable = spec is not None and spec.quantizable
                tensors.update(merged_tensors(key, t, scale_inv, quantizable, new_weight, dtype))
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
            for key, t in tensors.items():
                new_map[key] = shard
                total += t.numel() * t.element_size()
        (tmp / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": new_map}, indent=2) + "\n"
        )
        merged_config = {k: v for k, v in config.items() if k != "quantization_config"}
        if dtype == "fp8":
            merged_config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        (tmp / "config.json").write_text(json.dumps(merged_config, indent=2) + "\n")
        for name in os.listdir(base):
            if name.startswith(("tokenizer", "generation_config", "special_tokens", "chat_template")):
                shutil.copy(base / name, tmp / name)
    return Path(out)
