"""The default run against TRL's GRPOTrainer (PEFT LoRA) in the same wall-clock minutes, from the same base.

    python -m benchmarks.trl_side_by_side [--out runs/bench-trl] [--minutes M] [--allsync-steps 600]

1. The warm-started base of recipes/configs/tiny_cpu.yaml (runs/tiny-base, built if missing).
2. allsync: `python recipes/dapo.py --out-dir OUT/allsync` as the README starts it (two Ray workers, one thread
   each, the default config's steps). Its wall time, launch to exit with the base cached, is the budget W
   (`--minutes` instead: no allsync run, only TRL for M minutes).
3. TRL's GRPOTrainer in one process with 2 threads (the same 2 cores), W seconds from the start of its training
   (its start-up is not counted). Everything the two can share is the default config's: the prompts (the chat
   template's text, checked token for token), the reward (`arithmetic` plus DAPO's soft overlong punishment),
   groups of 4, 64 prompts a step, one on-policy update a step, lr 1.5e-3, AdamW betas (0.9, 0.99), clip
   0.2 / 0.28, the token-level loss (TRL's loss_type "dapo"), no KL, gradient clipping at 1.0, temperature 1,
   16 new tokens, float32. LoRA r 8, alpha 16 on the same modules (attention, dense MLP, shared experts; the
   routed experts through PEFT's `target_parameters`, PEFT's way for transformers' fused expert tensors).
   What TRL does not have, it does without: dynamic sampling (it trains every group, equal rewards included)
   and the NF4 frozen experts (its base is float32).
4. The base, allsync's adapter and TRL's, each evaluated by `allsync eval` with the same settings: the 200
   held-out problems neither trained on, 4 samples each at temperature 1, top-p 1, 16 new tokens, seed 0; the
   routed experts in NF4 (as allsync trained them) and in bf16 (as TRL trained them).

The last line:

    TRL side by side (W min): allsync +X points, TRL +Y points (R x TRL's gain); samples/s A vs B (S x)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
# PEFT's module names for the default config's lora.targets (the router `mlp.gate` is no Linear: never a target)
TRL_TARGET_MODULES = r".*\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|gate_proj|up_proj|down_proj)$"
TRL_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FORMATS = ("nf4", "bf16")


def default_config():
    from allsync.config import load_config

    return load_config(DEFAULT_CONFIG)


def shaped_reward(config, completions: list[str], completion_ids: list[list[int]], answer: list[str]) -> list[float]:
    """The default run's reward of each completion: the task's score plus the shapers the config turns on, through the
    worker's own list (allsync.run.scoring.reward_shapings), with lengths counted eos included, as the torch engine counts
    them. No group ids: a config with the group length reward is refused by that shaper."""
    import torch

    from allsync.algorithms import get
    from allsync.run.scoring import reward_shapings
    from evals.rewards import is_correct_score, score

    scores = [score(config.reward.name, text, truth) for text, truth in zip(completions, answer)]
    shaped = torch.tensor(scores, dtype=torch.float64)
    lengths = torch.tensor([len(ids) for ids in completion_ids])
    correct = torch.tensor([is_correct_score(config.reward.name, value) for value in scores])
    for name, settings in reward_shapings(config):
        shaped += get("reward_shaping", name)(lengths, correct, None, settings)
    return shaped.tolist()


def trl_prompts(tokenizer, problems) -> list[str]:
    """Each problem as the text of the chat template allsync encodes (TRL tokenizes plain-string prompts as they
    are); refuses if re-tokenizing the text does not give allsync's prompt ids."""
    from allsync.tasks import encode_prompt

    texts = []
    for p in problems:
        ids = encode_prompt(tokenizer, p)
        text = tokenizer.decode(ids)
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        if again != ids:
            raise RuntimeError(f"prompt {p.prompt!r}: TRL would see {again}, allsync {ids}")
        texts.append(text)
    return texts


