"""The loop with vLLM as the rollout engine over both workers, routed experts sharded over them with their LoRA
(rollout.engine_expert_parallel), through vLLM's own MoE-LoRA code on the CPU (the harness of
tests/vllm_moe_lora_cpu.py, switched on by run.imports in every process): recipes/dapo.py under torchrun, 2 ranks,
float32, routed experts unquantized on both sides, 3 DAPO steps.

TP2 x EP2 (one engine: attention split over the two ranks, each rank's prompts submitted by both) with the trainer's
experts sharded too (parallel.expert_parallel 2), and DP2 x EP2 (each rank its own prompts, allsync's fix of vLLM's
LoRA under DP) with the trainer's experts replicated (each rank serves its engine block's slices). At every step the
engine's logprobs of the sampled tokens equal the trainer's recomputed ones (after every adapter sync), and the final
greedy evaluation, served by vLLM, gives the torch engine's tokens on the exported adapter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.recipes.test_launchers import RECIPE

pytest.importorskip("vllm")

BF16 = {"routed_experts": "bf16", "shared_experts": "bf16", "attention": "bf16", "dense_mlp": "bf16"}
LOGPROB_ATOL = 1e-4  # float32 in another order of sums (vLLM's kernels, the trainer's)
MAX_NEW_TOKENS = 12


def loop_config(base: Path, out_dir: Path, tensor_parallel: int, trainer_ep: int) -> dict:
    return {
        "model": {"base": str(base), "compute_dtype": "float32", "quant": BF16},
        "lora": {
            "rank": 8,
            "alpha": 16,
            "targets": ["routed_experts"],
        },  # float32: vLLM's linear LoRA kernels refuse it
        "rollout": {
            "engine": "vllm",
            "engine_expert_parallel": True,
            "engine_tensor_parallel": tensor_parallel,
            "prompts_per_step": 8,
            "group_size": 4,
            "max_new_tokens": MAX_NEW_TOKENS,
        },
        "algorithm": {"dynamic_sampling": True, "max_sampling_rounds": 4, "on_sampling_cap": "partial"},
        "optim": {"lr": 1e-2},
        "parallel": {"workers_per_node": 2, "expert_parallel": trainer_ep},
        "task": {"min_digits": 1, "max_digits": 1, "train_size": 400, "heldout_size": 6},
        "run": {
            "out_dir": str(out_dir),
            "steps": 3,
            "eval_every": 3,
            "checkpoint_every": 3,
            "export": "peft",
            "imports": ["tests.vllm_moe_lora_cpu_on"],
        },
    }


def torchrun(config: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    return subprocess.run(
        [*command, str(RECIPE), "--config", str(config)], capture_output=True, text=True, timeout=1800, env=env
    )


def torch_engine_greedy(config: dict, out_dir: Path) -> list[str]:
    """The held-out problems answered greedily by the torch engine (our frozen base) with the exported adapter."""
    from transformers import AutoTokenizer

    from allsync.config import parse_config
    from allsync.engines.torch_engine import Sampling
    from allsync.run.evaluation import EvalArgs, make_eval_engine
    from allsync.tasks.problems import encode_prompt
    from moe_lora.adapter_io import read_adapter
    from quant.checkpoint_io import read_config

    run = parse_config({**config, "run": {k: v for k, v in config["run"].items() if k != "imports"}})
    base = run.model.base
    heldout = run.task.splits()[0].heldout
    tokenizer = AutoTokenizer.from_pretrained(base)
    args = EvalArgs(src="", base=base, data="", out="", plan=run.model.quant.plan(), device="cpu")
    engine = make_eval_engine(args, read_adapter(out_dir / "adapter", read_config(base)), tokenizer, heldout)
    rollout = engine.generate(
        [encode_prompt(tokenizer, p) for p in heldout], 1, Sampling(max_new_tokens=MAX_NEW_TOKENS, greedy=True)
    )
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in rollout.response_ids]


@pytest.fixture(scope="module")
def warm_five_experts(tmp_path_factory):
    """warm_tiny's start with 5 routed experts (one expert group): 3 and 2 on the engine's two ranks, as vLLM places
    experts that do not split evenly."""
    from dataclasses import replace

    from allsync.tasks import ArithmeticGenerator
    from allsync.warm_start import DEFAULT_SPEC, EvalSettings, TrainSettings, WarmStartSettings, warm_start

    settings = WarmStartSettings(
        replace(DEFAULT_SPEC, experts=5, n_group=1, topk_group=1),
        ArithmeticGenerator(1, 1),
        steps=60,
        train=TrainSettings(batch_size=32, lr=2e-3, warmup_steps=5),
        eval=EvalSettings(heldout_size=20, samples_per_problem=2, max_new_tokens=12),
    )
    return warm_start(tmp_path_factory.mktemp("five") / "warm", settings, progress=False)


@pytest.mark.slow  # two vLLM ranks under Triton's interpreter for 3 steps and 2 evaluations
@pytest.mark.vllm
@pytest.mark.parametrize(
    ("tensor_parallel", "trainer_ep", "model"),
    [(2, 2, "warm_tiny"), (1, 1, "warm_tiny"), (2, 1, "warm_five_experts")],
    ids=["tp2xep2", "dp2xep2", "tp2xep2-uneven"],
)
def test_vllm_with_expert_lora_over_both_ranks_matches_the_trainer_and_the_torch_engine(
    tensor_parallel, trainer_ep, model, request, tmp_path
):
    """tp2xep2-uneven: 5 experts, 3 and 2 a rank; vLLM 0.32 reads the second rank's expert LoRA at experts 2-3 of the
    adapter (engine_experts.vllm_lora_names): without allsync's naming the second rank's adapter (experts 3-4) fails
    vLLM's packing at the first sync (measured: `assert w1_lora is not None` in lora_weights.pack_moe), and a whole
    adapter is served 13.8 nats off (docs/vllm-dp-moe-lora.md)."""
    out = tmp_path / "run"
    config = loop_config(request.getfixturevalue(model), out, tensor_parallel, trainer_ep)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    done = torchrun(path)
    assert done.returncode == 0, done.stderr[-6000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "logprob_gap_max" in m]
    assert [m["step"] for m in trained] == [1, 2, 3]
    for m in trained:  # every step trains on samples of the adapter synced after the last one
        assert m["trained_samples"] > 0 and 0 < m["logprob_gap_max"] < LOGPROB_ATOL, m
    records = [json.loads(line) for line in (out / "eval" / "samples.jsonl").read_text().splitlines()]
    served = [r["response"] for r in sorted(records, key=lambda r: r["problem_id"])]
    assert served == torch_engine_greedy(config, out)
