"""The `optim:` section: AdamW, minibatches, token budget, activation checkpointing and offload, rank balancing."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimSection:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0
    minibatches: int = 1  # optimizer steps per RL step (split of the batch)
    warmup_steps: int = 0
    value_lr: float = 1e-3  # the critic's adapter and value head (gae / egae; allsync/update/critic.py)
    # padded tokens (rows x longest row) per forward pass: the logprob passes and each minibatch's forward+backward
    # run in row groups of at most this many (gradients accumulate exactly); None: all rows at once
    max_tokens_per_forward: int | None = None
    activation_checkpointing: bool = False  # keep only decoder-layer inputs for backward and recompute the rest
    # what each training forward saves for backward waits in host memory (torch.autograd.graph.save_on_cpu, pinned
    # on GPUs) and comes back when backward needs it; with activation_checkpointing: the layers' inputs
    activation_offload: bool = False
    # before the update, the rows of each minibatch move between the workers so that each holds nearly the same tokens
    # (whole episodes, longest-processing-time rule; allsync/update/balance.py): expert-parallel ranks, which run their
    # forwards in lockstep, and every minibatch's gradient all-reduce wait less for the worker with the most. The same
    # token-mean update (float sums in another order)
    balance_ranks: bool = False

    def check(self, fail) -> None:
        if self.max_tokens_per_forward is not None and self.max_tokens_per_forward < 1:
            fail(
                f"optim.max_tokens_per_forward = {self.max_tokens_per_forward}: must be >= 1 (or null: all rows at once)"
            )
        if self.grad_clip <= 0:  # (every float setting is finite and >= 0: check_numbers)
            fail(f"optim.grad_clip = {self.grad_clip}: must be > 0")
        if len(self.betas) != 2:
            fail("optim.betas must have two values")
        if not all(0 <= b < 1 for b in self.betas):
            fail(f"optim.betas = {self.betas}: each must be in [0, 1)")
        if self.minibatches < 1:
            fail(f"optim.minibatches = {self.minibatches}: must be >= 1")