def trl_grpo_config(config, out_dir: Path, threads: int):
    """The default config's settings in TRL's GRPOConfig (one process on the CPU, float32)."""
    from trl import GRPOConfig

    r, a, o = config.rollout, config.algorithm, config.optim
    samples = r.prompts_per_step * r.group_size
    return GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        num_generations=r.group_size,
        per_device_train_batch_size=samples // o.minibatches,
        gradient_accumulation_steps=1,
        steps_per_generation=o.minibatches,
        num_iterations=1,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=1.0,
        learning_rate=o.lr,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=o.warmup_steps,
        beta=0.0,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=10**6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=config.run.seed,
        dataloader_num_workers=0,
        use_vllm=False,
        disable_tqdm=True,
    )


def peft_model(model, config):
    """PEFT LoRA on the modules allsync adapts (r, alpha of the default config).

    PEFT 0.21 on transformers 5 rewrites a target ending in gate_proj / up_proj / down_proj into the fused routed
    experts for DeepSeek-V3 (its v4-to-v5 MoE mapping), so the dense MLP and the shared experts could not be
    adapted and the experts would be adapted twice, at double rank. That mapping is turned off while the
    adapter is made: the dense MLP and shared experts get LoRA as Linear modules, the routed experts through
    `target_parameters`, each once."""
    from unittest import mock

    from peft import LoraConfig, get_peft_model
    from peft.utils import transformers_weight_conversion

    lora = LoraConfig(
        r=config.lora.rank,
        lora_alpha=config.lora.alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=TRL_TARGET_MODULES,
        target_parameters=TRL_TARGET_PARAMETERS,
        task_type="CAUSAL_LM",
    )
    with mock.patch.dict(transformers_weight_conversion._MOE_TARGET_MODULE_MAPPING, clear=True):
        wrapped = get_peft_model(model, lora)
    adapted = {name.rsplit(".lora_", 1)[0] for name, _ in wrapped.named_parameters() if ".lora_A." in name}
    wanted = {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "o_proj",
        "mlp.gate_proj",
        "shared_experts.down_proj",
        "mlp.experts",
    }
    missing = [w for w in wanted if not any(w in name for name in adapted)]
    if missing:
        raise RuntimeError(f"PEFT adapted {sorted(adapted)}: none of {missing}")
    return wrapped


