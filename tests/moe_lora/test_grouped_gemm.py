"""The grouped_mm routed-expert kernel (moe_lora.grouped_gemm) against the per-expert loop it replaces on GPUs."""

import pytest
import torch

from allsync.config import ConfigError, RunConfig, validate
from moe_lora.grouped_gemm import call_chunks, chunk_rows, chunks, grouped_mm_supported
from moe_lora.grouped_lora import ExpertsCall, Routing
from moe_lora.lora import LoRAConfig
from quant.formats import FORMATS, quantize_weight
from quant.modules import group_tokens_by_expert
from tests.moe_lora.test_moe_lora import ROUTED, T, H, make_experts, rel, routing


def run(fmt, kernel, dtype=torch.float32, rank_seed=0, idx=None):
    """Output, input / routing-weight gradients and the six factor gradients of one kernel (idx: the
    routing's expert ids instead of the random ones)."""
    lora = make_experts(fmt, seed=rank_seed)
    lora.kernel = kernel
    x, random_idx, w = routing(dtype=dtype)
    idx = random_idx if idx is None else idx
    out = lora(x, idx, w)
    (out.float() * torch.randn(T, H, generator=torch.Generator().manual_seed(2))).sum().backward()
    with torch.no_grad():
        inference = lora(x, idx, w)
    return lora, [out.detach(), x.grad, w.grad] + [p.grad for p in lora.adapter_parameters()], inference


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_mm_equals_loop_in_float32(fmt):
    """Every output and gradient within 1e-6 of the loop's, for every frozen format; expert 4 gets no token,
    so its factor gradients are exact zeros; the no-grad path gives the training path's output."""
    _, want, _ = run(fmt, "loop")
    lora, got, inference = run(fmt, "grouped_mm")
    names = ["out", "dx", "dw"] + [f"{p}.{ab}" for p in ("gate", "up", "down") for ab in ("A", "B")]
    for name, g, r in zip(names, got, want):
        assert rel(g, r) < 1e-6, (name, rel(g, r))
    for grad in got[3:]:
        assert grad.dtype == torch.float32 and grad[ROUTED].abs().max() == 0
    assert torch.equal(inference, got[0])


def test_grouped_mm_chunk_with_several_experts_and_an_idle_one():
    """Rows per expert [4, 0, 4, 20, 20] with chunks of at most min(T, 4 N / E) = 24 rows: experts 0-2 share one chunk
    (expert 1, inside it, gets no row), experts 3 and 4 have more rows than a chunk and are one each."""
    idx = torch.tensor([[0, 2]] * 4 + [[3, 4]] * (T - 4))
    _, counts = group_tokens_by_expert(idx, 5)
    assert [(c.first, c.end, len(c.groups)) for c in chunks(counts, chunk_rows(T, 2 * T, 5), torch.device("cpu"))] == [
        (0, 3, 2),
        (3, 4, 1),
        (4, 5, 1),
    ]
    _, want, _ = run("nf4", "loop", idx=idx)
    _, got, _ = run("nf4", "grouped_mm", idx=idx)
    for g, r in zip(got, want):
        assert rel(g, r) < 1e-6
    for grad in got[3:]:
        assert grad[1].abs().max() == 0


