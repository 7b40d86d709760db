"""Issue 46 item 5: the torch engine's decode step in fixed shapes, what a CUDA graph captures (allsync/engines/graphs.py).

On CPU: the fixed-shape experts equal the host-routed kernels; a decode in fixed-shape steps samples what the decode
of the live slots samples (tokens, logprobs, finish reasons, recorded routing); the step reads nothing on the host
(it runs on fake tensors, which have no data, where the live-slot step cannot) and makes the same operations on
tensors of the same shapes whatever the rows, lengths and routing. On a GPU: the captured graphs replay exactly what
the fixed-shape step computes eagerly.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from allsync.engines.slots import FixedShapeStep, decode_forward, decode_in_slots, span_bucket
from allsync.engines.torch_engine import Sampling, TorchEngine, sample_routing
from moe_lora.lora import LoRAConfig, adapters_disabled, attach_lora
from moe_lora.lora_layers import LoRAExperts, LoRALinear
from moe_lora.kv_caches import ExpandedKVCache, SlotKVCache
from moe_lora.mla_decode import install_mla_decode
from moe_lora.routing import recording
from quant.fixed_shape_experts import fixed_shape_experts
from quant.loader import QuantPlan, load_frozen_model
from tests.allsync.engines.test_rollout_trainer import FLOAT32_NOISE, assert_same_rows, frequent_stop_token


def lora_model(path, experts: str, dtype=torch.float32, layout: str = "per_expert", device="cpu"):
    """The tiny model with routed experts in `experts`, LoRA on every target with random B (a fresh adapter would
    leave every LoRA term zero), the MLA decode installed. Its A factors are drawn after torch.manual_seed(0), so the
    model does not depend on which tests ran before."""
    torch.manual_seed(0)
    model = load_frozen_model(
        path, QuantPlan(routed_experts=experts), compute_dtype=dtype, progress=False, device=device
    )
    attach_lora(model, LoRAConfig(rank=8, alpha=16, expert_layout=layout))
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        for b in [m.lora_B] if isinstance(m, LoRALinear) else m.lora_B.values() if isinstance(m, LoRAExperts) else []:
            b.data.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    install_mla_decode(model)
    return model.eval()


@pytest.fixture(scope="module")
def model(tiny_bf16):
    return lora_model(tiny_bf16, "nf4")


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("experts", ["bf16", "nf4", "fp8"])
def test_fixed_shape_experts_equal_the_host_routed_kernels(tiny_bf16, experts, layout):
    """out_t = sum_j w_tj mlp_e(x_t) with every expert held dequantized and grouped_mm offsets computed on the device:
    what the loop kernel computes, with the adapter and without (to float32 rounding)."""
    model = lora_model(tiny_bf16, experts, layout=layout)
    layer = next(m for m in model.modules() if isinstance(m, LoRAExperts))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, layer.base.hidden_size, generator=gen)
    index = torch.stack([torch.randperm(layer.num_experts, generator=gen)[:2] for _ in range(37)])
    index[:5] = 3  # one expert crowded, most lightly used, some unused (8 experts, 2 a token)
    index[:5, 1] = 0
    weights = torch.rand(37, 2, generator=gen)
    with torch.no_grad():
        want = layer.local_forward(x, index, weights)
        got = fixed_shape_experts(x, index, weights, layer.base.weights, layer.factors(), layer.scale)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        frozen = fixed_shape_experts(x, index, weights, layer.base.weights)
        torch.testing.assert_close(frozen, layer.base.local_forward(x, index, weights), atol=2e-6, rtol=1e-5)
        assert (got - frozen).abs().max() > 1e-3  # the adapter takes part


def test_span_buckets_cover_every_length_with_little_overshoot():
    """A fixed-shape step attends to span_bucket(n) >= n positions: fewer than max(64, n / 8) more, never more than
    the capacity; 8 spans a doubling past 512 (a CUDA graph each)."""
    capacity = 21_504
    spans = {n: span_bucket(n, capacity) for n in range(1, capacity + 1)}
    assert all(n <= s <= capacity and s - n < max(64, n / 8) for n, s in spans.items())
    assert span_bucket(capacity, capacity) == capacity and span_bucket(1, 50) == 50
    assert len(set(spans.values())) == 8 + 8 * 5 + 3  # 64..512 by 64, 8 a doubling to 16,384, then 18,432 .. 21,504


def record_decode(model, rows, seeds, sampling, eos, slots, expanded, fixed_step=None, fp8_rank=None, pages=None):
    """decode_in_slots under a routing record: (tokens, logprobs, reasons) and each row's recorded routing."""
    with recording(model) as record:
        out = decode_in_slots(
            model,
            rows,
            seeds,
            sampling,
            eos,
            2,
            slots,
            expanded,
            None,
            lambda: len(record),
            fixed_step,
            fp8_rank=fp8_rank,
            pages=pages,
        )
    return (out.tokens, out.logprobs, out.reasons), sample_routing(record, rows, out)


