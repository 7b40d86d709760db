"""Issue 48 lever 3: the torch engine's KV slots in FP8 (rollout.kv_cache_dtype fp8, moe_lora.kv_caches.FP8LatentLayer).

The latent's c_s in float8_e4m3fn with a float32 scale per 128 values, k_rope as computed: each value within e4m3's
rounding of its group's scale; 656 bytes a token and layer at DeepSeek-V3's latent width in bf16; the fixed-shape
step (CUDA graphs) decodes what the live slots decode and reads nothing on the host; rows kept across calls
(T-PPO's windows) carry their stored bytes unchanged; the engine and the config take the setting or refuse it by name.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from allsync.config import ConfigError, parse_config
from allsync.engines.slots import FixedShapeStep, decode_in_slots
from allsync.engines.torch_engine import Sampling, TorchEngine
from moe_lora.kv_caches import FP8LatentLayer, LatentKVCache, SlotKVCache, fp8_dequantize, fp8_quantize
from tests.allsync.engines.test_decode_graphs import lora_model
from tests.allsync.engines.test_rollout_trainer import E4M3_BOUNDARY, assert_same_rows, frequent_stop_token

PROMPTS = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]


def test_each_value_is_rounded_within_e4m3s_precision_of_its_group():
    """|x - q a| <= 2^-4 |x| + 2^-10 a per value (3 mantissa bits; subnormals below 2^-6 a step of 2^-9), groups of
    very different magnitudes scaled apart, a group of zeros kept at zero."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 512, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 0.0]).repeat_interleave(128)
    quantized, scales = fp8_quantize(x, 128)
    assert quantized.dtype == torch.float8_e4m3fn and scales.shape == (5, 3, 4) and scales.dtype == torch.float32
    back = fp8_dequantize(quantized, scales, 128, torch.float32)
    bound = 2**-4 * x.abs() + 2**-10 * scales.repeat_interleave(128, dim=-1)
    assert bool(((back - x).abs() <= bound).all()) and not back[..., 384:].any()
    assert float((back - x).abs().max()) > 0  # rounded, not stored exactly


def latent_pool(model, slots: int, fp8: bool, with_source: bool = False):
    """A pool of `slots` slots, the first three filled from a latent prefill of two prompts (lengths 5, 3, 5) (and
    that prefill's cache)."""
    ids = torch.tensor([[0, 95, 80, 73, 11], [0, 41, 86, 2, 2]])
    cache = LatentKVCache(reserve=0)
    with torch.no_grad():
        model.model(input_ids=ids, position_ids=torch.arange(5)[None].expand_as(ids), past_key_values=cache)
    pool = SlotKVCache(slots, 32, model.config.kv_lora_rank if fp8 else None)
    pool.fill(0, cache, torch.tensor([0, 1, 0]), torch.tensor([5, 3, 5]))
    return (pool, cache) if with_source else pool


def test_a_position_takes_656_bytes_a_layer_at_deepseek_v3s_latent_width(tiny_bf16):
    """The tiny model keeps V3's kv_lora_rank 512 and d_rope 64: in bfloat16 a slot's position is 512 FP8 values, 4
    float32 scales and 64 bf16 rotary values (656 bytes) against 576 x 2 = 1,152."""
    model = lora_model(tiny_bf16, "nf4", dtype=torch.bfloat16)
    per_position = {}
    for fp8 in (False, True):
        pool = latent_pool(model, 4, fp8)
        layer = pool.layers[0]
        assert isinstance(layer, FP8LatentLayer) == fp8
        per_position[fp8] = sum(b.element_size() * b.shape[1] * b.shape[-1] for b in layer.buffers)
    assert per_position == {False: 1152, True: 656}
    pool, source = latent_pool(model, 4, True, with_source=True)
    latent, values = pool.layers[0].read(3, 5)  # what attention reads: c dequantized, k_rope as computed
    want = source.layers[0].keys[torch.tensor([0, 1, 0])].float()
    assert latent.dtype == torch.bfloat16 and latent.shape == (3, 1, 5, 576) and values.shape == (3, 1, 5, 0)
    assert torch.equal(latent[..., 512:].float(), want[..., 512:])
    error = (latent[..., :512].float() - want[..., :512]).abs()
    assert 0 < float(error.max()) <= float(2**-4 * want[..., :512].abs().max() + 1e-3)


def record(model, rows, seeds, sampling, eos, fixed_step=None, fp8=True):
    out = decode_in_slots(
        model, rows, seeds, sampling, eos, 2, 3, False, fixed_step=fixed_step, fp8_rank=512 if fp8 else None
    )
    return out.tokens, out.logprobs, out.reasons


