"""The experts a DeepSeek-V3 router chose, recorded while a model generates and replayed while another trains.

A MoE layer's router (`mlp.gate`, transformers' DeepseekV3TopkRouter) returns (logits, top-k weights, top-k indices)
for the tokens it sees. Two wrappers of that call, one MoE layer at a time (`moe_layers`):

    recording(model)          every call's indices, [tokens, k] uint8 per MoE layer, in call order (`RoutingRecord`)
    replaying(model, replay)  each forward's routing is given per token (`RoutingReplay.set`: indices
                              [tokens, moe layers, k] and which tokens have them); the router still computes its own
                              scores s = sigmoid(logits), and where a token has recorded indices I the layer uses
                              those experts with weights from its own scores at them,
                                  w = s[I] / (sum s[I] + 1e-20) x routed_scaling_factor   (norm_topk_prob)
                                  w = s[I] x routed_scaling_factor                         (otherwise)
                              so gradients still reach the hidden states through w (R3, arXiv 2510.11370). With
                              replay off it only compares: `mismatched / counted` is the share of counted
                              (token, MoE layer) pairs whose own top-k set differs from the recorded set.

The replay wrapper reads the routing the latest `set` gave until the next `set`: a recomputed layer (activation
checkpointing) replays what its forward replayed, and counts only once per `set`. `counting` off stops the counts
(the mismatch is the sampling policy's: the first policy pass of a step, before any optimizer step); `live` on
routes every layer by itself whatever `set` gives (the reference pass with adapters off: R3 replays the policy's
forwards, the reference model routes live).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def moe_layers(model) -> list:
    """The decoder layers' routers, in layer order (dense layers have none)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def index_dtype(experts: int) -> torch.dtype:
    return torch.uint8 if experts <= 256 else torch.int16


@dataclass
class RoutingRecord:
    """Per MoE layer, every router call's top-k indices in call order."""

    calls: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][call] -> [tokens, k]

    def call(self, i: int) -> torch.Tensor:
        """The i-th call's indices of every MoE layer: [tokens, layers, k]."""
        return torch.stack([layer[i] for layer in self.calls], dim=1)

    def __len__(self) -> int:
        return len(self.calls[0]) if self.calls else 0


@contextmanager
def wrapped_routers(model, wrap):
    """Inside, MoE layer i's router call is wrap(i, gate, its call so far); outside, what it was (wrappers nest)."""
    gates = moe_layers(model)
    before = [gate.__dict__.get("forward") for gate in gates]
    for i, gate in enumerate(gates):
        gate.forward = wrap(i, gate, gate.forward)
    try:
        yield
    finally:
        for gate, previous in zip(gates, before):
            if previous is None:
                del gate.forward
            else:
                gate.forward = previous


@contextmanager
def recording(model):
    """Inside, every router call appends its top-k indices to the yielded RoutingRecord."""
    record = RoutingRecord([[] for _ in moe_layers(model)])

    def wrap(i, gate, call):
        dtype = index_dtype(gate.num_experts)

        def forward(hidden_states):
            logits, weights, indices = call(hidden_states)
            record.calls[i].append(indices.to(dtype))
            return logits, weights, indices

        return forward

    with wrapped_routers(model, wrap):
        yield record


@dataclass
class RoutingReplay:
    """What `replaying` wrappers read: the current forward's routing, and the mismatch counts (device tensors)."""

    replay: bool
    indices: torch.Tensor | None = None  # [tokens, layers, k]
    has: torch.Tensor | None = None  # [tokens] bool: the token has recorded indices
    counts: torch.Tensor | None = None  # [tokens] bool: the token's mismatch is counted (trained tokens)
    counted_layers: set = field(default_factory=set)
    counting: bool = True  # off: the forwards count nothing (the learner counts a step's first policy pass only)
    live: bool = False  # on: `set` gives no recorded routing, every layer routes by itself (the reference pass)
    mismatched: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    counted: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))

    def set(self, indices: torch.Tensor | None, has: torch.Tensor | None, counts: torch.Tensor | None) -> None:
        """The next forward's tokens (flattened [B x L] as the router sees them): their recorded indices, which have
        them, and which count in the mismatch; None: no recorded routing (the layer routes by itself)."""
        self.indices, self.has, self.counts = (None, None, None) if self.live else (indices, has, counts)
        self.counted_layers = set()

    def take_counts(self) -> tuple[int, int]:
        """(mismatched, counted) since the last take; one host sync."""
        out = (int(self.mismatched), int(self.counted))
        self.mismatched, self.counted = torch.zeros_like(self.mismatched), torch.zeros_like(self.counted)
        return out

    def route(self, layer: int, gate, logits, weights, indices):
        if self.indices is None:
            return logits, weights, indices
        if self.indices.shape[0] != indices.shape[0]:
            raise ValueError(
                f"routing replay: the forward routes {indices.shape[0]} tokens, the batch recorded {self.indices.shape[0]}"
            )
        recorded = self.indices[:, layer].to(device=indices.device, dtype=torch.long)
        has = self.has.to(indices.device)
        if self.counting and layer not in self.counted_layers:
            self.counted_layers.add(layer)
            counts = self.counts.to(indices.device)
            differs = (indices.sort(-1).values != recorded.sort(-1).values).any(-1) & counts
            self.mismatched = self.mismatched.to(indices.device) + differs.sum()
            self.counted = self.counted.to(indices.device) + counts.sum()
        if not self.replay:
            return logits, weights, indices
        chosen = torch.where(has[:, None], recorded, indices)
        w = logits.sigmoid().gather(1, chosen)
        if gate.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, (w * gate.routed_scaling_factor).to(weights.dtype), chosen


@contextmanager
def replaying(model, replay: bool):
    """Inside, every router consults the yielded RoutingReplay (module docstring)."""
    state = RoutingReplay(replay)

    def wrap(i, gate, call):
        return lambda hidden_states: state.route(i, gate, *call(hidden_states))

    with wrapped_routers(model, wrap):
        yield state