@pytest.mark.parametrize("expanded", [True, False])
def test_fixed_shape_steps_sample_what_the_live_slots_sample(model, expanded):
    """12 rows of 3 prompts in 3 slots, ending at different steps (slots freed, moved and refilled, free slots in
    the fixed-shape steps): the same tokens, finish reasons and recorded experts, logprobs within float32 noise,
    with the expanded and with the latent cache."""
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]
    rows = [p for p in prompts for _ in range(4)]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    eos = frequent_stop_token(model, prompts, 4, sampling, seed=1)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    live, live_routing = record_decode(model, rows, seeds, sampling, eos, 3, expanded)
    fixed, fixed_routing = record_decode(model, rows, seeds, sampling, eos, 3, expanded, FixedShapeStep)
    assert len({len(t) for t in live[0]}) >= 3  # rows end at different steps
    assert_same_rows(fixed, live, **FLOAT32_NOISE)
    assert all(torch.equal(a, b) for a, b in zip(fixed_routing, live_routing))


class OpTrace(TorchDispatchMode):
    """Every operation on tensors inside: (its name, the shapes it returned)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


def filled_pool(model, slots: int) -> SlotKVCache:
    """A pool of `slots` slots, the first three filled from a prefill of two prompts (lengths 5, 3, 5)."""
    ids = torch.tensor([[0, 95, 80, 73, 11], [0, 41, 86, 2, 2]])
    cache = ExpandedKVCache(reserve=0)
    with torch.no_grad():
        model.model(input_ids=ids, position_ids=torch.arange(5)[None].expand_as(ids), past_key_values=cache)
    pool = SlotKVCache(slots, 32)
    pool.fill(0, cache, torch.tensor([0, 1, 0]), torch.tensor([5, 3, 5]))
    return pool


@pytest.mark.parametrize("experts", ["bf16", "nf4", "fp8"])
def test_the_fixed_shape_step_reads_nothing_on_the_host_and_keeps_its_shapes(tiny_bf16, experts):
    """What a CUDA graph needs of a step, checked on CPU in bfloat16 (what torch's CUDA grouped_mm takes):
    - it runs on fake tensors (torch's FakeTensorMode: shapes without data), so no operation of it reads a value on the
      host (item, tolist, nonzero, a bincount's size); the live-slot step, which reads the routing, cannot;
    - two steps at the same span, with other live rows, lengths, tokens and so routing, make the same operations on
      tensors of the same shapes."""
    model = lora_model(tiny_bf16, experts, dtype=torch.bfloat16)
    pool = filled_pool(model, 4)
    step = FixedShapeStep(model, pool, Sampling(temperature=1.0, max_new_tokens=8))
    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.long)
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        tokens, logprobs = step(torch.tensor([5, 6, 7, 2]), torch.tensor([1, 1, 1, 0]), seeds, steps, 16)
    assert tokens.shape == logprobs.shape == (4,)
    host_reads = (DataDependentOutputException, DynamicOutputShapeException)
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(host_reads):
        decode_forward(model, pool, torch.tensor([5, 6, 7]), 5)
    traces = []
    for last, live in (([5, 6, 7, 2], [1, 1, 1, 0]), ([9, 2, 2, 2], [1, 0, 0, 0])):
        inputs = (torch.tensor(last), torch.tensor(live), seeds, steps)
        with torch.no_grad(), OpTrace() as trace:
            step(*inputs, 16)
        traces.append(trace.ops)
    assert traces[0] == traces[1] and len(traces[0]) > 500
    assert not {op for op, _ in traces[0]} & {"aten._local_scalar_dense.default", "aten.nonzero.default"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cache", ["expanded", "latent", "fp8", "paged"])
def test_captured_graphs_replay_the_fixed_shape_step(tiny_bf16, cache):
    """On a GPU in bfloat16: TorchEngine(decode_graphs=True) replays CUDA graphs of the fixed-shape step: the same tokens,
    logprobs and recorded routing as the fixed-shape step run eagerly (the same kernels), bit for bit; with the
    adapters and without; and close to the live-slot step (another summation order in bfloat16). With the expanded
    cache, the latent one, the latent one in FP8 (rollout.kv_cache_dtype), and the latent one in pages of 64
    positions read through the slots' block table (rollout.kv_cache_tokens: 4 pages for 3 slots)."""
    from allsync.engines.graphs import GraphedStep

    expanded, fp8_rank = cache == "expanded", 512 if cache == "fp8" else None
    pages = 4 if cache == "paged" else None
    model = lora_model(tiny_bf16, "nf4", dtype=torch.bfloat16, device="cuda")
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]
    rows = [p for p in prompts for _ in range(4)]
    sampling = Sampling(temperature=1.0, max_new_tokens=40)
    seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(1))
    for disabled in (False, True):
        with adapters_disabled(model) if disabled else torch.no_grad():
            eager, eager_routing = record_decode(
                model, rows, seeds, sampling, 1, 3, expanded, FixedShapeStep, fp8_rank, pages
            )
            captured = {}

            def graphed(m, pool, s, record=None):
                captured["step"] = GraphedStep(FixedShapeStep(m, pool, s), record)
                return captured["step"]

            with recording(model) as record:
                out = decode_in_slots(
                    model,
                    rows,
                    seeds,
                    sampling,
                    1,
                    2,
                    3,
                    expanded,
                    None,
                    lambda: len(record),
                    lambda m, p, s: graphed(m, p, s, record),
                    fp8_rank=fp8_rank,
                    pages=pages,
                )
            assert len(captured["step"].graphs) >= 1
            assert (out.tokens, out.logprobs, out.reasons) == eager
            assert all(torch.equal(a, b) for a, b in zip(sample_routing(record, rows, out), eager_routing))
            live, _ = record_decode(model, rows, seeds, sampling, 1, 3, expanded, fp8_rank=fp8_rank, pages=pages)
            same = sum(a == b for a, b in zip(live[0], eager[0]))
            assert same >= len(rows) // 2, (same, len(rows))
    engine = TorchEngine(model, eos_id=1, pad_id=2, batch_size=3, decode_graphs=True)
    torch.manual_seed(0)
    rollout = engine.generate(prompts, 4, sampling)
    assert len(rollout) == 12 and all(len(r) >= 1 for r in rollout.response_ids)


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_fixed_shape_steps_under_expert_parallelism_sample_what_one_process_samples(tiny_bf16):
    """EP 2 over gloo (each rank holds 4 of the 8 experts; the fixed-shape exchange gathers both ranks' tokens and
    sends each its experts' shares back): each rank's rows, decoded in lockstep in fixed-shape steps, equal one process
    holding every expert (tokens, finish reasons; logprobs within float32 noise), and so do the live-slot lockstep and
    fixed-shape steps over a paged pool that admits two rows at a time (rollout.kv_cache_tokens); also when one rank
    has no rows at all (it serves the other's steps with free slots only)."""
    import torch.multiprocessing as mp

    from allsync.launch.group import free_port
    from tests.ep_ranks import lora_model as ep_lora_model
    from tests.ep_ranks import run_decode_rank

    model = ep_lora_model(tiny_bf16, "nf4")
    install_mla_decode(model)
    model.eval()
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90], [0, 7, 7]]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    eos = frequent_stop_token(model, prompts, 4, sampling, seed=1)
    gen = torch.Generator().manual_seed(2)
    cases = []
    for per_rank in ([prompts[0]] * 3 + [prompts[1]] * 2, [prompts[2]] * 2), ([prompts[1]] * 4, []):
        cases.append((list(per_rank), [torch.randint(0, 2**62, (len(r),), generator=gen) for r in per_rank]))
    with mp.Manager() as manager:
        results = manager.dict()
        address = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(run_decode_rank, args=(2, address, str(tiny_bf16), "nf4", cases, sampling, eos, results), nprocs=2)
        got = dict(results)
    for i, (rows, seeds) in enumerate(cases):
        for rank in range(2):
            out = decode_in_slots(model, rows[rank], seeds[rank], sampling, eos, 2, 3, True)
            want = (out.tokens, out.logprobs, out.reasons)
            for fixed in (False, True, "paged"):
                assert_same_rows(got[(rank, i, fixed)], want, **FLOAT32_NOISE)
    lengths = {len(t) for (_, _, fixed), (tokens, _, _) in got.items() if fixed is True for t in tokens}
    assert len(lengths) >= 2, lengths  # rows end at different steps
