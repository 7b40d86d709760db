"""LoRA adapters on a frozen (quantized) DeepSeek-V3 model from `quant.loader.load_frozen_model`.

    model = load_frozen_model(ckpt, QuantPlan(routed_experts="nf4"))
    attach_lora(model, LoRAConfig(rank=8, alpha=16, targets=("q_a_proj", "routed_experts")))
    save_file(lora_state_dict(model), "adapter_model.safetensors")   # PEFT's key names

Scale s = alpha / r, or alpha / sqrt(r) with rsLoRA. Only A and B train; router, norms, embeddings and
lm_head stay frozen. Key names are PEFT's, routed experts one entry per expert:
    base_model.model.model.layers.L.self_attn.q_a_proj.lora_A.weight          [r, in]
    base_model.model.model.layers.L.mlp.experts.E.gate_proj.lora_B.weight     [out, r]
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from moe_lora.lora_layers import SHARED_OUTER, LoRAExperts, LoRALinear
from quant.modules import EXPERT_PROJECTIONS, FrozenExperts, FrozenLinear

ATTENTION_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP_TARGETS = ("dense_mlp", "shared_experts", "routed_experts")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# q_proj exists only in models without q_lora_rank (DeepSeek-V3 has q_a_proj/q_b_proj instead).
DEFAULT_TARGETS = tuple(t for t in TARGETS if t != "q_proj")
PEFT_PREFIX = "base_model.model."

__all__ = [
    "LoRAConfig",
    "LoRAExperts",
    "LoRALinear",
    "TARGETS",
    "adapter_copy",
    "adapters_disabled",
    "attach_lora",
    "load_lora_state_dict",
    "lora_state_dict",
    "seeded_init_",
]


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    use_rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    dtype: torch.dtype = torch.float32  # of A and B (what the optimizer updates)
    expert_kernel: str = "auto"  # routed experts: loop | grouped_mm | auto (grouped_mm on GPUs when the rank allows)
    expert_layout: str = "per_expert"  # routed experts: per_expert | shared_outer (moe_lora.lora_layers)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown LoRA target {unknown[0]!r}; valid targets: {', '.join(TARGETS)}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.expert_kernel not in LoRAExperts.kernels:
            raise ValueError(
                f"unknown routed-expert kernel {self.expert_kernel!r}; valid: {', '.join(LoRAExperts.kernels)}"
            )
        if self.expert_layout not in LoRAExperts.layouts:
            raise ValueError(
                f"unknown routed-expert LoRA layout {self.expert_layout!r}; valid: {', '.join(LoRAExperts.layouts)}"
            )
        if self.expert_kernel == "grouped_mm" and self.dropout > 0:
            raise ValueError(
                f"the grouped_mm routed-expert kernel has no dropout (dropout {self.dropout}); use kernel loop"
            )

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def target_of(name: str, module: nn.Module) -> str | None:
    """The target name a frozen module answers to (None for modules LoRA never wraps)."""
    if isinstance(module, FrozenExperts):
        return "routed_experts"
    if isinstance(module, FrozenLinear):
        return name.rsplit(".", 1)[-1] if module.group == "attention" else module.group
    return None


def attach_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Wrap every targeted frozen module in place; afterwards exactly the A/B tensors require grad."""
    if any(isinstance(m, (LoRALinear, LoRAExperts)) for m in model.modules()):
        raise ValueError("model already has LoRA adapters attached")
    chosen = [(n, m) for n, m in model.named_modules() if target_of(n, m) in config.targets]
    found = {target_of(n, m) for n, m in chosen}
    absent = [t for t in config.targets if t not in found]
    if absent:
        raise ValueError(f"LoRA target {absent[0]!r} matches no frozen module in this model")
    model.requires_grad_(False)
    args = (config.rank, config.scale, config.dropout, config.dtype)
    for name, module in chosen:
        if isinstance(module, FrozenExperts):
            wrapper = LoRAExperts(module, *args, kernel=config.expert_kernel, layout=config.expert_layout)
        else:
            wrapper = LoRALinear(module, *args)
        model.set_submodule(name, wrapper)
    return model