@pytest.fixture(scope="module")
def model(tiny_bf16):
    return lora_model(tiny_bf16, "nf4")


def test_fixed_shape_steps_over_an_fp8_cache_sample_what_the_live_slots_sample(model):
    """12 rows in 3 slots ending at different steps over the FP8 cache: the fixed-shape step (what a CUDA graph
    captures) gives the live-slot decode's tokens and finish reasons, logprobs within float32 noise, which may move a
    quantized value across an e4m3 rounding boundary (E4M3_BOUNDARY), and a row may part at a near tie."""
    rows = [p for p in PROMPTS for _ in range(4)]
    sampling = Sampling(temperature=1.0, max_new_tokens=12)
    eos = frequent_stop_token(model, PROMPTS, 4, sampling, seed=1)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    live = record(model, rows, seeds, sampling, eos)
    assert len({len(t) for t in live[0]}) >= 3
    assert_same_rows(record(model, rows, seeds, sampling, eos, FixedShapeStep), live, **E4M3_BOUNDARY, seeds=seeds)


def test_the_fp8_cache_moves_the_logprobs_by_its_rounding(model):
    """The same seeds over the latent cache in float32 and the FP8 one: every row starts with the same tokens and
    the logprobs of the common prefix differ (the rounding reaches the sampler) by a mean within 0.2 nats on this
    random tiny model (measured 0.03-0.07; the trained default model's gap is in BENCHMARKS.md)."""
    rows = [p for p in PROMPTS for _ in range(8)]
    sampling = Sampling(temperature=1.0, max_new_tokens=16)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    exact, rounded = (record(model, rows, seeds, sampling, -1, fp8=fp8) for fp8 in (False, True))
    gaps = []
    for a, b, la, lb in zip(exact[0], rounded[0], exact[1], rounded[1]):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert common >= 1
        gaps += [abs(x - y) for x, y in zip(la[:common], lb[:common])]
    assert 1e-4 < sum(gaps) / len(gaps) < 0.2


def test_the_fp8_step_reads_nothing_on_the_host(tiny_bf16):
    """The fixed-shape step over an FP8 pool runs on fake tensors (quantizing the new position and reading the cache
    back are device operations), in bfloat16 as on a GPU."""
    model = lora_model(tiny_bf16, "nf4", dtype=torch.bfloat16)
    pool = latent_pool(model, 4, fp8=True)
    step = FixedShapeStep(model, pool, Sampling(temperature=1.0, max_new_tokens=8))
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        tokens, _ = step(
            torch.tensor([5, 6, 7, 2]), torch.tensor([1, 1, 1, 0]), torch.arange(4), torch.zeros(4).long(), 16
        )
    assert tokens.shape == (4,)


def test_kept_rows_carry_their_fp8_bytes_into_the_next_call(model):
    """generate(keep=True) with the FP8 cache: rows cut at their limit continue from their slots without a prefill, and
    a saved row restored into a new pool holds exactly the stored bytes (quantized values, scales, rotary part)."""
    engine = TorchEngine(model, eos_id=1, pad_id=2, batch_size=3, kv_cache_dtype="fp8")
    assert engine.kv_fp8_rank == 512 and not engine.expanded_kv
    window = Sampling(temperature=1.0, max_new_tokens=4)
    torch.manual_seed(0)
    first = engine.generate(PROMPTS, 2, window, keep=True)
    continued = [p + r for p, r in zip(first.prompt_ids, first.response_ids)]
    saved = next(iter(engine.kept.rows.values()))[0]
    before = engine.positions
    engine.generate(continued, 1, window, keep=True)
    assert engine.positions - before == 6 * 4  # decode steps only
    pool = SlotKVCache(2, 32, 512)
    pool.restore(1, [saved])
    assert all(
        torch.equal(b[1, :, : saved.length].view(torch.uint8), part.view(torch.uint8))
        for layer, parts in zip(pool.layers, saved.buffers)
        for b, part in zip(layer.buffers, parts)
    )
    assert [b.dtype for b in pool.layers[0].buffers] == [torch.float8_e4m3fn, torch.float32, torch.float32]


def test_kv_cache_dtype_is_checked_naming_the_key(tiny_bf16):
    base = {"model": {"base": str(tiny_bf16)}}
    assert parse_config({**base, "rollout": {"kv_cache_dtype": "fp8"}}).rollout.kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_dtype = 'int4': use auto"):
        parse_config({**base, "rollout": {"kv_cache_dtype": "int4"}})
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_dtype fp8 with rollout.engine vllm"):
        parse_config({**base, "rollout": {"kv_cache_dtype": "fp8", "engine": "vllm"}})
