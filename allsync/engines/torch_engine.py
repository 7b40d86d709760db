"""Rollout engines behind one interface.

    engine.generate(prompts, n, sampling) -> Rollout   (token ids, logprobs, finish reasons, adapter version)
    engine.load_adapter(tensors, version)

`TorchEngine` generates with the training model itself: the frozen base is shared with the trainer, so a sync
only bumps the version. It is the reference and the fallback. `VLLMEngine` lives in allsync/engines/vllm_engine.py.

Logprobs are those of the sampling distribution at temperature T: log softmax(logits / T) of the
chosen token (top_p = 1), the quantity the trainer recomputes to check engine/trainer agreement.

The torch engine decodes with continuous batching over KV slots (allsync/engines/slots.py): rollout.decode_batch
slots, each row's cache preallocated in its slot from its prefill (each distinct prompt prefilled once for its n
samples) until it ends, when the next row's prefill takes the slot; a decode step computes only live rows. Each
sample draws from its own counter-based stream (its seed, drawn here in sample order), so its tokens do not depend
on its neighbours, its slot or the batch size. It never re-expands MLA's cache: it keeps keys/values expanded where
that is no larger (the tiny models), else the latent and attends in latent space (DeepSeek-V3's 128 heads;
moe_lora/mla_decode.py). It keeps one step's [B, V] scores at a time and gathers the chosen tokens' logprobs as it
goes, where keeping every step's logits would hold [B, L, V] (about 10 GB per sequence at V = 129,280 and 20k
tokens).

Under expert parallelism (`lockstep`: the workers' allsync.distributed.process_groups.Groups) every rank's MoE layers
exchange tokens, so every rank must make every forward: the ranks agree at each iteration of the slot loop
whether any admits rows (a prefill forward on every rank) and whether any has live rows (a decode forward on every
rank); a rank without either forwards a one-token dummy, as generate's `synced_gpus` does. A producer whose number
of generate calls differs between problems (memory rounds, agent turns) asks `agreed_rounds` for the count every
rank makes, and never handles the lockstep itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from allsync.engines.graphs import graphed_step
from allsync.engines.slots import decode_in_slots
from moe_lora.lora import lora_merged, lora_modules
from moe_lora.kv_caches import KV_PAGE_TOKENS, expanded_cache_fits
from moe_lora.mla_decode import install_mla_decode
from moe_lora.routing import moe_layers, recording
from quant.formats import fp8_gemm_linears

DEFAULT_DECODE_BATCH = 64  # rows decoded together when rollout.decode_batch is not set


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False

    @classmethod
    def for_training(cls, rollout) -> Sampling:
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
        self,
        model,
        eos_id: int,
        pad_id: int,
        batch_size: int | None = None,
        lockstep=None,
        merge_lora: bool = False,
        decode_graphs: bool = False,
        kv_cache_dtype: str = "auto",
        attention_kernel: str = "torch",
        frozen_expert_kernel: str = "dequantize",
        kv_cache_tokens: int | None = None,
        fp8_linear_kernel: str = "dequantize",
    ):
        """batch_size (rollout.decode_batch): KV slots, samples decoded together (None: DEFAULT_DECODE_BATCH). merge_lora
        (rollout.merge_lora): generate with W + s B A formed once per call (moe_lora.lora.lora_merged). decode_graphs
        (rollout.decode_graphs): decode steps in fixed shapes, captured as CUDA graphs (allsync/engines/graphs.py).
        kv_cache_dtype (rollout.kv_cache_dtype): fp8 keeps the KV slots' MLA latent in FP8
        (moe_lora.kv_caches.FP8LatentLayer; the latent cache even where the expanded one would be smaller).
        attention_kernel (rollout.attention_kernel): triton attends to the latent slots with moe_lora.latent_attention's
        kernel, each slot's own positions as stored. frozen_expert_kernel (rollout.frozen_expert_kernel): triton
        multiplies the routed experts of the fixed-shape step with quant.fused_experts' kernel, reading their NF4.
        kv_cache_tokens (rollout.kv_cache_tokens): the slots share that many positions in pages (None: each slot room
        for a row at full length). fp8_linear_kernel (rollout.fp8_linear_kernel): scaled_mm multiplies the frozen FP8
        linears of every forward the engine runs as FP8 GEMMs (quant.formats.fp8_gemm)."""
        if decode_graphs:
            check_graphable(model)
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.decode_graphs = decode_graphs
        self.batch_size = batch_size or DEFAULT_DECODE_BATCH
        self.kv_pages = -(-kv_cache_tokens // KV_PAGE_TOKENS) if kv_cache_tokens is not None else None
        self.lockstep = lockstep
        self.merge_lora = merge_lora
        self.adapter_version = 0
        self.positions = 0  # token positions computed (prefills' padded rows, decode steps' live rows): a health
        # report divides by it
        self.decode_slots = 0  # slots x decode forwards
        self.decoded_tokens = 0  # the tokens those forwards produced (live rows): fill = tokens / slots
        self.kept: KeptRows | None = None  # rows a keep=True call stopped at max_new_tokens (generate)
        if getattr(model, "generation_config", None) is not None:
            check_plain_logits(model.generation_config)
        # MLA keys/values expanded once per token where that costs no more memory than the latent cache, otherwise
        # the latent cache read in latent space (moe_lora/mla_decode.py): never re-expanded at every step
        mla_layers = install_mla_decode(model)
        if kv_cache_dtype == "fp8" and not mla_layers:
            raise ValueError(
                "rollout.kv_cache_dtype fp8: the model has no MLA attention, whose latent it stores in FP8"
            )
        self.kv_fp8_rank = model.config.kv_lora_rank if kv_cache_dtype == "fp8" else None
        # no MLA: a plain (reserved) cache
        self.expanded_kv = (not mla_layers or expanded_cache_fits(model.config)) and self.kv_fp8_rank is None
        self.attention_kernel = attention_kernel == "triton"
        if self.attention_kernel:
            check_latent_kernel(model, self.expanded_kv)
        if frozen_expert_kernel == "triton":
            stack_experts_for_the_kernel(model, decode_graphs)
        if fp8_linear_kernel not in ("dequantize", "scaled_mm"):
            raise ValueError(f"rollout.fp8_linear_kernel = {fp8_linear_kernel!r}: use dequantize or scaled_mm")
        if fp8_linear_kernel == "scaled_mm" and merge_lora:
            raise ValueError(
                "rollout.fp8_linear_kernel scaled_mm with rollout.merge_lora: the merged weight is not FP8"
            )
        self.fp8_gemm = fp8_linear_kernel == "scaled_mm"
        # the experts each generated token went to, for routing replay and the routing_mismatch metric
        self.record_routing = bool(moe_layers(model))

    def load_adapter(self, tensors: dict[str, torch.Tensor] | None, version: int) -> int:
        """The engine is the trainer's model: its LoRA tensors are already current; returns bytes moved (0). Rows kept
        by generate(keep=True) go if the update moved the policy (their positions would be prefilled again anyway)."""
        self.adapter_version = version
        if self.kept is not None and self.kept.policy != self.policy_state():
            self.kept = None
        return 0

    def agreed_rounds(self, rounds: int) -> int:
        """The most engine rounds (generate calls) any rank needs: under expert parallelism every rank makes as
        many, a rank with nothing left serving the others' MoE layers (generate with no prompts); else `rounds`.
        A producer whose number of rounds differs between problems asks this instead of counting its own."""
        return self.lockstep.max_over_ranks(rounds) if self.lockstep is not None else rounds

    def release_memory(self) -> None:
        """Nothing to hand to the trainer between phases: the engine is the trainer's model (no KV cache kept)."""

    def policy_state(self) -> tuple:
        """What a row's cached positions depend on beyond the frozen base: every parameter's version counter (torch
        bumps it at every in-place change through the parameter or a view of it: an optimizer step, moe_lora.lora's
        load_lora_state_dict; the loop writes none through .data between generate calls), which adapters are on,
        and whether LoRA is merged."""
        versions = tuple(p._version for p in self.model.parameters())
        enabled = tuple(m.enabled for m in lora_modules(self.model))
        return versions, enabled, self.merge_lora

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling, keep: bool = False) -> Rollout:
        """n samples of each prompt, decoded with continuous batching over rollout.decode_batch KV slots
        (allsync/engines/slots.py); each sample's random draws come from its own seed, drawn here from torch's
        generator in sample order. keep: the samples that reach sampling.max_new_tokens keep their cached positions
        (and recorded routing) until the next generate call, which continues any of them it is given (the prompt
        followed by those tokens) without a prefill if the policy is unchanged (`policy_state`): T-PPO's windows
        over steps that do not move the policy (value pretraining). Any other call drops them."""
        rows = [p for p in prompts for _ in range(n)]
        seeds = draw_seeds(len(rows))
        policy = self.policy_state() if (keep or self.kept is not None) else None
        kept = self.kept.rows if self.kept is not None and self.kept.policy == policy else {}
        self.kept = None
        resumed = {i: kept[tuple(row)] for i, row in enumerate(rows) if tuple(row) in kept}
        decoded, routing = self._decode(rows, seeds, sampling, resumed, keep)
        if keep:
            self.kept = KeptRows(
                policy,
                {
                    tuple(rows[i] + decoded.tokens[i]): (saved, routing[i] if routing is not None else None)
                    for i, saved in decoded.saved.items()
                },
            )
        return self._rollout(rows, decoded, routing, n)

    @torch.no_grad()
    def generate_streamed(self, source, n: int, sampling: Sampling) -> Rollout:
        """The rows a RowSource (allsync.engines.slots) gives while the slots decode, each prompt's n samples
        consecutive and seeded with `draw_seeds` by the source, until it says stop: every row it gave, those it
        stopped unfinished with finish reason "dropped". Any kept rows (generate's keep) go."""
        self.kept = None
        rows: list[list[int]] = []
        decoded, routing = self._decode(rows, torch.zeros(0, dtype=torch.int64), sampling, {}, False, source)
        return self._rollout(rows, decoded, routing, n)

    def _rollout(self, rows: list[list[int]], decoded, routing, n: int) -> Rollout:
        return Rollout(
            rows,
            decoded.tokens,
            decoded.logprobs,
            decoded.reasons,
            self.adapter_version,
            [i // n for i in range(len(rows))],
            routing,
        )

    def _decode(self, rows, seeds, sampling: Sampling, resumed: dict, keep: bool, source=None) -> tuple:
        """decode_in_slots over the engine's slots and settings, the work counted; (Decoded, each row's routing or
        None)."""
        was_training = self.model.training
        self.model.eval()
        with (
            lora_merged(self.model) if self.merge_lora else contextlib.nullcontext(),
            recording(self.model) if self.record_routing else contextlib.nullcontext() as record,
            fp8_gemm_linears(self.fp8_gemm),
        ):
            decoded = decode_in_slots(
                self.model,
                rows,
                seeds,
                sampling,
                self.eos_id,
                self.pad_id,
                self.batch_size,
                self.expanded_kv,
                self.lockstep,
                (lambda: len(record)) if record is not None else (lambda: 0),
                graphed_step(record) if self.decode_graphs else None,
                {i: saved for i, (saved, _) in resumed.items()},
                keep,
                self.kv_fp8_rank,
                self.attention_kernel,
                source,
                self.kv_pages,
            )
        self.model.train(was_training)
        self.positions += decoded.positions
        self.decode_slots += decoded.decode_slots
        self.decoded_tokens += decoded.decoded_tokens
        known = {i: routing for i, (_, routing) in resumed.items()}
        return decoded, sample_routing(record, rows, decoded, known) if record is not None else None


def draw_seeds(count: int) -> torch.Tensor:
    """Sampling streams for `count` rows [count] int64, drawn from torch's generator (so a run's seed fixes them)."""
    return torch.randint(0, 2**62, (count,), dtype=torch.int64)


@dataclass
class KeptRows:
    """What a generate call with keep=True leaves for the next one: per row the caller may continue (its prompt and
    tokens), its cached positions but the last (moe_lora.kv_caches.SavedRow) and the routing recorded for them; the
    policy they were computed under (TorchEngine.policy_state)."""

    policy: tuple
    rows: dict[tuple[int, ...], tuple]


def stack_experts_for_the_kernel(model, decode_graphs: bool) -> None:
    """What rollout.frozen_expert_kernel triton needs, then the experts' NF4 stacked for it
    (quant.modules.stack_frozen_experts): the fixed-shape step, NF4 experts, a GPU or Triton's interpreter."""
    from quant.fused_experts import interpreted
    from quant.modules import stack_frozen_experts

    if not decode_graphs:
        raise ValueError(
            "rollout.frozen_expert_kernel triton without rollout.decode_graphs: it is the fixed-shape decode step's kernel"
        )
    if model.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"rollout.frozen_expert_kernel triton: the model is on {model.device.type}; the kernel runs on a GPU (or in "
            "Triton's interpreter with TRITON_INTERPRET=1, slowly)"
        )
    try:
        stack_frozen_experts(model)
    except ValueError as exc:
        raise ValueError(f"rollout.frozen_expert_kernel triton: {exc}") from None