def adapter_copy(model: nn.Module, routed_experts: bool = True) -> nn.Module:
    """A second model over the same frozen weights, with adapter tensors of its own: every frozen module
    (quantized projections and experts), frozen parameter (embeddings, norms, routers) and buffer is shared,
    not copied; the containers and the LoRA A/B tensors are new (copies of `model`'s; re-draw them with
    seeded_init_). Costs the adapter's bytes. routed_experts False: the copy's MoE layers run their frozen
    experts without an adapter (the shared FrozenExperts in place of the copied LoRAExperts)."""
    shared: dict[int, object] = {id(t): t for t in model.parameters() if not t.requires_grad}
    shared.update({id(b): b for b in model.buffers()})
    shared.update({id(m): m for m in model.modules() if isinstance(m, (FrozenLinear, FrozenExperts))})
    if not routed_experts:  # each LoRAExperts "copies" to its frozen base: its adapter is never copied
        shared.update({id(m): m.base for m in model.modules() if isinstance(m, LoRAExperts)})
    return copy.deepcopy(model, memo=shared)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> Parameter of every trainable tensor of `model`: the LoRA factors attached to it."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def set_adapter_parameters(
    model: nn.Module, tensors: dict[str, nn.Parameter], what: str = "these LoRA tensors"
) -> None:
    """Each Parameter of `tensors` set as `model`'s of that name, the frozen weights untouched: the adapter a model's
    LoRA modules run is swapped (a second policy's, or another model's shared tensors). The names must be exactly
    `adapter_parameters(model)`'s, checked before any change."""
    if sorted(tensors) != sorted(adapter_parameters(model)):
        raise ValueError(f"{what} are not the LoRA tensors this model's modules hold (other names)")
    for name, p in tensors.items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, p)


def seeded_init_(model: nn.Module, seed: int) -> None:
    """Re-draw every A (PEFT's init, see init_lora_a_) from a generator seeded by (seed, PEFT key), and zero
    every B: each tensor's start depends only on the seed and its name, not on the process's RNG or on which
    experts this process holds, so every expert-parallel layout starts from the same adapter. A factor the
    layer's experts share (shared_outer) is drawn once, under its layer's key (`shared_slots`), not an expert's."""
    from moe_lora.lora_layers import init_lora_a_

    with torch.no_grad():
        shared = shared_slots(model)
        aliases = {t.data_ptr() for t in shared.values()}
        slots = {k: t for k, t in _adapter_slots(model).items() if t.data_ptr() not in aliases}
        for key, slot in {**slots, **shared}.items():
            if ".lora_B." in key:
                slot.zero_()
                continue
            gen = torch.Generator(device=slot.device).manual_seed(seed * 2**32 + zlib.crc32(key.encode()))
            init_lora_a_(slot, generator=gen)


def shared_slots(model: nn.Module) -> dict[str, torch.Tensor]:
    """`<PEFT prefix of the experts>.shared.<p>_proj.lora_<A|B>.weight` -> the [r, in] / [out, r] factor a
    shared_outer layer's experts share (PEFT's format has no such key: its export repeats it for every expert)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRAExperts):
            for (p, side), t in module.shared_parameters().items():
                out[f"{PEFT_PREFIX}{name}.shared.{p}_proj.lora_{side}.weight"] = t[0]
    return out


def expert_slots(prefix: str, factors: list[torch.Tensor], first_expert: int = 0) -> dict[str, torch.Tensor]:
    """PEFT keys of routed experts first_expert.. -> per-expert views of the 3-D factors
    [A_gate, B_gate, A_up, B_up, A_down, B_down] (LoRAExperts.factors() order) of the module at `prefix`."""
    slots = {}
    for e in range(factors[0].shape[0]):  # keys carry the model's expert id (a shard starts at first_expert)
        for i, p in enumerate(EXPERT_PROJECTIONS):
            slots[f"{prefix}.{first_expert + e}.{p}_proj.lora_A.weight"] = factors[2 * i][e]
            slots[f"{prefix}.{first_expert + e}.{p}_proj.lora_B.weight"] = factors[2 * i + 1][e]
    return slots


def _adapter_slots(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> the live tensor holding it (a per-expert view into the 3-D parameter for experts)."""
    slots: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = PEFT_PREFIX + name
        if isinstance(module, LoRALinear):
            slots[f"{prefix}.lora_A.weight"] = module.lora_A
            slots[f"{prefix}.lora_B.weight"] = module.lora_B
        elif isinstance(module, LoRAExperts):
            slots.update(expert_slots(prefix, module.factors(), module.first_expert))
    return slots


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every adapter tensor under PEFT's key names (separate storage: safetensors-ready); under
    expert parallelism, this process's experts only."""
    with torch.no_grad():
        return {k: t.detach().clone() for k, t in _adapter_slots(model).items()}


_EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.lora_[AB]\.weight$")


