"""Rollout engines behind one interface.

    engine.generate(prompts, n, sampling) -> Rollout   (token ids, logprobs, finish reasons, adapter version)
    engine.load_adapter(tensors, version)

`TorchEngine` generates with the training model itself (transformers' generate with its KV cache): the
frozen base is shared with the trainer, so a sync only bumps the version. It is the reference and the
fallback. `VLLMEngine` lives in allsync/vllm_engine.py.

Logprobs are those of the sampling distribution at temperature T: log softmax(logits / T) of the
chosen token (top_p = 1), the quantity the trainer recomputes to check engine/trainer agreement.

The torch engine computes them while it generates (`StepLogprobs`, a logits processor): at no time does
it hold more than one step's [B, V] scores, where keeping every step's logits (`output_logits`) would
hold [B, L, V] (about 10 GB per sequence at V = 129,280 and 20k tokens).

Under expert parallelism (`lockstep`: the workers' allsync.distributed.Groups) every rank's MoE layers
exchange tokens, so every rank must run every decode step: the ranks agree on the number of generate calls
(the largest count any rank needs; a rank without prompts of its own generates from a one-token dummy
prompt, under a forked RNG so that its sampling stream is the one it would have had), and transformers'
`synced_gpus` keeps a rank whose rows are done decoding until every rank is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from evals.generation import cut_at_eos, left_pad
from moe_lora.mla_decode import ExpandedKVCache, expanded_cache_fits, install_expanded_cache


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


class TorchEngine:
    """Generation with the training model (shared frozen base and LoRA tensors)."""

    def __init__(self, model, eos_id: int, pad_id: int, batch_size: int = 64, lockstep=None):
        self.model, self.eos_id, self.pad_id, self.batch_size = model, eos_id, pad_id, batch_size
        self.lockstep = lockstep
        self.adapter_version = 0
        self.positions = 0  # token positions computed (rows x padded length), the work a health report divides by
        if getattr(model, "generation_config", None) is not None:
            check_plain_logits(model.generation_config)
        # MLA keys/values expanded once per token where that costs no more memory than the latent cache
        # (moe_lora/mla_decode.py); otherwise transformers' latent cache, re-expanded at every step
        self.expanded_kv = expanded_cache_fits(model.config) and install_expanded_cache(model) > 0

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
        chunks = math.ceil(len(expanded) / self.batch_size)
        calls = self.lockstep.max_over_ranks(chunks) if self.lockstep is not None else chunks
        for c in range(calls):
            chunk = expanded[c * self.batch_size : (c + 1) * self.batch_size]
            if not chunk:  # lockstep only: serve the other ranks' tokens, leave this rank's RNG as it was
                device = self.model.device
                with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
                    self._generate_batch([[self.pad_id]], sampling)
                continue
            r, lp, fr = self._generate_batch(chunk, sampling)
            responses += r
            logprobs += lp
            reasons += fr
        self.model.train(was_training)
        return Rollout(expanded, responses, logprobs, reasons, self.adapter_version, [i // n for i in range(len(expanded))])

    def _generate_batch(self, prompts: list[list[int]], s: Sampling):
        ids, mask = (t.to(self.model.device) for t in left_pad(prompts, self.pad_id))
        temperature = 1.0 if s.greedy else s.temperature
        step_logprobs = StepLogprobs(ids.shape[1], temperature)
        sequences = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=s.max_new_tokens,
            do_sample=not s.greedy, temperature=None if s.greedy else s.temperature,
            top_p=None if s.greedy else s.top_p, top_k=None,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            logits_processor=LogitsProcessorList([step_logprobs]), synced_gpus=self.lockstep is not None,
            past_key_values=ExpandedKVCache() if self.expanded_kv else None,
        )  # fmt: skip
        new_tokens = sequences[:, ids.shape[1] :]
        self.positions += sequences.numel()
        chosen = step_logprobs.finish(sequences)
        responses, logprobs, reasons = [], [], []
        for row, lp in zip(new_tokens.tolist(), chosen.tolist()):
            tokens, reason = cut_at_eos(row, self.eos_id)
            responses.append(tokens)
            logprobs.append(lp[: len(tokens)])
            reasons.append(reason)
        return responses, logprobs, reasons


# Settings of a checkpoint's generation_config that make generate() sample from something other than
# softmax(logits / T) (temperature, top_k and top_p are passed explicitly and override the checkpoint's). The
# first group adds processors that transformers runs before user processors, so StepLogprobs would not see
# the model's logits; the second adds warpers after temperature. Value: the setting's neutral values.
_EXTRA_PROCESSORS = {
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "sequence_bias": (None,),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0), "remove_invalid_values": (None, False),
    "top_h": (None,), "min_p": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0), "watermarking_config": (None,),
}  # fmt: skip


def check_plain_logits(generation_config) -> None:
    """Refuse a generation_config that would sample from anything but softmax(logits / T) (after top_p)."""
    for name, neutral in _EXTRA_PROCESSORS.items():
        if getattr(generation_config, name, None) not in neutral:
            raise ValueError(f"the checkpoint's generation_config sets {name}={getattr(generation_config, name)!r}: "
                             "the torch engine samples from softmax(logits / T) only; remove it")  # fmt: skip


class StepLogprobs(LogitsProcessor):
    """The chosen tokens' log softmax(logits / T), gathered step by step during `model.generate`.

    transformers 5.19 (generation/utils.py) calls the processors on `scores` = a float32 copy of the step's
    logits (`_sample`, line 3222-3225); `_get_logits_processor` puts user processors after its own
    non-sampling ones (line 1572, `_merge_criteria_processor_list` appends them at 1707; none are active
    here, see `check_plain_logits`) and before the temperature / top-k / top-p warpers (appended from line
    1575, temperature at 1591). So this processor sees the raw logits, and it returns them unchanged:
    sampling is exactly what it would be without it. At step t it gathers the
    logprob of the token chosen at step t-1 (input_ids[:, -1]) from the log softmax it kept at t-1, and
    keeps step t's log softmax: one [B, V] tensor at a time. `finish` reads the last token's. Rows that
    ended at eos get pad tokens and meaningless logprobs after it; the caller cuts them at eos.
    """

    def __init__(self, prompt_width: int, temperature: float):
        self.prompt_width, self.temperature = prompt_width, temperature
        self.previous: torch.Tensor | None = None  # [B, V] log softmax of the last step seen
        self.gathered: list[torch.Tensor] = []  # [B] per generated token, in order

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_width:
            self._gather(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _gather(self, tokens: torch.Tensor) -> None:
        self.gathered.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, new tokens] logprobs of the generated part of `sequences` (generate's output)."""
        generated = sequences.shape[1] - self.prompt_width
        if len(self.gathered) < generated:  # the last token: no later step read it
            self._gather(sequences[:, -1])
        self.previous = None
        # [:generated]: a step after the last kept token may have run and been undone (transformers' deferred
        # stop check); the tokens it read are not in `sequences`
        return torch.stack(self.gathered[:generated], dim=1) if generated else torch.zeros((sequences.shape[0], 0))
