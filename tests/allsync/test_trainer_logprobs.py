"""The trainer's logprobs are computed over chunks of positions, never the whole [B, L, V] logits: same
values and gradients as the full log-softmax, entropy included."""

import pytest
import torch

from allsync.update.forward import forward_pass, token_logprobs
from allsync.update.sequences import build_sequences
from moe_lora.lora import LoRAConfig, attach_lora
from quant.loader import QuantPlan, load_frozen_model


def full_reference(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)
    chosen = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


@pytest.mark.parametrize("chunk_elements", [1, 7 * 50, 10**9])  # one position at a time, ragged chunks, one chunk
def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients(chunk_elements):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen)
    targets = torch.randint(0, 50, (3, 11), generator=gen)
    upstream = torch.randn(3, 11, generator=gen)
    got, entropy = token_logprobs(
        hidden, weight, targets, temperature=0.7, with_entropy=True, chunk_elements=chunk_elements
    )
    (grad,) = torch.autograd.grad((got * upstream).sum(), hidden)
    expected, expected_entropy = full_reference(hidden, weight, targets, 0.7)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), hidden)
    assert torch.allclose(got, expected, atol=1e-5) and torch.allclose(entropy, expected_entropy, atol=1e-5)
    assert torch.allclose(grad, expected_grad, atol=1e-5)
    assert not entropy.requires_grad


def test_forward_pass_matches_the_models_own_logits(tiny_bf16):
    model = load_frozen_model(tiny_bf16, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32, progress=False)
    attach_lora(model, LoRAConfig(rank=4, alpha=8, targets=("q_a_proj", "routed_experts")))
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)  # B != 0: the adapters change the logits
    batch = build_sequences([[0, 5, 6, 7], [0, 9]], [[10, 11, 1], [12, 13, 14, 15, 1]], pad_id=2)
    out = forward_pass(model, batch, temperature=0.8, with_entropy=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float() / 0.8
    logp = torch.log_softmax(logits, -1)
    mask = batch.response_mask.bool()
    expected = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs[mask], expected[mask], atol=1e-5)
    assert torch.allclose(out.entropy[mask], -(logp.exp() * logp).sum(-1)[mask], atol=1e-5)
