"""moe_lora layers: LoRALinear / LoRAExperts against dense references W + s*B@A in plain torch, every format."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from moe_lora.grouped_lora import ExpertsCall, GroupedLoRAExperts, Routing
from moe_lora.lora import LoRAConfig
from moe_lora.lora_layers import LoRAExperts, LoRALinear, expert_shapes
from quant.formats import FORMATS, quantize_weight
from quant.modules import FrozenExperts, FrozenLinear, group_tokens_by_expert

E, H, I, T, K, R, SCALE = 5, 128, 64, 24, 2, 4, 2.0
ROUTED = 4  # tokens only go to experts 0..3, so expert 4 must get zero gradients


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def make_experts(fmt, seed=0, dropout=0.0):
    gen = torch.Generator().manual_seed(seed)
    base = FrozenExperts(E, H, I)
    for e in range(E):
        for p, (o, i) in expert_shapes(base).items():
            base.set_weight(e, p, quantize_weight(torch.randn(o, i, generator=gen) / i**0.5, fmt))
    torch.manual_seed(seed)
    lora = LoRAExperts(base, R, SCALE, dropout)
    for b in lora.lora_B.values():
        b.data.normal_(0, 0.1, generator=gen)  # nonzero B, so the LoRA path shows up in every output
    return lora


def routing(seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen, dtype=dtype)
    idx = torch.stack([torch.randperm(ROUTED, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen, dtype=dtype)
    return x.requires_grad_(), idx, w.requires_grad_()


def dense_experts(lora, x, idx, w, a, b):
    """Every expert on every token with W_e = dequant(W_e) + s B_e A_e, weighted by its routing weight."""
    out = torch.zeros_like(x)
    for e in range(E):
        wt = {p: lora.base.weights[p][e].dequantize(x.dtype) + SCALE * b[p][e] @ a[p][e] for p in a}
        mlp = F.linear(F.silu(F.linear(x, wt["gate"])) * F.linear(x, wt["up"]), wt["down"])
        out = out + (w * (idx == e)).sum(-1, keepdim=True) * mlp
    return out


def leaf(t):
    return t.detach().clone().requires_grad_()


def check_against_dense(lora) -> tuple:
    """lora's output and its input, routing-weight and factor gradients within 1e-5 of dense_experts with the same
    factors (a factor held once, shared_outer's, expanded over the experts); returns (x, idx, w, out)."""
    x, idx, w = routing()
    out = lora(x, idx, w)
    xr, wr = leaf(x), leaf(w)
    a = {p: leaf(t) for p, t in lora.lora_A.items()}
    b = {p: leaf(t) for p, t in lora.lora_B.items()}
    expand = lambda d: {p: t.expand(E, *t.shape[1:]) for p, t in d.items()}  # noqa: E731
    ref = dense_experts(lora, xr, idx, wr, expand(a), expand(b))
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    assert rel(out, ref) < 1e-5
    assert rel(x.grad, xr.grad) < 1e-5 and rel(w.grad, wr.grad) < 1e-5
    for p in a:
        assert rel(lora.lora_A[p].grad, a[p].grad) < 1e-5, p
        assert rel(lora.lora_B[p].grad, b[p].grad) < 1e-5, p
    return x, idx, w, out


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_experts_equal_dense_reference(fmt):
    lora = make_experts(fmt)
    x, idx, w, out = check_against_dense(lora)
    for p in lora.lora_A:
        assert lora.lora_A[p].grad[ROUTED].abs().max() == 0 and lora.lora_B[p].grad[ROUTED].abs().max() == 0
    with torch.no_grad():  # the inference path (nothing saved) gives the same output
        assert torch.equal(lora(x, idx, w), out)


class NewBuffersOfShape(TorchDispatchMode):
    """Counts tensors of `shape` that ops return in storage none of their inputs had (fresh buffers)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and tuple(t.shape) == self.shape
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.count += 1
        return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_frozen_experts_accumulate_in_place_and_equal_dense_reference(fmt):
    """The frozen base allocates its [T, H] output once (no copy per routed expert), and its output and
    gradients to the input and routing weights equal every expert run densely (B = 0: W_e alone)."""
    lora = make_experts(fmt)
    x, idx, w = routing()
    with NewBuffersOfShape(x.shape) as fresh:
        out = lora.base(x, idx, w)
    assert fresh.count == 1  # was 5 (1 + one copy per routed expert, 4 here) with out = out.index_add(...)
    xr, wr = leaf(x), leaf(w)
    zero_b = {p: torch.zeros_like(t) for p, t in lora.lora_B.items()}
    ref = dense_experts(lora, xr, idx, wr, dict(lora.lora_A), zero_b)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    assert rel(out, ref) < 1e-5
    assert rel(x.grad, xr.grad) < 1e-5 and rel(w.grad, wr.grad) < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_linear_equals_dense_reference(fmt):
    gen = torch.Generator().manual_seed(3)
    base = FrozenLinear("attention", H, I)
    base.weight_q = quantize_weight(torch.randn(I, H, generator=gen) / H**0.5, fmt)
    lora = LoRALinear(base, R, SCALE)
    lora.lora_B.data.normal_(0, 0.1, generator=gen)
    x = torch.randn(3, 7, H, generator=gen, requires_grad=True)
    xr, a, b = leaf(x), leaf(lora.lora_A), leaf(lora.lora_B)
    out = lora(x)
    ref = F.linear(xr, base.weight_q.dequantize(torch.float32) + SCALE * b @ a)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert rel(out, ref) < 1e-5 and rel(x.grad, xr.grad) < 1e-5
    assert rel(lora.lora_A.grad, a.grad) < 1e-5 and rel(lora.lora_B.grad, b.grad) < 1e-5


def test_lora_linear_scales_the_rank_factor_with_the_same_bits():
    """s multiplies the [.., r] factor instead of the [.., out] product: with s a power of two (alpha / r = 2)
    the output and every gradient equal base(x) + s * (x A^T) B^T bit for bit."""
    gen = torch.Generator().manual_seed(5)
    base = FrozenLinear("attention", H, I)
    base.weight_q = quantize_weight(torch.randn(I, H, generator=gen) / H**0.5, "nf4")
    lora = LoRALinear(base, R, 2.0)
    lora.lora_B.data.normal_(0, 0.1, generator=gen)
    x = torch.randn(3, 7, H, generator=gen, requires_grad=True)
    xr, a, b = leaf(x), leaf(lora.lora_A), leaf(lora.lora_B)
    grad_out = torch.randn(3, 7, I, generator=gen)
    out = lora(x)
    ref = base(xr) + 2.0 * F.linear(F.linear(xr, a), b)
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, xr.grad)
    assert torch.equal(lora.lora_A.grad, a.grad) and torch.equal(lora.lora_B.grad, b.grad)


def test_fresh_adapters_leave_the_base_unchanged():
    """B starts at zero (PEFT): output equals the frozen module's exactly; A is PEFT's kaiming init."""
    lora = make_experts("nf4")
    for b in lora.lora_B.values():
        b.data.zero_()
    x, idx, w = routing()
    assert torch.equal(lora(x, idx, w), lora.base(x, idx, w))
    for p, (out_f, in_f) in expert_shapes(lora.base).items():
        bound = 1 / math.sqrt(in_f)  # kaiming_uniform(a=sqrt(5)) on [r, in]
        a = lora.lora_A[p].detach()
        assert a.shape == (E, R, in_f) and lora.lora_B[p].shape == (E, out_f, R)
        assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
        assert abs(a.std().item() - bound / math.sqrt(3)) < 0.1 * bound


def test_dropout_backward_matches_forward():
    """With dropout the custom backward redraws forward's masks from the seed: gradcheck in float64."""
    lora = make_experts("bf16")
    x, idx, w = routing(dtype=torch.float64)
    params = [leaf(t.double()) for t in lora.factors()]
    order, counts = group_tokens_by_expert(idx, E)

    def run(p, x, w, *factors):
        call = ExpertsCall(lora.base.weights, Routing(order, counts, K), SCALE, dropout=p, seed=1234)
        return GroupedLoRAExperts.apply(x, w, *factors, call)

    assert torch.autograd.gradcheck(lambda *args: run(0.3, *args), (x, w, *params), fast_mode=True)
    assert rel(run(0.3, x, w, *params), run(0.0, x, w, *params)) > 1e-3  # dropout does act on the LoRA path
    zero_b = [torch.zeros_like(t) if i % 2 else t for i, t in enumerate(params)]
    assert torch.equal(run(0.3, x, w, *zero_b), run(0.0, x, w, *zero_b))  # ...and only on the LoRA path


def test_bf16_activations_with_float32_adapters():
    """Training dtype: bf16 activations, float32 A/B (cast per expert); gradients land in float32."""
    lora = make_experts("nf4")
    x, idx, w = routing()
    a = {p: leaf(t) for p, t in lora.lora_A.items()}
    b = {p: leaf(t) for p, t in lora.lora_B.items()}
    ref = dense_experts(lora, leaf(x), idx, w.detach(), a, b)
    xb = leaf(x.to(torch.bfloat16))
    out = lora(xb, idx, w.detach())
    ref.sum().backward()
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and rel(out.float(), ref) < 2e-2
    for p in a:
        assert lora.lora_A[p].grad.dtype == torch.float32
        assert rel(lora.lora_A[p].grad, a[p].grad) < 3e-2 and rel(lora.lora_B[p].grad, b[p].grad) < 3e-2


def test_activation_checkpointing_gives_same_gradients():
    lora = make_experts("fp8", dropout=0.2).train()
    grads = []
    for use_checkpoint in (False, True):
        lora.zero_grad()
        x, idx, w = routing()
        torch.manual_seed(5)
        out = checkpoint(lora, x, idx, w, use_reentrant=False) if use_checkpoint else lora(x, idx, w)
        out.square().sum().backward()
        grads.append([x.grad, w.grad] + [p.grad.clone() for p in lora.parameters()])
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)


def test_unknown_target_is_named():
    with pytest.raises(ValueError, match=r"'q_c_proj'.*valid targets: q_proj, q_a_proj.*routed_experts"):
        LoRAConfig(targets=("q_a_proj", "q_c_proj"))


def test_scale_and_rslora():
    assert LoRAConfig(rank=16, alpha=32).scale == 2.0
    assert LoRAConfig(rank=16, alpha=32, use_rslora=True).scale == 8.0
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(rank=0)
