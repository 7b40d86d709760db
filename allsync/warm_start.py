"""Supervised warm start: teach a tiny DeepSeek-V3 the task's format and part of its skill before RL.

    path = warm_start("runs/tiny-base", WarmStartSettings(seed=1))   # cached: the same settings again return at once

Steps: build a random tiny checkpoint (`moe_lora.tiny.make_tiny`), load it in transformers (fp32),
train ALL weights with AdamW on chat-formatted (prompt, "Answer: N") pairs with the loss on the answer
tokens only, round the weights to bf16, evaluate greedy and temperature-1 accuracy on the held-out split,
and write a checkpoint in DeepSeek-V3's on-disk format (per-expert keys, sharded safetensors + index,
config, tokenizer) plus `warm_start.json` (settings and measured metrics). The output is written
atomically; an existing output with the same settings is reused, one with other settings is refused.

Learning rate: linear warm-up then cosine decay to 10%,
    lr(s) = lr * min(1, (s+1)/warmup) * (0.1 + 0.9 * 0.5 * (1 + cos(pi * s / steps))).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from allsync.config.model import DEFAULT_SPEC, WARM_START_STEPS
from allsync.tasks import ArithmeticGenerator, Problem, WarmStartTask
from evals.generation import EvalSettings, evaluate_model
from moe_lora.tiny import TinySpec, make_tiny
from quant.checkpoint_io import atomic_output_dir, split_into_shards, write_shards
from quant.layout import expected_tensors

SETTINGS_FILE = "warm_start.json"
IGNORE_INDEX = -100
DEFAULT_TASK = ArithmeticGenerator(min_digits=2, max_digits=2, ops=("+",))  # 10..99 + 10..99
DEFAULT_STEPS = WARM_START_STEPS


@dataclass(frozen=True)
class TrainSettings:
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # torch intra-op threads while training and evaluating. CPU kernels split some reductions by thread count,
    # so the weights depend on it (1 and 2 threads: 21 of the bf16 weights differ after 40 steps, and the
    # held-out avg@4 of the 750-step base is 25.6% and 26.6%). Fixed, so that every launcher builds the same
    # base (torchrun sets OMP_NUM_THREADS=1, a Ray controller has the machine's cores).
    threads: int = 2


@dataclass(frozen=True)
class WarmStartSettings:
    model: TinySpec = DEFAULT_SPEC
    task: WarmStartTask = DEFAULT_TASK  # the task's spec (allsync.tasks.registry): splits, teacher, held-out prompts
    steps: int = DEFAULT_STEPS
    seed: int = 0
    train: TrainSettings = field(default_factory=TrainSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)

    @property
    def train_size(self) -> int:
        """steps * batch_size i.i.d. draws (a problem may repeat; a held-out one never appears)."""
        return self.steps * self.train.batch_size

    def as_json(self) -> dict:
        """The settings as stored beside a base (tuples as lists, as they come back from disk). A task setting
        added after bases were built (LATER_DEFAULTS) is left out at its default, which trains what
        bases did before it existed, so those bases stay valid."""
        return without_later_defaults(json.loads(json.dumps(asdict(self))))


# settings added after bases were built, per section of the stored settings, at the default that trains what bases
# did before them
LATER_DEFAULTS = {
    "task": {"reasoning": "none", "reads_notes": False, "context": "segments"},
    "model": {"max_position_embeddings": 4096},
}


def without_later_defaults(settings: dict) -> dict:
    """`settings` (as_json's layout) less the settings added after bases were built, where they hold the default
    that trains what bases did before (LATER_DEFAULTS): bases of every allsync version compare alike."""
    out = dict(settings)
    for section, later in LATER_DEFAULTS.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if later.get(k, object()) != v}
    return out


def check_fits_context(examples: list[tuple[list[int], int]], max_position_embeddings: int) -> None:
    """A supervised example longer than the model's context (prompt + reply + eos) would train positions the model
    refuses everywhere else (allsync.tasks.model_len_needed): ValueError naming the longest and the setting."""
    longest = max((len(ids) for ids, _ in examples), default=0)
    if longest > max_position_embeddings:
        raise ValueError(
            f"warm start: a teacher example of {longest} tokens is longer than the model's max_position_embeddings "
            f"({max_position_embeddings}, model.warm_start_shape.max_position_embeddings): the task's prompts do not "
            "fit one context (multi-conversation reads them in segments: producer.kind multiconv)"
        )


# ------------------------------------------------------------------------------------------ data
def collate(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; labels are the answer tokens (incl. eos), IGNORE_INDEX elsewhere.

    transformers shifts labels inside the model: position t's logits are scored on labels[t+1].
    """
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for i, (ids, start) in enumerate(examples):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)], attention_mask[i, : len(ids)] = t, 1
        labels[i, start : len(ids)] = t[start:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ------------------------------------------------------------------------------------------ training
def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of lr (formula in the module docstring)."""
    ramp = min(1.0, (step + 1) / max(warmup, 1))
    return lr * ramp * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * step / max(steps, 1))))


def train_steps(model, examples, settings: WarmStartSettings, pad_id: int, progress: bool = True) -> list[float]:
    """`settings.steps` AdamW steps over consecutive batches of `examples`; returns the loss per step."""
    from tqdm.auto import tqdm

    t = settings.train
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.98))
    model.train()
    losses = []
    bar = tqdm(range(settings.steps), desc="warm start", unit="step", disable=not progress)
    for step in bar:
        batch = collate(examples[step * t.batch_size : (step + 1) * t.batch_size], pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings.steps, t.lr, t.warmup_steps)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    model.eval()
    return losses


@torch.no_grad()
def round_to_bf16_(model) -> None:
    """Round every float weight to bf16 in place (kept in its dtype), except the fp32 router bias."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not name.endswith("e_score_correction_bias") and "rotary_emb" not in name:
            t.copy_(t.to(torch.bfloat16).to(t.dtype))


# ------------------------------------------------------------------------------------------ on-disk format
def to_disk_tensors(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict -> DeepSeek-V3's on-disk tensors, in `expected_tensors` order.

    Fused experts split per expert: gate_up_proj[e] = cat(gate_e, up_e) ([2I, H]), down_proj[e] = down_e
    ([H, I]). Weights are bf16, the router's e_score_correction_bias float32. The key set must equal
    `expected_tensors(config)` and every shape must match it.
    """
    tensors: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if "rotary_emb" in key:
            continue
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = key[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                tensors[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key[: -len("down_proj")]
            for e in range(t.shape[0]):
                tensors[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            tensors[key] = t
    specs = expected_tensors(config)
    if set(tensors) != set(specs):
        extra, missing = sorted(set(tensors) - set(specs)), sorted(set(specs) - set(tensors))
        raise ValueError(f"state dict does not match the DeepSeek-V3 layout: extra {extra[:3]}, missing {missing[:3]}")
    out = {}
    for key, spec in specs.items():
        t = tensors[key]
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{key}: shape {tuple(t.shape)}, the layout expects {spec.shape}")
        dtype = torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16
        out[key] = t.detach().to(dtype).contiguous().clone()
    return out


def save_checkpoint(out_tmp: Path, model, base_dir: Path, shards: int, report: dict) -> None:
    """Write shards + index, and copy config, generation config and tokenizer files from the base."""
    config = json.loads((base_dir / "config.json").read_text())
    write_shards(out_tmp, split_into_shards(to_disk_tensors(model.state_dict(), config), shards))
    for f in base_dir.iterdir():
        if f.suffix == ".json" and not f.name.startswith("model.safetensors"):
            shutil.copy(f, out_tmp / f.name)
    (out_tmp / SETTINGS_FILE).write_text(json.dumps(report, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ evaluation
def evaluate(
    model, tokenizer, problems: list[Problem], prompts: list[list[int]], settings: EvalSettings, seed: int = 0
) -> dict:
    """evals.generation.evaluate_model on the task's held-out prompts; examples carry their problems' prompts."""
    report = evaluate_model(model, tokenizer, prompts, [p.answer for p in problems], settings, seed)
    for example, p in zip(report["greedy_examples"], problems):
        example["prompt"] = p.prompt
    return report


# ------------------------------------------------------------------------------------------ entry point
@contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to n inside, restored after. In a process where vLLM's CPU worker ran,
    torch.set_num_threads is vLLM's no-op (its threads are bound to cores): the count cannot change, so say so
    rather than compute at another count than the settings name (a base that may differ in its last bits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    if torch.get_num_threads() != n:
        warnings.warn(
            f"torch threads stay {torch.get_num_threads()} (asked for {n}): torch.set_num_threads is disabled "
            "in this process (vLLM's CPU worker binds its threads), so the result may differ bitwise from a "
            f"run at {n} threads",
            RuntimeWarning,
            stacklevel=3,
        )
    try:
        yield
    finally:
        torch.set_num_threads(before)


def settings_differences(stored, wanted, prefix: str = "") -> list[str]:
    """`key: stored -> wanted` for every (dotted) setting that differs; a missing side reads as None."""
    if not isinstance(stored, dict) or not isinstance(wanted, dict):
        return [] if stored == wanted else [f"{prefix or 'settings'}: {stored!r} -> {wanted!r}"]
    return [
        line
        for key in sorted(set(stored) | set(wanted), key=str)
        for line in settings_differences(stored.get(key), wanted.get(key), f"{prefix}.{key}" if prefix else str(key))
    ]


def cached_report(out: Path, settings: WarmStartSettings) -> dict | None:
    """The stored report when `out` holds a warm start with these settings; raises when it holds another,
    naming the settings that differ (a base built for another seed holds other held-out problems)."""
    path = out / SETTINGS_FILE
    if not out.exists() or not any(out.iterdir()):
        return None
    stored = json.loads(path.read_text()) if path.exists() else {}
    saved = stored.get("settings")
    differences = settings_differences(
        without_later_defaults(saved) if isinstance(saved, dict) else saved, settings.as_json()
    )
    if differences:
        raise FileExistsError(
            f"{out} exists but is not a warm start with these settings (stored -> wanted: "
            f"{'; '.join(differences[:4])}); use another directory or overwrite=True"
        )
    return stored


@dataclass
class WarmStartResult:
    model: object  # transformers' DeepseekV3ForCausalLM, fp32 weights rounded to bf16 values, eval mode
    tokenizer: object
    report: dict


def train_and_evaluate(settings: WarmStartSettings, base: Path, progress: bool = True) -> WarmStartResult:
    """Load the random base in transformers (fp32), train all weights, round them to bf16, evaluate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    task = settings.task
    splits = task.splits(settings.train_size, settings.eval.heldout_size, settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    examples = task.teacher_examples(tokenizer, splits.train, settings.seed)
    check_fits_context(examples, settings.model.max_position_embeddings)
    losses = train_steps(model, examples, settings, tokenizer.pad_token_id, progress)
    train_s = time.time() - start
    round_to_bf16_(model)
    metrics = evaluate(
        model, tokenizer, splits.heldout, task.heldout_prompts(tokenizer, splits.heldout), settings.eval, settings.seed
    )
    report = {
        "settings": settings.as_json(),
        "train_seconds": round(train_s, 1),
        "eval_seconds": round(time.time() - start - train_s, 1),
        "final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1),
        "heldout": metrics,
    }
    return WarmStartResult(model, tokenizer, report)


def settings_for_run(config) -> WarmStartSettings:
    """The warm start an RL run (`allsync.config.RunConfig`) builds its base with: supervised on the run's own
    task and split with the run's `task.seed`, so that the problems RL holds out are never warm-start training
    data (the task's splits draw the held-out problems first, from the seed alone)."""
    from dataclasses import replace

    agent = config.producer if config.producer.uses_tools else None  # the tool calls the task teaches
    spec = replace(DEFAULT_SPEC, **config.model.warm_start_shape)
    if agent is not None:
        spec = replace(spec, tool_tokens=True)  # V3's tool-call tokens
    evaluation = EvalSettings(heldout_size=config.task.heldout_size)
    if (budget := config.task.eval_reply_tokens(config.rollout.max_new_tokens)) is not None:  # longer replies
        evaluation = replace(evaluation, max_new_tokens=budget)
    return WarmStartSettings(
        spec,
        config.task.warm_start_task(agent),
        steps=config.model.warm_start_steps,
        seed=config.task.seed,
        eval=evaluation,
    )


def warm_start(
    out_dir: str | os.PathLike = "runs/tiny-base",
    settings: WarmStartSettings = WarmStartSettings(),
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Train (or reuse) the warm-started checkpoint at `out_dir`; returns its path."""
    if settings.model.fp8:
        raise ValueError("warm_start trains from and writes a bf16 checkpoint; use a TinySpec with fp8=False")
    out = Path(out_dir)
    if not overwrite and cached_report(out, settings) is not None:
        return out
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp, atomic_output_dir(out, overwrite=True) as out_tmp:
        base = make_tiny(Path(tmp) / "base", settings.model)
        with torch_threads(settings.train.threads):
            result = train_and_evaluate(settings, base, progress)
        result.report["total_seconds"] = round(time.time() - start, 1)
        save_checkpoint(out_tmp, result.model, base, settings.model.shards, result.report)
    return out
