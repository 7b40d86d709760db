"""TrainBatch: what the learner's minibatch loop trains on (batches.py builds it from episodes; balance.py moves its rows
between workers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from allsync.algorithms import episode_token_counts, episodes_with_tokens
from allsync.update.sequences import SequenceBatch


@dataclass
class TrainBatch:
    """What the minibatch loop needs: sequences whose response_mask marks the tokens to train, and
    per-token tensors [B, L-1] aligned with them. Critic fields are None for group baselines;
    ref_logprobs (the frozen base's, adapters off) only with algorithm.kl_coef > 0. Rows of one episode
    are adjacent; episode_of_row [B] numbers the episodes 0.. in order, episode_tokens [B] is the trained
    token count of the row's whole episode."""

    sequences: SequenceBatch
    old_logprobs: torch.Tensor | None  # None: the update's own forward gives them (batches.reuses_update_forward)
    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None  # response tokens of finished responses (the critic learns from those)
    ref_logprobs: torch.Tensor | None = None
    episode_of_row: torch.Tensor | None = None  # None: every row is its own episode
    episode_tokens: torch.Tensor | None = None
    engine_logprobs: torch.Tensor | None = None  # [B, L-1] the rollout engine's logprobs at the response tokens
    engine_mask: torch.Tensor | None = (
        None  # [B, L-1] response tokens the engine chose (before credit and overlong masks)
    )
    segment_kinds: list[str] | None = None  # per row: answer | memory | turn
    # the row groups of its forwards when optim.balance_ranks dealt them (allsync/update/balance.py); None: forward_chunks
    forward_groups: list[list[int]] | None = None
    # a critic's step sums that add up over workers: value_fit_sums (its values before the update against its
    # targets) and split_advantage_sums (the raw advantages of cut and finished responses)
    critic_sums: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.episode_of_row is None:
            self.episode_of_row = torch.arange(len(self.sequences), device=self.sequences.input_ids.device)
        if self.episode_tokens is None:
            self.episode_tokens = episode_token_counts(self.sequences.response_mask, self.episode_of_row)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_episodes(self) -> int:
        return int(self.episode_of_row[-1]) + 1 if len(self) else 0

    def minibatch_rows(self, minibatches: int) -> list[torch.Tensor]:
        """Exactly `minibatches` row sets holding balanced counts of whole episodes (some may be empty)."""
        bounds = torch.searchsorted(self.episode_of_row.cpu(), torch.arange(self.num_episodes + 1))
        return [
            torch.arange(int(bounds[p[0]]), int(bounds[p[-1] + 1])) if len(p) else torch.zeros(0, dtype=torch.long)
            for p in torch.arange(self.num_episodes).tensor_split(minibatches)
        ]

    def minibatch(self, rows: torch.Tensor) -> "TrainBatch":
        """These rows, cut to their own longest row (sequences are right-padded to the whole batch's)."""
        sequences = self.sequences.select(rows)
        width = sequences.width
        cut = lambda t: None if t is None else t[rows][:, : width - 1]  # noqa: E731
        return TrainBatch(
            sequences.trimmed(width),
            cut(self.old_logprobs),
            cut(self.advantages),
            cut(self.returns),
            cut(self.value_mask),
            cut(self.ref_logprobs),
            self.episode_of_row[rows],
            self.episode_tokens[rows],
            cut(self.engine_logprobs),
            cut(self.engine_mask),
            None if self.segment_kinds is None else [self.segment_kinds[i] for i in rows.tolist()],
        )

    def counts(self, rows: torch.Tensor) -> torch.Tensor:
        """[policy tokens, episodes with a policy token, critic tokens] of these rows."""
        mask = self.sequences.response_mask[rows]
        critic = self.value_mask[rows].sum() if self.value_mask is not None else 0.0
        with_tokens = episodes_with_tokens(mask, self.episode_of_row[rows])
        return torch.tensor([float(mask.sum()), float(with_tokens), float(critic)], dtype=torch.float64)
