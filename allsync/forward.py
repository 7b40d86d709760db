"""Trainer-side pieces of one RL step: sequences from a rollout, token logprobs, the policy update.

Sequences are prompt + response, right-padded. Position t of `response_mask` marks that token t+1 is a
response token, so `forward_logprobs(...)[:, t]` = log p(token_{t+1} | tokens_{<=t}) lines up with it.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from allsync.algorithms import aggregate_loss, get, kl_penalty, tis_weights


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # [B, L] right-padded prompt + response
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float, 1 where the predicted token is a response token
    # the experts the engine sent each token to ([B, L, MoE layers, k]) and which tokens have them ([B, L] bool)
    routing: torch.Tensor | None = None
    routing_has: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _with(self, f) -> "SequenceBatch":
        """f applied to every [B, L(-1), ...] tensor."""
        routing = None if self.routing is None else (f(self.routing), f(self.routing_has))
        return SequenceBatch(f(self.input_ids), f(self.attention_mask), f(self.response_mask), *(routing or ()))

    def select(self, rows: torch.Tensor | list[int]) -> "SequenceBatch":
        return self._with(lambda t: t[rows])

    def flat_routing(self) -> tuple:
        """(indices [B x L, layers, k], has [B x L], counts [B x L]) as the routers see the tokens, counts marking the
        response tokens (moe_lora.routing.RoutingReplay.set); Nones without routing."""
        if self.routing is None:
            return None, None, None
        response = torch.cat([torch.zeros_like(self.response_mask[:, :1]), self.response_mask], dim=1) > 0
        return self.routing.flatten(0, 1), self.routing_has.flatten(), (self.routing_has & response).flatten()

    @property
    def width(self) -> int:
        """Length of the longest row (rows are right-padded)."""
        return int(self.attention_mask.sum(-1).max()) if len(self) else 0

    def to(self, device: torch.device | str) -> "SequenceBatch":
        return self._with(lambda t: t.to(device))

    def trimmed(self, width: int) -> "SequenceBatch":
        """The first `width` columns (per-token [B, L-1] tensors keep width - 1)."""
        out = self._with(lambda t: t[:, :width])
        out.response_mask = self.response_mask[:, : width - 1]
        return out


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


def token_budget_chunks(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Row groups whose padded size (rows x the group's longest row) is at most `budget` tokens, packed longest first:
    the rows sorted by length (longest first, ties in row order) and cut into consecutive groups of that order (each
    group's rows then listed in row order); a row longer than the budget is a group of its own. Rows of similar lengths share a forward (less padding), and
    under expert parallelism, where the ranks run their j-th forwards together and each waits for the largest, every
    rank's j-th forward is about as large as the others' (benchmarks/update_balance.py measures the wait). None: one
    group of every row, in row order (none if empty)."""
    if budget is None:
        return [list(range(len(lengths)))] if lengths else []
    chunks: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if chunks and (len(chunks[-1]) + 1) * max(longest, lengths[i]) <= budget:
            chunks[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            chunks.append([i])
            longest = lengths[i]
    return [sorted(chunk) for chunk in chunks]


def build_sequences(
    prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, routing: list | None = None
) -> SequenceBatch:
    """Right-padded rows of prompt + response; `routing`: each row's recorded experts [tokens fed, layers, k] (the
    engine's; the row's first tokens), placed at its positions."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(lengths), width), dtype=torch.long)
    response = torch.zeros((len(lengths), width - 1))
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention[i, : len(p) + len(r)] = 1
        response[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    batch = SequenceBatch(ids, attention, response)
    if routing:
        batch.routing = torch.zeros((len(lengths), width, *routing[0].shape[1:]), dtype=routing[0].dtype)
        batch.routing_has = torch.zeros((len(lengths), width), dtype=torch.bool)
        for i, experts in enumerate(routing):
            batch.routing[i, : len(experts)] = experts
            batch.routing_has[i, : len(experts)] = True
    return batch


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


def response_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's response tokens sit in a [B, L-1] mask (contiguous per row): index [B, T] (padded
    with 0) and valid [B, T], T = the longest response. Moves sequence-aligned values to response-aligned
    ones, where token 0 of every response is column 0 (the layout gae/egae expect)."""
    lengths = mask.sum(-1).long()
    width = int(lengths.max()) if len(lengths) else 0
    starts = mask.float().argmax(-1)
    offsets = torch.arange(width, device=mask.device)[None, :]
    valid = offsets < lengths[:, None]
    index = torch.where(valid, starts[:, None] + offsets, torch.zeros_like(offsets))
    return index, valid


def to_response_layout(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return x.gather(1, index) * valid


def to_sequence_layout(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
    return out.scatter_add_(1, index, x * valid)


def scatter_response_values(values: list[list[float]], batch: SequenceBatch) -> torch.Tensor:
    """Per-response-token lists (e.g. engine logprobs) placed at their [B, L-1] positions: value j of row i
    goes to row i's j-th masked position (masks are contiguous per row); values past the mask are dropped.
    One host-to-device copy for the batch."""
    index, valid = response_positions(batch.response_mask)
    width = index.shape[1]
    padded = [v[:width] + [0.0] * (width - len(v[:width])) for v in values]
    dense = torch.tensor(padded, dtype=batch.response_mask.dtype).reshape(len(values), width).to(index.device)
    return to_sequence_layout(dense, index, valid, batch.response_mask.shape[1])


def logprob_gap(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |engine - trainer| logprob over response tokens (nats); NaN anywhere makes it NaN."""
    diff = (engine_logprobs - trainer_logprobs).abs() * mask
    return float(diff.sum() / mask.sum().clamp_min(1))


def largest_logprob_gap(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """max |engine - trainer| logprob over response tokens (nats; 0 with none); NaN anywhere makes it NaN."""
    diff = (engine_logprobs - trainer_logprobs).abs() * mask
    return float(diff.max()) if diff.numel() else 0.0


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    agg: str = "token-mean"
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    policy_loss: str = "clipped"  # a name in allsync.algorithms.POLICY_LOSSES
    tis_level: str | None = None  # algorithm.tis.level; None: no importance weights
    tis_cap: float = 2.0


@dataclass
class LossStats:
    """Token sums of one micro-batch (divide by the global token count for means)."""

    policy: dict[str, float]  # the policy loss's logged statistics (PolicyLossEntry.logged), mean x tokens
    entropy: float  # policy entropy at the rollout temperature
    kl_ref: float  # KL to the reference policy (the kl_estimator's value); 0 without reference logprobs
    logprobs: torch.Tensor | None = None  # [B, L-1] the forward's token logprobs, detached
    tis: float = 0.0  # TIS weights summed over the trained tokens (algorithm.tis)
    tis_capped: float = 0.0  # trained tokens whose TIS weight the cap cut


def minibatch_loss(
    model,
    batch: SequenceBatch,
    old_logprobs,
    advantages,
    settings: LossSettings,
    global_tokens,
    global_seqs,
    norm_length: int | None = None,
    ref_logprobs=None,
    episode_tokens: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
):
    """Policy loss of one micro-batch (the PolicyLossEntry settings.policy_loss names), scaled as its share of the
    global batch (episode_tokens: each row's episode's trained tokens, for episode-mean-token-mean), plus
    kl_coef * KL(policy || reference) aggregated the same way when reference logprobs are given
    (reference = the frozen base with the adapters off). Returns (loss, LossStats of token sums).

    old_logprobs None: the policy being trained is the one that sampled (one on-policy minibatch, before any
    optimizer step), so the old logprobs are this forward's own, detached: r = exp(logprobs - sg(logprobs)) = 1,
    and the separate no-gradient pass that would compute the same numbers is skipped.

    settings.tis_level set: each token's policy loss is weighted by its truncated importance weight against the
    engine's logprobs (allsync.algorithms.tis_weights; the advantages scaled by it, the same for the clipped
    surrogate)."""
    out = forward_pass(model, batch, settings.temperature, with_entropy=True)
    mask = batch.response_mask
    old_logprobs = out.logprobs.detach() if old_logprobs is None else old_logprobs
    tis = capped = None
    if settings.tis_level is not None:
        tis, capped = tis_weights(old_logprobs, engine_logprobs, mask, settings.tis_level, settings.tis_cap)
        advantages = advantages * tis
    policy_loss = get("policy_loss", settings.policy_loss)
    loss, stats = policy_loss(
        out.logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        clip_c=settings.clip_c,
        agg=settings.agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
        episode_tokens=episode_tokens,
    )
    kl_ref = 0.0
    if ref_logprobs is not None:
        kl = kl_penalty(out.logprobs, ref_logprobs, settings.kl_estimator)
        loss = loss + settings.kl_coef * aggregate_loss(
            kl, mask, settings.agg, global_tokens, global_seqs, norm_length, episode_tokens
        )
        kl_ref = float((kl.detach() * mask).sum())
    tokens = float(mask.sum())
    sums = LossStats(
        {name: float(stats[name]) * tokens for name in policy_loss.logged},
        float((out.entropy * mask).sum()),
        kl_ref,
        out.logprobs.detach(),
        float((tis * mask).sum()) if tis is not None else 0.0,
        float(capped.sum()) if capped is not None else 0.0,
    )
    return loss, sums