def check_latent_kernel(model, expanded: bool) -> None:
    """What rollout.attention_kernel triton needs: MLA's latent in the KV slots, and a GPU (or Triton's interpreter,
    TRITON_INTERPRET=1, which runs it on CPU tensors)."""
    from quant.fused_experts import interpreted

    if expanded:
        raise ValueError(
            f"rollout.attention_kernel triton: {model.config.model_type} keeps its KV slots expanded (no larger than "
            "MLA's latent at its head count), and the kernel reads the latent; set rollout.kv_cache_dtype fp8 or use "
            "rollout.attention_kernel torch"
        )
    if model.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"rollout.attention_kernel triton: the model is on {model.device.type}; the kernel runs on a GPU (or in "
            "Triton's interpreter with TRITON_INTERPRET=1, slowly)"
        )


def check_graphable(model) -> None:
    """What rollout.decode_graphs needs of the model: a GPU and bfloat16 (the config checker says so first, naming the
    keys), and hidden / moe_intermediate sizes that torch's CUDA grouped_mm can run (16-byte aligned rows)."""
    from moe_lora.grouped_gemm import grouped_mm_supported

    config = model.config
    dtype = model.get_input_embeddings().weight.dtype
    if model.device.type != "cuda" or dtype != torch.bfloat16:
        raise ValueError(
            f"rollout.decode_graphs: the model is on {model.device.type} in {dtype}; CUDA graphs of the decode step "
            "need a GPU and bfloat16"
        )
    sizes = (config.hidden_size, getattr(config, "moe_intermediate_size", config.hidden_size))
    if not grouped_mm_supported(torch.bfloat16, *sizes):
        raise ValueError(
            f"rollout.decode_graphs: hidden_size {sizes[0]} / moe_intermediate_size {sizes[1]} of {config.model_type} "
            "are not multiples of 8, which torch's CUDA grouped_mm (the fixed-shape experts) needs"
        )


