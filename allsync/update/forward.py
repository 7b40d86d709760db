"""The trainer's forward pass: the decoder over a SequenceBatch, then token logprobs from its last hidden state and
the frozen lm_head in chunks (the [B, L, V] logits are never built); activation checkpointing and offload around it."""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from allsync.update.sequences import SequenceBatch


@contextmanager
def checkpointed_decoder_layers(model, enabled: bool = True):
    """Inside: each decoder layer of `model.model.layers` runs under torch.utils.checkpoint (non-reentrant), so a
    forward keeps only the layers' inputs for backward and recomputes the rest during it (the model stays in
    eval mode, unlike transformers' gradient_checkpointing, which needs training mode)."""
    layers = list(model.model.layers) if enabled else []
    for layer in layers:
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def saved_on_host(enabled: bool):
    """optim.activation_offload: inside, every tensor autograd saves for backward is copied to host memory (pinned
    when CUDA is there, so the copies back are asynchronous) and the device copy freed; backward copies each back
    when it needs it. Outside a backward, so recomputed layers (activation checkpointing) keep theirs on the device."""
    if not enabled:
        return nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


LOGIT_CHUNK_ELEMENTS = 1 << 24  # logits held at once by `token_logprobs` (64 MiB in float32)


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """z = (h W^T) / T in float32 -> (z[target] - logsumexp(z), entropy = logsumexp(z) - sum softmax(z) z).
    h is flattened to rows first, so the product is one matrix product whatever h's strides: a slice of the
    hidden states here, a contiguous copy when activation offload brings it back for the recomputation, and
    the recomputation must save what the forward saved."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    z = torch.nn.functional.linear(rows, weight).float().view(*hidden.shape[:-1], -1) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets[..., None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    with torch.no_grad():
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logprobs, entropy


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
):
    """log softmax(h_t W^T / T)[target_t] for hidden [B, L, H], targets [B, L] -> ([B, L], entropy [B, L]).

    Computed over chunks of positions so that at most ~chunk_elements logits exist at once, never the
    whole [B, L, V] (V = 129,280 for DeepSeek-V3); under autograd each chunk is recomputed in backward
    (activation checkpointing), so the saved state is the hidden states, not the logits. Entropy (no
    gradient) is zeros unless asked for."""
    batch, length = targets.shape
    step = max(1, chunk_elements // max(batch * weight.shape[0], 1))
    logprobs, entropy = [], []
    for start in range(0, length, step):
        args = (hidden[:, start : start + step], weight, targets[:, start : start + step], temperature, with_entropy)
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        logprobs.append(lp)
        entropy.append(ent)
    return torch.cat(logprobs, 1), torch.cat(entropy, 1)


@dataclass
class ForwardOut:
    """Per-position quantities of one forward pass, all [B, L-1] (position t predicts token t+1)."""

    logprobs: torch.Tensor  # log softmax(logits_t / T)[token_{t+1}]
    entropy: torch.Tensor | None = None  # entropy of softmax(logits_t / T), no gradient


def forward_pass(
    model,
    batch: SequenceBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> ForwardOut:
    """One forward pass of the decoder, then chunked token logprobs (`token_logprobs`) from its last
    hidden state and the frozen lm_head: the [B, L, V] logits are never built. A model the learner attached a
    routing replay to (moe_lora.routing.replaying) gets the batch's recorded experts first."""
    replay = getattr(model, "routing_replay", None)
    if replay is not None:
        replay.set(*batch.flat_routing())
    out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    hidden = out.last_hidden_state[:, :-1]
    weight = model.get_output_embeddings().weight
    logprobs, entropy = token_logprobs(hidden, weight, batch.input_ids[:, 1:], temperature, with_entropy)
    return ForwardOut(logprobs, entropy if with_entropy else None)


def forward_logprobs(model, batch: SequenceBatch, temperature: float = 1.0) -> torch.Tensor:
    """The token logprobs of `forward_pass`, [B, L-1]."""
    return forward_pass(model, batch, temperature).logprobs
