"""Rollout engines behind one interface.

    engine.generate(prompts, n, sampling) -> Rollout   (token ids, logprobs, finish reasons, adapter version)
    engine.load_adapter(tensors, version)

`TorchEngine` generates with the training model itself: the frozen base is shared with the trainer, so a sync
only bumps the version. It is the reference and the fallback. `VLLMEngine` lives in allsync/engines/vllm_engine.py.

Logprobs are those of the sampling distribution at temperature T: log softmax(logits / T) of the
chosen token (top_p = 1), the quantity the trainer recomputes to check engine/trainer agreement.

The torch engine decodes with its own loop (`sample_from_cache`), which samples exactly as transformers'
`generate` does (same ops, same random draws, so a seed gives generate's tokens; tests/allsync/engines/test_rollout_trainer.py)
but prefills each distinct prompt once for its n samples, skips generate's per-step bookkeeping and never
re-expands MLA's cache: it keeps keys/values expanded where that is no larger (the tiny models), else the latent
and attends in latent space (DeepSeek-V3's 128 heads; moe_lora/mla_decode.py). It keeps one step's [B, V]
scores at a time and gathers the chosen tokens' logprobs as it goes, where keeping every step's logits would
hold [B, L, V] (about 10 GB per sequence at V = 129,280 and 20k tokens).

Under expert parallelism (`lockstep`: the workers' allsync.launch.process_groups.Groups) every rank's MoE layers
exchange tokens, so every rank must run every decode step: the ranks agree on the number of generate calls
(the largest count any rank needs; a rank without prompts of its own generates from a one-token dummy
prompt, under a forked RNG so that its sampling stream is the one it would have had), and a rank whose rows
are done keeps forwarding (without sampling) until every rank is done, as generate's `synced_gpus` does.
A producer whose number of generate calls differs between problems (memory rounds, agent turns) asks
`agreed_rounds` for the count every rank makes, and never handles the lockstep itself.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from transformers import TopPLogitsWarper

from evals.generation import cut_at_eos, left_pad
from moe_lora.lora import lora_merged
from moe_lora.mla_decode import ExpandedKVCache, LatentKVCache, expanded_cache_fits, install_mla_decode
from moe_lora.routing import moe_layers, recording


DEFAULT_DECODE_BATCH = 64  # rows decoded together when rollout.decode_batch is not set


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False

    @classmethod
    def for_training(cls, rollout) -> "Sampling":
        """The training rollout's sampling: rollout.temperature, rollout.top_p, rollout.max_new_tokens."""
        return cls(temperature=rollout.temperature, top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens)


