"""Rollout engine and trainer pieces on the tiny model: logprobs agree, masks line up, updates are exact."""

import pytest
import torch

from allsync.rollout import Sampling, TorchEngine, cut_at_eos, left_pad
from allsync.trainer import build_sequences, forward_logprobs, scatter_response_values
from quant.loader import QuantPlan, load_frozen_model


@pytest.fixture(scope="module")
def model(tiny_bf16):
    return load_frozen_model(tiny_bf16, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32, progress=False)


def test_cut_at_eos_and_left_pad():
    assert cut_at_eos([5, 6, 1, 2, 2], eos_id=1) == ([5, 6, 1], "stop")
    assert cut_at_eos([5, 6, 7], eos_id=1) == ([5, 6, 7], "length")
    ids, mask = left_pad([[7, 8, 9], [4]], pad_id=2)
    assert ids.tolist() == [[7, 8, 9], [2, 2, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_sequence_masks_line_up_with_response_tokens():
    batch = build_sequences([[0, 5, 6], [0, 7]], [[10, 11], [12, 13, 1]], pad_id=2)
    assert batch.input_ids.tolist() == [[0, 5, 6, 10, 11], [0, 7, 12, 13, 1]]
    # position t predicts token t+1: response tokens are predicted at 2,3 (row 0) and 1,2,3 (row 1)
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    placed = scatter_response_values([[-1.0, -2.0], [-3.0, -4.0, -5.0]], batch)
    assert placed.tolist() == [[0, 0, -1, -2], [0, -3, -4, -5]]
    short = build_sequences([[0, 5]], [[9]], pad_id=2).select([0])
    assert short.input_ids.tolist() == [[0, 5, 9]] and short.attention_mask.tolist() == [[1, 1, 1]]


def test_engine_logprobs_equal_trainer_logprobs(model):
    engine = TorchEngine(model, eos_id=1, pad_id=2)
    prompts = [[0, 95, 80, 73], [0, 41, 86, 91, 95, 77, 90]]  # different lengths: left padding in the engine
    torch.manual_seed(0)
    rollout = engine.generate(prompts, n=3, sampling=Sampling(temperature=0.7, max_new_tokens=6))
    assert rollout.group_index == [0, 0, 0, 1, 1, 1] and rollout.adapter_version == 0
    batch = build_sequences(rollout.prompt_ids, rollout.response_ids, pad_id=2)  # right padding in the trainer
    with torch.no_grad():
        trainer, _ = forward_logprobs(model, batch, temperature=0.7)
    engine_lp = scatter_response_values(rollout.logprobs, batch)
    assert ((engine_lp - trainer).abs() * batch.response_mask).max() < 1e-4


def test_greedy_generation_is_the_argmax_path(model):
    engine = TorchEngine(model, eos_id=1, pad_id=2)
    rollout = engine.generate([[0, 95, 80, 73]], n=1, sampling=Sampling(max_new_tokens=5, greedy=True))
    seq = [0, 95, 80, 73]
    for _ in range(5):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        if seq[-1] == 1:
            break
    assert rollout.response_ids[0] == seq[4:]