def load_lora_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor], other_experts: bool = False) -> None:
    """Strict: every adapter key present with the model's shape, no extra keys; checked before any copy.
    other_experts: the model holds a block of the routed experts (expert parallelism) and `tensors` may hold
    the other blocks' too (a whole adapter), which are skipped."""
    with torch.no_grad():
        slots = _adapter_slots(model)
        missing = [k for k in slots if k not in tensors]
        if missing:
            raise KeyError(f"adapter tensor {missing[0]!r} missing from the state dict ({len(missing)} missing)")
        extra = [k for k in tensors if k not in slots and not (other_experts and _EXPERT_KEY.search(k))]
        if extra:
            raise KeyError(
                f"state dict has {extra[0]!r}, which is not an adapter tensor of this model ({len(extra)} such)"
            )
        for key, slot in slots.items():
            if tuple(tensors[key].shape) != tuple(slot.shape):
                raise ValueError(
                    f"adapter tensor {key!r}: state dict shape {list(tensors[key].shape)}, model expects {list(slot.shape)}"
                )
        check_shared_copies_agree(model, tensors)
        for key, slot in slots.items():
            slot.copy_(tensors[key])


def check_shared_copies_agree(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every expert's copy of a factor that a shared_outer layer's experts share must hold the same values in
    `tensors`, over all the experts it holds (a whole adapter: every rank's block), else a per-expert adapter would
    load a different "shared" factor on each expert-parallel rank; refused naming the first copy that differs."""
    wanted = set(shared_slots(model))
    for one, keys in shared_copies(tensors).items():
        if one in wanted and (other := unequal_copy(tensors, keys)) is not None:
            raise ValueError(
                f"adapter tensor {other!r} differs from {keys[0]!r}, but the model's lora.expert_layout "
                "shared_outer shares that factor between the layer's experts: this adapter was trained per_expert"
            )


# a routed expert's factor under PEFT's key; e = "shared" in shared_outer's compact form (shared_slots' keys)
EXPERT_FACTOR_KEY = re.compile(
    r"^(?P<experts>base_model\.model\.model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+|shared)"
    r"\.(?P<p>gate|up|down)_proj\.lora_(?P<ab>[AB])\.weight$"
)


def shared_copies(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """`...experts.shared.<p>_proj.lora_<A|B>.weight` (shared_slots' key) -> the keys in `tensors` of every expert's
    copy of a factor that shared_outer shares (lora_layers.SHARED_OUTER), by expert index."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for key in tensors:
        m = EXPERT_FACTOR_KEY.match(key)
        if m is not None and m["e"] != "shared" and (m["p"], m["ab"]) in SHARED_OUTER:
            one = f"{m['experts']}.shared.{m['p']}_proj.lora_{m['ab']}.weight"
            groups.setdefault(one, []).append((int(m["e"]), key))
    return {one: [key for _, key in sorted(copies)] for one, copies in groups.items()}


def unequal_copy(tensors: dict[str, torch.Tensor], keys: list[str]) -> str | None:
    """The first of `keys` whose tensor differs from keys[0]'s (None: all equal)."""
    return next((k for k in keys[1:] if not torch.equal(tensors[keys[0]], tensors[k])), None)


def lora_modules(model: nn.Module) -> list[nn.Module]:
    """The model's LoRA modules (LoRALinear and LoRAExperts), in module order."""
    return [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts))]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Inside the block every LoRA module computes its frozen base alone (y = frozen(x)): the model is the
    reference policy of the KL penalty, at no memory cost. Restored on exit, also after an exception."""
    modules = lora_modules(model)
    previous = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m, state in zip(modules, previous):
            m.enabled = state


@contextlib.contextmanager
def lora_merged(model: nn.Module):
    """Inside the block, no-grad forwards of every LoRALinear whose frozen weight has a compute copy (model.compute_copy)
    read M = W + s B A, formed once on entry: y = x M^T, one matmul per call instead of three (generation with the
    adapter of this step). The same function in another rounding order (float32, the default run: logprobs within
    2.5e-5 nats of the unmerged forward, mean logprob_gap 6e-7). Routed experts keep their per-group LoRA: no
    full-size expert delta is ever formed.
    Forwards with gradients still compute the unmerged form. Cleared on exit, also after an exception."""
    modules = [
        m
        for m in model.modules()
        if isinstance(m, LoRALinear) and m.base.weight_q is not None and m.base.weight_q.compute_copy is not None
    ]
    try:
        with torch.no_grad():
            for m in modules:
                w = m.base.weight_q.compute_copy
                m.merged = torch.addmm(w, m.lora_B.to(w.dtype), m.lora_A.to(w.dtype), alpha=m.scale)
        yield model
    finally:
        for m in modules:
            m.merged = None