def test_a_decode_shaped_call_without_backward_makes_chunks_of_t_rows_and_the_same_output():
    """4 tokens to 2 of 16 experts (a decode step's shape: few rows per expert): the forward that keeps tensors for
    backward makes chunks of min(T, 4 N / E) = 2 rows, the no-grad forward chunks of T = 4 rows (fewer calls), and
    both give the loop's output."""
    from moe_lora.lora_layers import LoRAExperts, expert_shapes
    from quant.modules import FrozenExperts

    experts, tokens, k, hidden, inter = 16, 4, 2, 128, 64
    gen = torch.Generator().manual_seed(3)
    base = FrozenExperts(experts, hidden, inter)
    for e in range(experts):
        for p, (o, n) in expert_shapes(base).items():
            base.set_weight(e, p, quantize_weight(torch.randn(o, n, generator=gen) / n**0.5, "fp8"))
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    x, w = torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, k, generator=gen)
    _, counts = group_tokens_by_expert(idx, experts)
    call = ExpertsCall(None, Routing(None, counts, k), 2.0, 0.0, 0)
    training, inference = call_chunks(call, x), call_chunks(call, x, keep_saved=False)
    assert max(c.stop - c.start for c in training) == 2 and max(c.stop - c.start for c in inference) <= tokens
    assert len(inference) < len(training)
    outputs = {}
    for kernel in ("loop", "grouped_mm"):
        torch.manual_seed(0)  # the same A factors for both kernels
        lora = LoRAExperts(base, 4, 2.0, kernel=kernel)
        for b in lora.lora_B.values():
            b.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            outputs[kernel] = lora(x, idx, w)
        outputs[kernel + " with grad"] = lora(x.requires_grad_(), idx, w).detach()
    assert rel(outputs["grouped_mm"], outputs["loop"]) < 1e-6
    assert rel(outputs["grouped_mm"], outputs["grouped_mm with grad"]) < 1e-6


def test_grouped_mm_in_bfloat16_matches_loop():
    """bf16 activations, float32 adapters (rank 4 here: 8 bytes, not aligned in bf16 -> use a rank-8 copy)."""
    results = []
    for kernel in ("loop", "grouped_mm"):
        lora = make_experts("nf4")
        lora.kernel = kernel
        lora.rank = 8
        for p in ("gate", "up", "down"):  # widen to rank 8: zero-padded A/B give the same function
            a, b = lora.lora_A[p].data, lora.lora_B[p].data
            lora.lora_A[p] = torch.nn.Parameter(torch.cat([a, torch.randn_like(a) * 0.01], 1))
            lora.lora_B[p] = torch.nn.Parameter(torch.cat([b, torch.zeros_like(b)], 2))
        x, idx, w = routing()
        xb = x.detach().to(torch.bfloat16).requires_grad_()
        out = lora(xb, idx, w.detach())
        out.float().square().sum().backward()
        results.append([out.float(), xb.grad.float()] + [p.grad for p in lora.adapter_parameters()])
    for g, r in zip(*results):
        assert rel(g, r) < 2e-2


def test_auto_picks_the_loop_on_cpu_and_alignment_rules():
    lora = make_experts("bf16")
    x = torch.zeros(2, H)
    assert not lora.uses_grouped_mm(x, 0.0)  # auto: grouped_mm only on GPUs
    lora.kernel = "grouped_mm"
    assert lora.uses_grouped_mm(x, 0.0)
    assert grouped_mm_supported(torch.float32, 4) and not grouped_mm_supported(torch.bfloat16, 4)
    assert grouped_mm_supported(torch.bfloat16, 8, 16, 7168, 2048) and not grouped_mm_supported(torch.bfloat16, 8, 36)


def test_chunks_of_consecutive_experts():
    """Experts packed in order while their rows fit (one expert with more rows is a chunk of its own); chunks
    without rows are left out; offsets are relative to the chunk's first row."""
    idx = torch.tensor([[2, 0], [0, 3], [2, 3], [5, 3], [3, 2]])
    _, counts = group_tokens_by_expert(idx, 7)
    assert counts == [2, 0, 3, 4, 0, 1, 0]
    got = [
        (c.first, c.end, c.start, c.stop, c.groups, c.offsets.tolist()) for c in chunks(counts, 5, torch.device("cpu"))
    ]
    assert got == [
        (0, 3, 0, 5, [(0, 0, 2), (2, 2, 5)], [2, 2, 5]),
        (3, 7, 5, 10, [(3, 5, 9), (5, 9, 10)], [4, 4, 5, 5]),
    ]
    assert [c.stop - c.start for c in chunks([9, 1], 4, torch.device("cpu"))] == [9, 1]


