"""Issue 48: the torch engine's FP8 linears as DeepSeek-V3's FP8 GEMM (rollout.fp8_linear_kernel scaled_mm,
quant.formats.fp8_gemm).

The rows rounded per 1 x 128 to e4m3, the weight's 128 x 128 blocks as stored, the product accumulated in float32:
a row already on e4m3's grid multiplies exactly as its dequantized values do; the engine's forwards (prefill, live
and fixed-shape decode) use it and the trainer's never do; the config takes the setting or refuses it by name; on FP8 tensor cores torch's scaled_mm gives the CPU's numbers.
"""

import pytest
import torch

import quant.formats as formats
from allsync.config import ConfigError, parse_config
from allsync.engines.slots import FixedShapeStep, decode_in_slots
from allsync.engines.torch_engine import Sampling, TorchEngine
from moe_lora.lora import LoRAConfig, attach_lora
from moe_lora.mla_decode import install_mla_decode
from quant.formats import fp8_gemm, fp8_gemm_linears, fp8_rows_quantize, frozen_linear, quantize_weight
from quant.loader import QuantPlan, load_frozen_model
from tests.allsync.engines.test_rollout_trainer import E4M3_BOUNDARY, assert_same_rows, frequent_stop_token

PROMPTS = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]
FP8_LINEARS = QuantPlan(routed_experts="nf4", shared_experts="fp8", attention="fp8", dense_mlp="fp8")


