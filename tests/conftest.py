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
    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny-fp8", TinySpec(seed=0, fp8=True))
