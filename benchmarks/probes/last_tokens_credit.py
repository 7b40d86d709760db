"""Probe for T-PPO's collapse (issue 49): PPO on whole responses whose policy loss reaches only each reply's last
`producer.trained_tokens` tokens, as T-PPO's reward reaches only a reply's last window.

    run.imports: [benchmarks.probes.last_tokens_credit]
    producer: {kind: last_tokens_credit, trained_tokens: 32}
    algorithm: {advantage: gae, ...}

The responses, the critic and its targets are PPO's (producer.kind windows without a window: every token of a
finished reply trains the critic); only the policy's loss mask changes, to the last `trained_tokens` tokens of each
reply (a reply that short is trained whole), so the advantages are whitened over those tokens as T-PPO whitens over
its windows. If this arm collapses as T-PPO did while PPO learns, the collapse comes from where the credit lands
(the restatement and answer line, copied from reasoning that gets no credit), not from the windows' bookkeeping,
the bootstrap or the kept KV slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from allsync.producers.registry import ProducerContext, register_producer
from allsync.producers.windows import WindowPool, WindowsSettings


def last_tokens_mask(response_tokens: int, trained_tokens: int) -> list[int]:
    """1 on the last `trained_tokens` of `response_tokens`, 0 before."""
    kept = min(response_tokens, trained_tokens)
    return [0] * (response_tokens - kept) + [1] * kept


class LastTokensPool:
    """PPO's WindowPool (whole responses) whose episodes train only their last `trained_tokens` tokens; everything
    else is the pool's own."""

    def __init__(self, pool: WindowPool, trained_tokens: int):
        self.pool, self.trained_tokens = pool, trained_tokens

    def __getattr__(self, name: str):
        return getattr(self.pool, name)

    def collect(self, groups_wanted: int, version: int):
        episodes, index, stats = self.pool.collect(groups_wanted, version)
        for episode in episodes:
            segment = episode.segments[-1]
            mask = last_tokens_mask(len(segment.response_ids), self.trained_tokens)
            episode.segments[-1] = replace(segment, loss_mask=mask)
        return episodes, index, stats


@register_producer
@dataclass
class LastTokensCreditSettings(WindowsSettings):
    kind: str = field(default="last_tokens_credit", init=False)
    trained_tokens: int = 32

    def check(self, fail) -> None:
        if self.window is not None:
            fail("producer.window: last_tokens_credit generates whole responses (PPO); leave it out")
        if self.trained_tokens < 1:
            fail(f"producer.trained_tokens = {self.trained_tokens}: must be >= 1")

    def build(self, context: ProducerContext) -> LastTokensPool:
        return LastTokensPool(super().build(context), self.trained_tokens)