def run_trl(config, base: Path, out_dir: Path, seconds: float, threads: int = 2) -> dict:
    """TRL's GRPOTrainer for `seconds` of training from `base`; writes the zero adapter (the base) and the trained
    one, and returns steps, samples and seconds."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    problems = config.task.splits()[0].train
    data = Dataset.from_dict({"prompt": trl_prompts(tokenizer, problems), "answer": [p.answer for p in problems]})

    def reward(prompts, completions, completion_ids, answer, **_):
        return shaped_reward(config, completions, completion_ids, answer)

    class WallClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.start
            if self.seconds >= seconds:
                control.should_training_stop = True

    clock = WallClock()
    trainer = GRPOTrainer(
        model=peft_model(model, config),
        reward_funcs=reward,
        train_dataset=data,
        args=trl_grpo_config(config, out_dir / "trainer", threads),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # a dict printed per step; the numbers are kept in trainer.state
    trainer.model.save_pretrained(out_dir / "zero-adapter")  # B = 0: the base itself, through the same evaluator
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    trainer.model.save_pretrained(out_dir / "adapter")
    steps = trainer.state.global_step
    history = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "steps": steps,
        "seconds": clock.seconds,
        "samples": steps * config.rollout.prompts_per_step * config.rollout.group_size,
        "trainable_parameters": trainable,
        "reward_first_50": mean([h["reward"] for h in history[:50]]),
        "reward_last_50": mean([h["reward"] for h in history[-50:]]),
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_allsync(config, out_dir: Path, steps: int | None) -> dict:
    """The default run as the README starts it; its wall time and what its metrics say it generated."""
    from math import prod

    from safetensors import safe_open

    command = [sys.executable, "recipes/dapo.py", "--out-dir", str(out_dir)] + (
        ["--steps", str(steps)] if steps else []
    )
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if "groups_generated" in r]
    generated = sum(r["groups_generated"] for r in steps_rows) * config.rollout.group_size
    with safe_open(out_dir / "adapter" / "adapter_model.safetensors", "pt") as f:
        trainable = sum(prod(f.get_slice(k).get_shape()) for k in f.keys())
    return {
        "steps": len(steps_rows),
        "seconds": seconds,
        "samples": generated,
        "trainable_parameters": trainable,
        "reward_first_50": mean([r["reward"] for r in steps_rows[:50]]),
        "reward_last_50": mean([r["reward"] for r in steps_rows[-50:]]),
    }


def heldout_accuracy(adapter: Path, base: Path, data: Path, routed_experts: str, out: Path) -> float:
    """avg@4 of `allsync eval` on the held-out problems (the default run's evaluation settings)."""
    subprocess.run(
        [
            "allsync",
            "eval",
            str(adapter),
            "--base",
            str(base),
            "--data",
            str(data),
            "--n",
            "4",
            "--temperature",
            "1.0",
            "--top-p",
            "1.0",
            "--max-new-tokens",
            "16",
            "--reward",
            "arithmetic",
            "--seed",
            "0",
            "--routed-experts",
            routed_experts,
            "--out",
            str(out),
            "--overwrite",
        ],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads((out / "summary.json").read_text())["avg@4"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench-trl")
    parser.add_argument(
        "--minutes", type=float, help="TRL's budget (default: the allsync run's wall time; no allsync run)"
    )
    parser.add_argument("--allsync-steps", type=int, help="override the default config's run.steps")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from allsync.tasks import save_jsonl
    from allsync.warm_start import settings_for_run, warm_start
    from quant.checkpoint_io import atomic_write_text

    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = default_config()
    base = (ROOT / config.model.base).resolve()
    warm_start(base, settings_for_run(config))
    heldout = save_jsonl(config.task.splits()[0].heldout, out / "heldout.jsonl")

    result: dict = {"cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    if args.minutes is None:
        result["allsync"] = run_allsync(config, out / "allsync", args.allsync_steps)
        atomic_write_text(out / "result.json", json.dumps(result, indent=1))  # each part as soon as it is measured
        budget = result["allsync"]["seconds"]
    else:
        budget = args.minutes * 60
    result["trl"] = run_trl(config, base, out / "trl", budget)
    atomic_write_text(out / "result.json", json.dumps(result, indent=1))
    adapters = {"base": out / "trl" / "zero-adapter", "trl": out / "trl" / "adapter"}
    if "allsync" in result:
        adapters["allsync"] = out / "allsync" / "adapter"
    for fmt in FORMATS:
        result[f"heldout_{fmt}"] = {
            name: heldout_accuracy(path, base, heldout, fmt, out / "eval" / f"{name}-{fmt}")
            for name, path in adapters.items()
        }
    atomic_write_text(out / "result.json", json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if "allsync" in result:
        print(summary_line(result))
    return result


def summary_line(result: dict) -> str:
    acc = result["heldout_nf4"]
    ours, theirs = acc["allsync"] - acc["base"], acc["trl"] - acc["base"]
    rate_ours = result["allsync"]["samples"] / result["allsync"]["seconds"]
    rate_theirs = result["trl"]["samples"] / result["trl"]["seconds"]
    return (
        f"TRL side by side ({result['allsync']['seconds'] / 60:.1f} min): allsync {100 * ours:+.1f} points, TRL "
        f"{100 * theirs:+.1f} points ({ours / theirs if theirs else float('inf'):.2f}x TRL's gain); samples/s "
        f"{rate_ours:.0f} vs {rate_theirs:.0f} ({rate_ours / rate_theirs:.2f}x)"
    )


if __name__ == "__main__":
    main()
