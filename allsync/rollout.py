"""Rollout engines behind one interface.

    engine.generate(prompts, n, sampling) -> Rollout   (token ids, logprobs, finish reasons, adapter version)
    engine.load_adapter(tensors, version)

`TorchEngine` generates with the training model itself (transformers' generate with its KV cache): the
frozen base is shared with the trainer, so a sync only bumps the version. It is the reference and the
fallback. `VLLMEngine` lives in allsync/vllm_engine.py.

Logprobs are those of the sampling distribution at temperature T: log softmax(logits / T) of the
chosen token (top_p = 1), the quantity the trainer recomputes to check engine/trainer agreement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False


@dataclass
class Rollout:
    """n samples per prompt, sample i belongs to prompt i // n (its group)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" (eos) or "length"
    adapter_version: int
    group_index: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch of left-padded ids and its attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def cut_at_eos(tokens: list[int], eos_id: int) -> tuple[list[int], str]:
    """Response tokens up to and including the first eos ("stop"), else all of them ("length").

    generate() pads only after an eos, so a row without eos has no padding.
    """
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1], "stop"
    return tokens, "length"


class TorchEngine:
    """Generation with the training model (shared frozen base and LoRA tensors)."""

    def __init__(self, model, eos_id: int, pad_id: int, batch_size: int = 64):
        self.model, self.eos_id, self.pad_id, self.batch_size = model, eos_id, pad_id, batch_size
        self.adapter_version = 0

    def load_adapter(self, tensors: dict[str, torch.Tensor] | None, version: int) -> int:
        """The engine is the trainer's model: its LoRA tensors are already current; returns bytes moved (0)."""
        self.adapter_version = version
        return 0

    def release_memory(self) -> None:
        """Nothing to hand to the trainer between phases: the engine is the trainer's model (no KV cache kept)."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> Rollout:
        expanded = [p for p in prompts for _ in range(n)]
        responses, logprobs, reasons = [], [], []
        was_training = self.model.training
        self.model.eval()
        for start in range(0, len(expanded), self.batch_size):
            chunk = expanded[start : start + self.batch_size]
            r, lp, fr = self._generate_batch(chunk, sampling)
            responses += r
            logprobs += lp
            reasons += fr
        self.model.train(was_training)
        return Rollout(expanded, responses, logprobs, reasons, self.adapter_version, [i // n for i in range(len(expanded))])

    def _generate_batch(self, prompts: list[list[int]], s: Sampling):
        ids, mask = left_pad(prompts, self.pad_id)
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=s.max_new_tokens,
            do_sample=not s.greedy, temperature=None if s.greedy else s.temperature,
            top_p=None if s.greedy else s.top_p, top_k=None,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        new_tokens = out.sequences[:, ids.shape[1] :]
        temperature = 1.0 if s.greedy else s.temperature
        step_logprobs = torch.stack([torch.log_softmax(l.float() / temperature, -1) for l in out.logits], dim=1)
        chosen = step_logprobs.gather(-1, new_tokens[:, : step_logprobs.shape[1], None]).squeeze(-1)
        responses, logprobs, reasons = [], [], []
        for row, lp in zip(new_tokens.tolist(), chosen.tolist()):
            tokens, reason = cut_at_eos(row, self.eos_id)
            responses.append(tokens)
            logprobs.append(lp[: len(tokens)])
            reasons.append(reason)
        return responses, logprobs, reasons