def sample_routing(record, rows: list[list[int]], decoded, known: dict | None = None) -> list:
    """Each sample's recorded experts, [prompt + response - 1, layers, k] (moe_lora.routing.RoutingRecord): its
    prompt's positions in its prefill's call (right-padded distinct prompts, `width` positions each; a resumed
    row's prompt but its last token from `known`, what an earlier call recorded), then the call of every decode
    forward it was live in (its slot's entry: the token it was fed, response token s - 1 at its s-th forward); the
    last response token is never fed. A row preempted and prefilled again (a paged pool, decode_in_slots) records its
    last held position in that prefill, between the decode forwards before and after it; its earlier positions keep
    the experts of their first forwards (the second prefill recomputes their keys and values, equal to float
    rounding, so a router near a tie could pick otherwise there). A row never prefilled (dropped from a streamed
    call's queue) gets None."""
    first: list = [None] * len(rows)
    for r, routing in (known or {}).items():
        first[r] = routing
    again: dict[int, list] = {}  # row -> [(call, the position a repeated prefill recorded)]
    for call, new, which, width, spans in decoded.prefills:
        entries = record.call(call)
        entries = entries.view(-1, width, *entries.shape[1:])
        for r, d, (start, end) in zip(new, which, spans):
            if first[r] is None:
                first[r] = entries[d, start:end]
            else:
                again.setdefault(r, []).append((call, entries[d, start:end]))
    shape = next((p for p in first if p is not None), None)
    if shape is None:  # no row was prefilled (a streamed call stopped before any)
        return [None] * len(rows)
    fed = [torch.zeros(0, *shape.shape[1:], dtype=shape.dtype)] * len(rows)
    fed_calls = [torch.zeros(0, dtype=torch.long)] * len(rows)
    if decoded.decodes:
        # a fixed-shape step records every slot: the live ones are the first
        entries = torch.cat([record.call(call)[: len(live)] for call, live in decoded.decodes]).cpu()
        owner = torch.tensor([r for _, live in decoded.decodes for r in live])
        calls = torch.tensor([call for call, live in decoded.decodes for _ in live])
        order = torch.argsort(owner, stable=True)  # each row's entries, in the order of its forwards
        counts = torch.bincount(owner, minlength=len(rows)).tolist()
        fed = list(torch.split(entries[order], counts))
        fed_calls = list(torch.split(calls[order], counts))
    out = []
    for r in range(len(rows)):
        if first[r] is None:  # a streamed call's row dropped before its prefill has none
            out.append(None)
            continue
        pieces, done = [first[r].cpu()], 0
        for call, entry in again.get(r, []):  # the decode forwards before that prefill, then its position
            before = int((fed_calls[r] < call).sum())
            pieces += [fed[r][done:before], entry.cpu()]
            done = before
        out.append(torch.cat([*pieces, fed[r][done:]]))
    return out


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