def test_rows_on_e4m3s_grid_multiply_exactly_as_their_values():
    """x rounded per 1 x 128 block (a partial last block of 72 columns included): fp8_gemm(x) equals the float32
    product of the rounded rows and the dequantized weight, and fp8_gemm of the rounded rows gives the same (their
    scales come back unchanged); each rounded value within 2^-4 of its block's largest, and the product a few percent
    off x W^T."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 200, generator=gen)
    x[0, 1, 128:] = 0  # a block of zeros
    weight = quantize_weight(torch.randn(192, 200, generator=gen) * 0.02, "fp8")
    q, scales = fp8_rows_quantize(x.view(6, 200))
    assert q.shape == (6, 200) and scales.shape == (6, 2)
    back = q.float() * scales.repeat_interleave(128, dim=1)[:, :200]
    blocks = torch.nn.functional.pad(x.view(6, 200), (0, 56)).view(6, 2, 128)
    largest = blocks.abs().amax(-1).repeat_interleave(128, dim=1)[:, :200]
    assert bool(((back - x.view(6, 200)).abs() <= largest * 2**-4).all()) and not back[1, 128:].any()
    w = weight.dequantize(torch.float32)
    got = fp8_gemm(x, weight)
    assert got.shape == (2, 3, 192) and got.dtype == torch.float32
    torch.testing.assert_close(got.view(6, 192), back @ w.T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fp8_gemm(back, weight), back @ w.T, rtol=1e-6, atol=1e-6)
    error = float((got.view(6, 192) - x.view(6, 200) @ w.T).norm() / (x.view(6, 200) @ w.T).norm())
    assert 1e-3 < error < 0.06


def test_only_forwards_without_a_gradient_take_the_fp8_gemm_inside_the_block():
    """frozen_linear inside fp8_gemm_linears: no gradient to x -> fp8_gemm; x that needs one -> the trainer's
    dequantized product, bit for bit; a bf16 weight is untouched; the setting is restored after the block."""
    gen = torch.Generator().manual_seed(1)
    fp8 = quantize_weight(torch.randn(128, 256, generator=gen) * 0.02, "fp8")
    bf16 = quantize_weight(torch.randn(128, 256, generator=gen) * 0.02, "bf16")
    x = torch.randn(5, 256, generator=gen)
    trainer = frozen_linear(x, fp8)
    with fp8_gemm_linears():
        assert formats.FP8_GEMM_LINEARS
        engine = frozen_linear(x, fp8)
        trained = frozen_linear(x.clone().requires_grad_(), fp8)
        plain = frozen_linear(x, bf16)
    assert not formats.FP8_GEMM_LINEARS
    assert torch.equal(engine, fp8_gemm(x, fp8)) and not torch.equal(engine, trainer)
    assert torch.equal(trained.detach(), trainer) and torch.equal(plain, frozen_linear(x, bf16))


def fp8_model(path):
    """The tiny model with its attention, shared expert and dense MLP in FP8 (NF4 routed experts), LoRA on every
    target with random B, the MLA decode installed."""
    torch.manual_seed(0)
    model = load_frozen_model(path, FP8_LINEARS, compute_dtype=torch.float32, progress=False)
    attach_lora(model, LoRAConfig(rank=8, alpha=16))
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    install_mla_decode(model)
    return model.eval()


@pytest.fixture(scope="module")
def model(tiny_bf16):
    return fp8_model(tiny_bf16)


def record(model, rows, seeds, sampling, eos, fixed_step=None):
    out = decode_in_slots(model, rows, seeds, sampling, eos, 2, 3, False, fixed_step=fixed_step)
    return out.tokens, out.logprobs, out.reasons


def test_the_fixed_shape_step_with_fp8_gemms_samples_what_the_live_slots_sample(model):
    """12 rows in 3 slots ending at different steps, both decodes inside fp8_gemm_linears: the fixed-shape step (what a
    CUDA graph captures) gives the live-slot decode's tokens and reasons, logprobs within 5e-3 (the two differ by
    float32 noise, which now and then moves a value across an e4m3 rounding boundary: measured 3e-4 at most), a row
    parting from the other only at a near tie (seen on an AVX2-only CPU: a different token)."""
    rows = [p for p in PROMPTS for _ in range(4)]
    sampling = Sampling(temperature=1.0, max_new_tokens=12)
    eos = frequent_stop_token(model, PROMPTS, 4, sampling, seed=1)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    with fp8_gemm_linears():
        live = record(model, rows, seeds, sampling, eos)
        assert len({len(t) for t in live[0]}) >= 3
        assert_same_rows(record(model, rows, seeds, sampling, eos, FixedShapeStep), live, **E4M3_BOUNDARY, seeds=seeds)


def test_the_engine_multiplies_its_fp8_linears_as_fp8_gemms_only_with_scaled_mm(model, monkeypatch):
    """The same seeds through the engine with dequantize and with scaled_mm: every FP8 linear of its prefills and
    decode steps goes through fp8_gemm with scaled_mm and none with dequantize, the sampled rows' logprobs move (on
    this random model a rounded input now and then flips a token's routed experts: the gap is the mismatch
    benchmarks/sampler_mismatch.py measures on the trained one), and the engine leaves the setting as it found it."""
    calls = []
    monkeypatch.setattr(formats, "fp8_gemm", lambda x, w: calls.append(w.shape) or fp8_gemm(x, w))
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    out, counted = {}, {}
    for kernel in ("dequantize", "scaled_mm"):
        torch.manual_seed(3)
        calls.clear()
        engine = TorchEngine(model, eos_id=-1, pad_id=2, batch_size=4, fp8_linear_kernel=kernel)
        out[kernel] = engine.generate(PROMPTS, 2, sampling)
        counted[kernel] = len(calls)
        assert not formats.FP8_GEMM_LINEARS
    fp8_linears = sum(1 for m in model.modules() if getattr(getattr(m, "weight_q", None), "fmt", None) == "fp8")
    assert counted["dequantize"] == 0 and counted["scaled_mm"] >= fp8_linears * (1 + sampling.max_new_tokens)
    assert out["dequantize"].logprobs != out["scaled_mm"].logprobs
    with pytest.raises(ValueError, match="rollout.fp8_linear_kernel = 'int8'"):
        TorchEngine(model, eos_id=1, pad_id=2, fp8_linear_kernel="int8")


def test_fp8_linear_kernel_is_checked_naming_the_key(tiny_bf16):
    base = {"model": {"base": str(tiny_bf16), "quant": {"attention": "fp8"}}}
    assert (
        parse_config({**base, "rollout": {"fp8_linear_kernel": "scaled_mm"}}).rollout.fp8_linear_kernel == "scaled_mm"
    )
    with pytest.raises(ConfigError, match=r"rollout.fp8_linear_kernel = 'fp4': use dequantize or scaled_mm"):
        parse_config({**base, "rollout": {"fp8_linear_kernel": "fp4"}})
    with pytest.raises(ConfigError, match=r"rollout.fp8_linear_kernel scaled_mm with rollout.engine vllm"):
        parse_config({**base, "rollout": {"fp8_linear_kernel": "scaled_mm", "engine": "vllm"}})
    with pytest.raises(ConfigError, match=r"rollout.fp8_linear_kernel scaled_mm with rollout.merge_lora"):
        parse_config({**base, "rollout": {"fp8_linear_kernel": "scaled_mm", "merge_lora": True}})
    with pytest.raises(ConfigError, match=r"holds none of attention, shared_experts, dense_mlp in fp8 \(model.quant\)"):
        parse_config({"model": {"base": str(tiny_bf16)}, "rollout": {"fp8_linear_kernel": "scaled_mm"}})


CUDA_FP8 = torch.cuda.is_available() and formats.block_scaled_fp8_gemm_on()


@pytest.mark.skipif(not CUDA_FP8, reason="needs FP8 tensor cores and scaled_mm with block scales")
@pytest.mark.parametrize("rows", [1, 30, 256])
def test_torch_scaled_mm_gives_the_cpus_numbers(rows):
    """On FP8 tensor cores fp8_gemm runs torch's scaled_mm (V3's q_a_proj shape, bf16 rows): within bf16's rounding
    of the float32 computation the CPU runs (the same rounded rows and weight, another order of summation)."""
    gen = torch.Generator().manual_seed(0)
    weight = quantize_weight(torch.randn(1536, 7168, generator=gen) * 0.02, "fp8")
    x = torch.randn(rows, 7168, generator=gen).to(torch.bfloat16)
    want = fp8_gemm(x.float(), weight)  # CPU, float32: the numbers by definition
    on_gpu = formats.QuantizedWeight("fp8", weight.shape, weight.data.cuda(), weight.scale.cuda())
    assert formats.fp8_gemm_on_tensor_cores(x.cuda(), on_gpu)
    got = fp8_gemm(x.cuda(), on_gpu).float().cpu()
    assert float((got - want).norm() / want.norm()) < 1e-2