@dataclass
class Rollout:
    """n samples per prompt, sample i belongs to prompt i // n (its group)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" (eos) or "length"
    adapter_version: int
    group_index: list[int] = field(default_factory=list)
    # per sample, the experts its tokens went to (TorchEngine.record_routing): [prompt + response - 1, MoE layers,
    # top-k] indices for every token fed to the model (the last response token never is); None when not recorded
    routing: list | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


class TorchEngine:
    """Generation with the training model (shared frozen base and LoRA tensors)."""

    counters = ("positions", "decode_slots", "decoded_tokens")  # work since the worker's last report

    def __init__(
        self, model, eos_id: int, pad_id: int, batch_size: int | None = None, lockstep=None, merge_lora: bool = False
    ):
        """batch_size (rollout.decode_batch): samples decoded together (None: DEFAULT_DECODE_BATCH). merge_lora
        (rollout.merge_lora): generate with W + s B A formed once per call (moe_lora.lora.lora_merged)."""
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.batch_size = batch_size or DEFAULT_DECODE_BATCH
        self.lockstep = lockstep
        self.merge_lora = merge_lora
        self.adapter_version = 0
        self.positions = 0  # token positions computed (rows x padded length), the work a health report divides by
        # static batches: every row of a decode batch takes a slot at each step until the batch's last row ends
        self.decode_slots = 0  # rows x decode steps
        self.decoded_tokens = 0  # the response tokens those slots produced (eos included): fill = tokens / slots
        if getattr(model, "generation_config", None) is not None:
            check_plain_logits(model.generation_config)
        # MLA keys/values expanded once per token where that costs no more memory than the latent cache, otherwise
        # the latent cache read in latent space (moe_lora/mla_decode.py): never re-expanded at every step
        mla_layers = install_mla_decode(model)
        self.expanded_kv = not mla_layers or expanded_cache_fits(model.config)  # no MLA: a plain (reserved) cache
        # the experts each generated token went to, for routing replay and the routing_mismatch metric
        self.record_routing = bool(moe_layers(model))

    def load_adapter(self, tensors: dict[str, torch.Tensor] | None, version: int) -> int:
        """The engine is the trainer's model: its LoRA tensors are already current; returns bytes moved (0)."""
        self.adapter_version = version
        return 0

    def agreed_rounds(self, rounds: int) -> int:
        """The most engine rounds (generate calls) any rank needs: under expert parallelism every rank makes as
        many, a rank with nothing left serving the others' MoE layers (generate with no prompts); else `rounds`.
        A producer whose number of rounds differs between problems asks this instead of counting its own."""
        return self.lockstep.max_over_ranks(rounds) if self.lockstep is not None else rounds

    def release_memory(self) -> None:
        """Nothing to hand to the trainer between phases: the engine is the trainer's model (no KV cache kept)."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> Rollout:
        expanded = [p for p in prompts for _ in range(n)]
        responses, logprobs, reasons, routing = [], [], [], []
        was_training = self.model.training
        self.model.eval()
        chunks = math.ceil(len(expanded) / self.batch_size)
        calls = self.lockstep.max_over_ranks(chunks) if self.lockstep is not None else chunks
        with lora_merged(self.model) if self.merge_lora else contextlib.nullcontext():
            for c in range(calls):
                chunk = expanded[c * self.batch_size : (c + 1) * self.batch_size]
                if not chunk:  # lockstep only: serve the other ranks' tokens, leave this rank's RNG as it was
                    device = self.model.device
                    with torch.random.fork_rng(
                        devices=[] if device.type == "cpu" else [device], device_type=device.type
                    ):
                        self._generate_batch([[self.pad_id]], sampling)
                    continue
                r, lp, fr, rt = self._generate_batch(chunk, sampling)
                responses += r
                logprobs += lp
                reasons += fr
                routing += rt
        self.model.train(was_training)
        return Rollout(
            expanded,
            responses,
            logprobs,
            reasons,
            self.adapter_version,
            [i // n for i in range(len(expanded))],
            routing if self.record_routing else None,
        )

    def _generate_batch(self, prompts: list[list[int]], s: Sampling):
        distinct, repeats = runs_of_equal(prompts)
        cache = (ExpandedKVCache if self.expanded_kv else LatentKVCache)(reserve=s.max_new_tokens)
        with recording(self.model) if self.record_routing else contextlib.nullcontext() as record:
            tokens, chosen = sample_from_cache(
                self.model, distinct, repeats, s, self.eos_id, self.pad_id, cache, self.lockstep
            )
        self.positions += tokens.shape[0] * (max(map(len, prompts)) + tokens.shape[1])
        responses, logprobs, reasons = [], [], []
        for row, lp in zip(tokens.tolist(), chosen.tolist()):
            tokens_cut, reason = cut_at_eos(row, self.eos_id)
            responses.append(tokens_cut)
            logprobs.append(lp[: len(tokens_cut)])
            reasons.append(reason)
        self.decode_slots += tokens.numel()
        self.decoded_tokens += sum(map(len, responses))
        routing = sample_routing(record, distinct, repeats, responses) if self.record_routing else []
        return responses, logprobs, reasons, routing


def sample_routing(record, prompts: list[list[int]], repeats: list[int], responses: list[list[int]]) -> list:
    """Each sample's recorded experts, [prompt + response - 1, layers, k] (moe_lora.routing.RoutingRecord of one
    sample_from_cache call): the prefill's call holds the left-padded distinct prompts, decode step s (call s) the
    token each row was fed, response token s - 1; the last response token is never fed."""
    width = max(map(len, prompts))
    prefill = record.call(0).cpu()
    prefill = prefill.view(len(prompts), width, *prefill.shape[1:])
    decode = torch.stack([record.call(s) for s in range(1, len(record))]).cpu() if len(record) > 1 else None
    out, row = [], 0
    for i, (prompt, n) in enumerate(zip(prompts, repeats)):
        prompt_part = prefill[i, width - len(prompt) :]
        for _ in range(n):
            fed = max(len(responses[row]) - 1, 0)
            parts = [prompt_part] if not fed else [prompt_part, decode[:fed, row]]
            out.append(torch.cat(parts))
            row += 1
    return out


def runs_of_equal(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Consecutive equal rows collapsed: (distinct rows, how many times each repeats), in order."""
    distinct, repeats = [], []
    for row in rows:
        if distinct and distinct[-1] == row:
            repeats[-1] += 1
        else:
            distinct.append(row)
            repeats.append(1)
    return distinct, repeats