def test_refusals():
    with pytest.raises(ValueError, match="unknown routed-expert kernel 'cutlass'"):
        LoRAConfig(expert_kernel="cutlass")
    with pytest.raises(ValueError, match="grouped_mm routed-expert kernel has no dropout"):
        LoRAConfig(expert_kernel="grouped_mm", dropout=0.1)
    c = RunConfig()
    c.lora.expert_kernel = "fused"
    with pytest.raises(ConfigError, match="lora.expert_kernel = 'fused'"):
        validate(c)
    c.lora.expert_kernel, c.lora.rank, c.model.compute_dtype = "grouped_mm", 12, "bfloat16"
    with pytest.raises(
        ConfigError, match="lora.expert_kernel = grouped_mm with lora.rank 12 in model.compute_dtype bfloat16"
    ):
        validate(c)
    c.lora.rank, c.model.compute_dtype, c.parallel.device = 8, "float32", "cuda"
    with pytest.raises(ConfigError, match="lora.expert_kernel = grouped_mm with model.compute_dtype float32 on cuda"):
        validate(c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (BENCHMARKS.md: GPU checks)")
@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nf4"])
def test_on_cuda_auto_picks_grouped_mm_and_equals_the_loop(fmt, layout):
    """On a GPU, bf16 activations, rank 16: `auto` runs grouped_mm (bitsandbytes' CUDA kernels for nf4), and its
    output and every gradient are within bf16 rounding of the loop's, in both expert layouts (shared_outer's shared
    factors arrive expanded, stride 0, and are made contiguous for grouped_mm). 64 experts, 32 rows each on average:
    chunks of about 4 experts, expert 30 (inside a chunk) gets no row. In float32 `auto` runs the loop (torch's CUDA
    grouped_mm takes bfloat16)."""
    from moe_lora.lora_layers import LoRAExperts, expert_shapes
    from quant.modules import FrozenExperts

    e, h, i, t, k, r, idle = 64, 256, 128, 512, 4, 16, 30
    gen = torch.Generator().manual_seed(0)
    base = FrozenExperts(e, h, i)
    for x in range(e):
        for p, (o, n) in expert_shapes(base).items():
            base.set_weight(x, p, quantize_weight((torch.randn(o, n, generator=gen) / n**0.5).cuda(), fmt))
    x = torch.randn(t, h, generator=gen).cuda()
    idx = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])
    idx = (idx + (idx >= idle).long()).cuda()  # experts 0..63 but 30
    w = torch.rand(t, k, generator=gen).cuda()
    grad_out = torch.randn(t, h, generator=gen).cuda()
    lora = LoRAExperts(base, r, 2.0)
    assert not lora.uses_grouped_mm(x, 0.0) and lora.uses_grouped_mm(x.bfloat16(), 0.0)
    _, counts = group_tokens_by_expert(idx, e)
    groups = [len(c.groups) for c in call_chunks(ExpertsCall(None, Routing(None, counts, k), 2.0, 0.0, 0), x)]
    assert max(groups) >= 3 and counts[idle] == 0
    for dtype, tol in ((torch.bfloat16, 3e-2),):
        results = []
        for kernel in ("loop", "auto"):
            torch.manual_seed(1)
            lora = LoRAExperts(base, r, 2.0, kernel=kernel, layout=layout)
            for b in lora.lora_B.values():
                b.data.normal_(0, 0.1)
            assert lora.uses_grouped_mm(x.to(dtype), 0.0) == (kernel == "auto")
            xd, wd = x.to(dtype).requires_grad_(), w.clone().requires_grad_()
            out = lora(xd, idx, wd)
            (out.float() * grad_out).sum().backward()
            results.append([out.float(), xd.grad.float(), wd.grad] + [q.grad for q in lora.adapter_parameters()])
            assert all(q.grad[idle].abs().max() == 0 for q in lora.per_expert_parameters())
        for got, want in zip(results[1], results[0]):
            assert rel(got, want) < tol, (fmt, dtype, rel(got, want))
