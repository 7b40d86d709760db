"""attach_lora on the whole tiny DeepSeek-V3, every format: logits and LoRA gradients equal transformers'
own fp32 model whose frozen weights are replaced by dequant(W) + s*B@A; state dicts in PEFT's names."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_lora.lora import LoRAConfig, LoRAExperts, LoRALinear, attach_lora, load_lora_state_dict, lora_state_dict
from quant.formats import FORMATS
from quant.loader import QuantPlan, load_frozen_model

TOKENS = torch.randint(8, 264, (2, 12), generator=torch.Generator().manual_seed(0))
CONFIG = LoRAConfig(rank=4, alpha=8)  # all default targets, s = 2
PREFIX = "base_model.model.model.layers"


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def lora_model(checkpoint, fmt="bf16", seed=0, config=CONFIG):
    model = load_frozen_model(checkpoint, QuantPlan.uniform(fmt), compute_dtype=torch.float32, progress=False)
    torch.manual_seed(seed)
    attach_lora(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # nonzero, so every adapter changes the logits
    return model


@pytest.fixture(scope="module")
def reference(tiny_bf16):
    return AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32)


def merged_weights(model, leaves: dict[str, torch.Tensor], s: float) -> dict[str, torch.Tensor]:
    """transformers parameter name -> dequant(W) + s B A, built from `leaves` (copies of our A and B)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            delta = s * leaves[f"{name}.lora_B"] @ leaves[f"{name}.lora_A"]
            out[f"{name}.weight"] = m.base.weight_q.dequantize(torch.float32) + delta
        elif isinstance(m, LoRAExperts):
            w = {}
            for p, qws in m.base.weights.items():
                dense = torch.stack([qw.dequantize(torch.float32) for qw in qws])
                w[p] = dense + s * leaves[f"{name}.lora_B.{p}"] @ leaves[f"{name}.lora_A.{p}"]
            out[f"{name}.gate_up_proj"] = torch.cat([w["gate"], w["up"]], dim=1)
            out[f"{name}.down_proj"] = w["down"]
    return out


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_model_with_lora_equals_merged_transformers(tiny_bf16, reference, fmt, kernel):
    model = lora_model(tiny_bf16, fmt, config=dataclasses.replace(CONFIG, expert_kernel=kernel))
    assert {m.kernel for m in model.modules() if isinstance(m, LoRAExperts)} == {kernel}
    leaves = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters() if p.requires_grad}
    ref_logits = torch.func.functional_call(reference, merged_weights(model, leaves, CONFIG.scale), (TOKENS,)).logits
    logits = model(TOKENS).logits
    grad_out = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * grad_out).sum().backward()
    (ref_logits * grad_out).sum().backward()
    assert rel(logits, ref_logits) < 1e-5
    for name, leaf in leaves.items():
        assert rel(model.get_parameter(name).grad, leaf.grad) < 1e-4, name

    lora_names = {n for n, _ in model.named_parameters() if ".lora_A" in n or ".lora_B" in n}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == lora_names
    assert {n for n, p in model.named_parameters() if p.grad is not None} == lora_names
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.grad is None and model.model.embed_tokens.weight.grad is None
    assert model.lm_head.weight.grad is None and model.model.layers[1].input_layernorm.weight.grad is None


def test_gradient_checkpointing_gives_same_gradients(tiny_bf16):
    model = lora_model(tiny_bf16, "nf4").train()
    grads = []
    for enable in (False, True):
        if enable:
            model.gradient_checkpointing_enable()
        model.zero_grad()
        model(TOKENS, use_cache=False).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert model.model.gradient_checkpointing
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_state_dict_keys_shapes_and_roundtrip(tiny_bf16):
    model = lora_model(tiny_bf16, "int8", seed=0)
    sd = lora_state_dict(model)
    # tiny: 3 layers (1 dense, 2 MoE with 8 experts); 5 attention projections, 3 MLP projections, A and B each
    assert len(sd) == 3 * 5 * 2 + 3 * 2 + 2 * (3 * 2 + 8 * 3 * 2)
    assert sd[f"{PREFIX}.0.self_attn.q_a_proj.lora_A.weight"].shape == (4, 128)
    assert sd[f"{PREFIX}.0.self_attn.kv_a_proj_with_mqa.lora_B.weight"].shape == (512 + 64, 4)
    assert sd[f"{PREFIX}.0.mlp.gate_proj.lora_B.weight"].shape == (256, 4)
    assert sd[f"{PREFIX}.1.mlp.shared_experts.down_proj.lora_A.weight"].shape == (4, 64)
    experts = model.model.layers[2].mlp.experts
    assert torch.equal(sd[f"{PREFIX}.2.mlp.experts.7.up_proj.lora_B.weight"], experts.lora_B["up"][7])
    assert torch.equal(sd[f"{PREFIX}.2.mlp.experts.3.down_proj.lora_A.weight"], experts.lora_A["down"][3])

    other = lora_model(tiny_bf16, "int8", seed=1)
    with torch.no_grad():
        assert not torch.equal(other(TOKENS).logits, model(TOKENS).logits)
        load_lora_state_dict(other, sd)
        assert torch.equal(other(TOKENS).logits, model(TOKENS).logits)


def test_load_state_dict_is_strict(tiny_bf16):
    model = lora_model(tiny_bf16)
    sd = lora_state_dict(model)
    key = f"{PREFIX}.1.mlp.experts.5.gate_proj.lora_A.weight"
    with pytest.raises(KeyError, match=key):
        load_lora_state_dict(model, {k: v for k, v in sd.items() if k != key})
    with pytest.raises(ValueError, match=rf"{key}.*\[4, 64\].*\[4, 128\]"):
        load_lora_state_dict(model, {**sd, key: torch.zeros(4, 64)})
    with pytest.raises(KeyError, match="lm_head"):
        load_lora_state_dict(model, {**sd, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 128)})


def test_target_subset_and_errors(tiny_bf16):
    model = lora_model(tiny_bf16, config=LoRAConfig(rank=2, targets=["o_proj", "routed_experts"]))
    wrapped = {n for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))}
    assert wrapped == {f"model.layers.{i}.self_attn.o_proj" for i in range(3)} | {
        f"model.layers.{i}.mlp.experts" for i in (1, 2)
    }
    with pytest.raises(ValueError, match="already"):
        attach_lora(model, CONFIG)
    fresh = load_frozen_model(tiny_bf16, QuantPlan.uniform("bf16"), progress=False)
    with pytest.raises(ValueError, match="'q_proj' matches no"):
        attach_lora(fresh, LoRAConfig(targets=("q_proj",)))
