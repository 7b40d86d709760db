"""lora.expert_layout shared_outer (issue 47): A of gate/up and B of down shared by a layer's experts, B of gate/up
and A of down per expert; both kernels against the dense reference, its parameter shapes, an initialization that
does not depend on which experts a process holds, and PEFT's per-expert format in and out."""

import pytest
import torch
from torch import nn

from moe_lora.lora import LoRAConfig, load_lora_state_dict, lora_state_dict, seeded_init_, shared_slots
from moe_lora.lora_layers import LoRAExperts
from quant.formats import quantize_weight
from quant.modules import FrozenExperts
from tests.moe_lora.test_moe_lora import ROUTED, SCALE, E, H, I, R, check_against_dense, make_experts, rel


def shared_outer(fmt: str, kernel: str, seed: int = 0) -> LoRAExperts:
    """make_experts' frozen experts under a shared_outer adapter with random nonzero B."""
    torch.manual_seed(seed)
    lora = LoRAExperts(make_experts(fmt).base, R, SCALE, kernel=kernel, layout="shared_outer")
    gen = torch.Generator().manual_seed(seed + 1)
    for b in lora.lora_B.values():
        b.data.normal_(0, 0.1, generator=gen)
    return lora


def test_the_shared_factors_are_one_tensor_a_layer_and_the_others_one_per_expert():
    lora = shared_outer("bf16", "loop")
    shapes = {
        f"{side}_{p}": tuple(getattr(lora, f"lora_{side}")[p].shape) for p in ("gate", "up", "down") for side in "AB"
    }
    assert shapes == {
        "A_gate": (1, R, H),
        "B_gate": (E, I, R),
        "A_up": (1, R, H),
        "B_up": (E, I, R),
        "A_down": (E, R, I),
        "B_down": (1, H, R),
    }
    per_expert = LoRAExperts(lora.base, R, SCALE)
    count = lambda m: sum(p.numel() for p in m.adapter_parameters())
    assert count(per_expert) - count(lora) == (E - 1) * (2 * R * H + H * R)
    assert [tuple(t.shape) for t in lora.factors()] == [tuple(t.shape) for t in per_expert.factors()]
    assert len(lora.per_expert_parameters()) == 3 and set(lora.shared_parameters()) == {
        ("gate", "A"),
        ("up", "A"),
        ("down", "B"),
    }
    with pytest.raises(ValueError, match="unknown routed-expert LoRA layout 'shared'"):
        LoRAExperts(lora.base, R, SCALE, layout="shared")
    with pytest.raises(ValueError, match="unknown routed-expert LoRA layout 'rank_shared'"):
        LoRAConfig(expert_layout="rank_shared")


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("fmt", ["nf4", "fp8", "bf16"])
def test_shared_outer_equals_the_dense_reference_forward_and_backward(fmt, kernel):
    """Output, input and routing-weight gradients and every factor's gradient (a shared one: summed over the
    experts) within 1e-5 of every expert run densely with W_e + s B_e A_e, the shared factors tied."""
    lora = shared_outer(fmt, kernel)
    x, idx, w, out = check_against_dense(lora)
    assert lora.lora_B["gate"].grad[ROUTED].abs().max() == 0 and lora.lora_A["down"].grad[ROUTED].abs().max() == 0
    assert lora.lora_A["gate"].grad.abs().max() > 0  # the shared A learns from every routed expert's tokens
    with torch.no_grad():
        assert rel(lora(x, idx, w), out) < 1e-6


def experts_model(lora: LoRAExperts) -> nn.Module:
    """A model whose routed experts sit where DeepSeek-V3's do (the name the PEFT keys carry)."""
    root = nn.Module()
    root.add_module("model", nn.Module())
    root.model.add_module("layers", nn.ModuleList([nn.Module()]))
    root.model.layers[0].add_module("mlp", nn.Module())
    root.model.layers[0].mlp.add_module("experts", lora)
    return root


def block(first: int, count: int, layout: str) -> nn.Module:
    """Experts first..first+count-1 of a 4-expert layer, bf16 weights, under an adapter of `layout`."""
    gen = torch.Generator().manual_seed(first)
    base = FrozenExperts(count, H, I, first_expert=first)
    for e in range(count):
        for p, (o, n) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
            base.set_weight(e, p, quantize_weight(torch.randn(o, n, generator=gen) / n**0.5, "bf16"))
    return experts_model(LoRAExperts(base, R, SCALE, layout=layout))


def test_seeded_init_draws_a_shared_factor_under_its_layers_key_whatever_experts_a_process_holds():
    whole, second_half = block(0, 4, "shared_outer"), block(2, 2, "shared_outer")
    seeded_init_(whole, 7)
    seeded_init_(second_half, 7)
    full, half = lora_state_dict(whole), lora_state_dict(second_half)
    assert set(half) < set(full)
    for key in half:
        assert torch.equal(half[key], full[key]), key
    keys = sorted(shared_slots(whole))
    assert keys == [
        "base_model.model.model.layers.0.mlp.experts.shared.down_proj.lora_B.weight",
        "base_model.model.model.layers.0.mlp.experts.shared.gate_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.experts.shared.up_proj.lora_A.weight",
    ]
    gate_a = [full[f"base_model.model.model.layers.0.mlp.experts.{e}.gate_proj.lora_A.weight"] for e in range(4)]
    assert all(torch.equal(g, gate_a[0]) for g in gate_a) and gate_a[0].abs().max() > 0
    down_a = [full[f"base_model.model.model.layers.0.mlp.experts.{e}.down_proj.lora_A.weight"] for e in range(4)]
    assert not torch.equal(down_a[0], down_a[1])  # per expert: each its own draw


def test_peft_tensors_repeat_the_shared_factors_and_load_back_but_a_per_expert_adapter_is_refused():
    source, target = block(0, 4, "shared_outer"), block(0, 4, "shared_outer")
    seeded_init_(source, 1)
    with torch.no_grad():
        for t in source.model.layers[0].mlp.experts.adapter_parameters():
            t.normal_()
    tensors = lora_state_dict(source)
    load_lora_state_dict(target, tensors)
    for mine, theirs in zip(
        target.model.layers[0].mlp.experts.adapter_parameters(), source.model.layers[0].mlp.experts.adapter_parameters()
    ):
        assert torch.equal(mine, theirs)
    per_expert = block(0, 4, "per_expert")
    seeded_init_(per_expert, 1)
    with pytest.raises(
        ValueError,
        match=r"experts\.1\.(gate|up)_proj\.lora_A\.weight' differs from .*experts\.0\.(gate|up)_proj.*shared_outer",
    ):
        load_lora_state_dict(target, lora_state_dict(per_expert))


def test_a_whole_adapter_whose_blocks_disagree_is_refused_by_the_rank_holding_one_block():
    """Expert parallelism: the rank holding experts 2-3 loads a whole adapter (every block) whose copies of a shared
    factor agree inside each block but not across them; it is refused there, not loaded as a different shared
    factor on each rank."""
    whole, half = block(0, 4, "shared_outer"), block(2, 2, "shared_outer")
    seeded_init_(whole, 3)
    tensors = lora_state_dict(whole)
    for e in (0, 1):
        key = f"base_model.model.model.layers.0.mlp.experts.{e}.gate_proj.lora_A.weight"
        tensors[key] = tensors[key] + 1.0
    with pytest.raises(ValueError, match=r"experts\.(2|3)\.gate_proj\.lora_A\.weight' differs from .*experts\.0\."):
        load_lora_state_dict(half, tensors, other_experts=True)