@torch.no_grad()
def sample_from_cache(
    model, prompts: list[list[int]], repeats: list[int], s: Sampling, eos_id: int, pad_id: int, cache, lockstep=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `repeats[i]` responses to prompts[i]: ([rows, steps] token ids, [rows, steps] their logprobs).

    Each distinct prompt is prefilled once (left-padded, positions counted from its first real token), its cache
    rows and last logits then repeated for its samples. Each step then does what transformers' `generate` does
    (generation/utils.py `_sample`, 5.19), so a seed gives the same tokens as `model.generate` would:
        scores = logits (float32);  next ~ softmax(scores / T) (top_p: transformers' TopPLogitsWarper after T),
        or argmax(scores) when greedy;  a row past eos gets pad;  stop when every row has emitted eos or after
        max_new_tokens. The logprob of each chosen token is log softmax(scores / T)[next] (T = 1 when greedy).
    `lockstep` (expert parallelism): every rank forwards until all ranks are done, as generate's synced_gpus.
    """
    device = model.device
    ids, mask = (t.to(device) for t in left_pad(prompts, pad_id))
    padded = not bool(mask.all())  # as generate: no mask at all when nothing is padded (the causal SDPA path)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = model(
        input_ids=ids,
        attention_mask=mask if padded else None,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.tensor(repeats, device=device))
    cache.batch_select_indices(rows)
    logits, mask, position = out.logits[rows, -1], mask[rows], positions[rows, -1:]
    temperature = 1.0 if s.greedy else s.temperature
    top_p = TopPLogitsWarper(s.top_p) if not s.greedy and s.top_p < 1.0 else None
    unfinished = torch.ones(len(rows), dtype=torch.long, device=device)
    tokens, logprobs = [], []
    done = False
    for step in range(s.max_new_tokens):
        if step:
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            position = position + 1
            logits = model(
                input_ids=tokens[-1][:, None],
                attention_mask=mask if padded else None,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        if done:  # lockstep: this rank is done, its forward serves the other ranks' tokens
            if not lockstep.max_over_ranks(0):
                break
            continue
        scores = logits.float()
        if s.greedy:
            chosen = scores.argmax(-1)
        else:
            warped = scores / temperature
            if top_p is not None:
                warped = top_p(None, warped)
            chosen = torch.multinomial(torch.softmax(warped, dim=-1), num_samples=1).squeeze(1)
        chosen = chosen * unfinished + pad_id * (1 - unfinished)
        logprobs.append(torch.log_softmax(scores / temperature, dim=-1).gather(-1, chosen[:, None]).squeeze(-1))
        tokens.append(chosen)
        unfinished = unfinished & (chosen != eos_id).long()
        done = not bool(unfinished.any())
        if lockstep is not None and not lockstep.max_over_ranks(int(not done)):
            break
        if done and lockstep is None:
            break
    if not tokens:
        empty = torch.zeros((len(rows), 0), dtype=torch.long, device=device)
        return empty, empty.float()
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


# Settings of a checkpoint's generation_config that would make transformers' generate() sample from something
# other than softmax(logits / T) (repetition penalties, banned words, min_p, ...). The engine's own loop samples
# from softmax(logits / T) (after top_p for sampled evaluation) whatever the checkpoint asks, so a checkpoint that
# asks for one of these is refused rather than silently served differently. Value: the setting's neutral values.
_EXTRA_PROCESSORS = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "sequence_bias": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "remove_invalid_values": (None, False),
    "top_h": (None,),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "watermarking_config": (None,),
}


def check_plain_logits(generation_config) -> None:
    """Refuse a generation_config that would sample from anything but softmax(logits / T) (after top_p)."""
    for name, neutral in _EXTRA_PROCESSORS.items():
        if getattr(generation_config, name, None) not in neutral:
            raise ValueError(
                f"the checkpoint's generation_config sets {name}={getattr(generation_config, name)!r}: "
                "the torch engine samples from softmax(logits / T) only; remove it"
            )
