"""Sequences of one RL step, the layout every stage of the update shares: prompt + response rows, right-padded.

Position t of `response_mask` marks that token t+1 is a response token, so a forward's token logprobs at column t
(allsync.update.forward.forward_logprobs: log p(token_{t+1} | tokens_{<=t})) line up with it. Per-token values come
in two layouts: sequence-aligned [B, L-1] (the forward's) and response-aligned [B, T] (token 0 of every response at
column 0, what gae / egae take); `response_positions` maps one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
