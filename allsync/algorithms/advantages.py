"""Advantage estimators: GRPO / Dr.GRPO (group-relative), REINFORCE++-baseline (group mean, batch spread) and
GAE / T-PPO's EGAE, registered by name in ADVANTAGE_ESTIMATORS (algorithm.advantage) as AdvantageEstimator entries.

To add one (one module and its test): its function and an AdvantageEstimator entry saying what it needs,
registered with `ADVANTAGE_ESTIMATORS["name"] = AdvantageEstimator(...)` in a module of your own that the run's
`run.imports` names (tests/fixtures/batch_baseline.py); a name already registered is refused (selection.Registry).
A formula over the whole batch declares `batch_sums` (the learner all-reduces them), never per-worker statistics.

All functions are pure torch: no distributed calls, no I/O, inputs are never
modified and the outputs carry no autograd history (advantages are targets).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .selection import Registry


def _group_ids(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (any order, any values) to 0..G-1; return (ids, G)."""
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D, got shape {tuple(group_index.shape)}")
    unique, compact = torch.unique(group_index, return_inverse=True)
    return compact, unique.numel()


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per-sample group mean, unbiased group std, group size and constant-group flag.

    Computed with scatter/index_add (no python loop over groups) in float64.
    """
    ids, num_groups = _group_ids(group_index)
    r = rewards.detach().to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, ids, torch.ones_like(r))
    mean = zeros.index_add(0, ids, r) / count
    centered = r - mean[ids]
    sq_sum = zeros.index_add(0, ids, centered * centered)
    std = torch.sqrt(sq_sum / (count - 1).clamp_min(1))  # unbiased; 0 for singletons
    group_max = zeros.scatter_reduce(0, ids, r, reduce="amax", include_self=False)
    group_min = zeros.scatter_reduce(0, ids, r, reduce="amin", include_self=False)
    constant = group_max == group_min  # covers singletons too
    return centered, std[ids], constant[ids]


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantage, one per sample (GRPO; Dr.GRPO with ``norm_by_std=False``).

    For sample i of group g (n_g samples, rewards r_j)::

        mean_g = (1/n_g) * sum_j r_j
        std_g  = sqrt( sum_j (r_j - mean_g)^2 / (n_g - 1) )     # unbiased
        A_i    = (r_i - mean_g) / (std_g + eps)   if norm_by_std   (GRPO)
        A_i    =  r_i - mean_g                    otherwise        (Dr.GRPO)

    A group whose rewards are all equal (in particular a group of one sample)
    gets exactly 0, without float round-off blown up by ``1/eps``.

    Args:
        rewards: [N] float (or int) rewards, one per sample.
        group_index: [N] LongTensor of group ids; ids need not be contiguous
            or sorted, samples of a group need not be adjacent.
    Returns:
        [N] advantages, dtype of ``rewards`` (float32 for integer rewards).
    """
    if rewards.shape != group_index.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} differ in shape")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    centered, std, constant = _group_stats(rewards, group_index)
    advantages = centered / (std + eps) if norm_by_std else centered
    advantages = torch.where(constant, torch.zeros_like(advantages), advantages)
    return advantages.to(out_dtype)


def drgrpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantage: ``A_i = r_i - mean_g`` (no division by the group std)."""
    return grpo_advantages(rewards, group_index, norm_by_std=False)


def _response_lengths(mask: torch.Tensor) -> torch.Tensor:
    return (mask != 0).sum(dim=-1)


def egae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T-PPO's extended GAE: GAE that bootstraps responses cut at a generation window.

    Token-level, right-padded [B, T] tensors; response b occupies tokens
    0..l_b-1 (``mask`` 1 there, 0 on padding). For t < l_b::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}          (A_{l_b} = 0)
        R_t     = A_t + V_t                                (value targets)

    with the value after the last token::

        V_{l_b} = 0             if the response finished (truncated[b] False)
        V_{l_b} = V_{l_b - 1}   if it was cut at a window (truncated[b] True),
                                i.e. delta_{l-1} = r_{l-1} + gamma*V_{l-1} - V_{l-1}

    Example (the T-PPO oracle): gamma 1, lam 0.95, truncated at l=4,
    V = [0.1, 0.2, 0.3, 0.5], r = 0 -> A = [0.3755, 0.29, 0.2, 0.0].

    The recursion runs a python loop over T (vectorized over B). Padding
    positions get A = R = 0. Inputs are detached.

    Returns:
        (advantages, returns), both [B, T] in the dtype of ``values``.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            "rewards, values and mask must all be [B, T]; got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if truncated.shape != rewards.shape[:1]:
        raise ValueError(f"truncated must be [B]={rewards.shape[0]}, got {tuple(truncated.shape)}")
    values = values.detach()
    rewards = rewards.detach().to(values.dtype)
    valid = (mask != 0).to(values.dtype)
    B, T = values.shape

    # Value of the state after each token: the next token's value inside the
    # response, and the bootstrap (0 or V_{l-1}) right after the last token.
    next_valid = torch.zeros_like(valid)
    next_valid[:, :-1] = valid[:, 1:]
    next_values = torch.zeros_like(values)
    next_values[:, :-1] = values[:, 1:]
    next_values = next_values * next_valid
    last_index = (_response_lengths(mask) - 1).clamp_min(0)
    is_last = torch.zeros(B, T, dtype=torch.bool, device=values.device)
    is_last[torch.arange(B, device=values.device), last_index] = True
    is_last &= valid.bool()
    bootstrap = is_last & truncated.to(torch.bool).to(values.device)[:, None]
    next_values = torch.where(bootstrap, values, next_values)

    deltas = (rewards + gamma * next_values - values) * valid
    advantages = torch.zeros_like(values)
    running = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in range(T - 1, -1, -1):
        running = deltas[:, t] + gamma * lam * next_valid[:, t] * running
        advantages[:, t] = running
    advantages = advantages * valid
    returns = (advantages + values) * valid
    return advantages, returns


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard GAE on right-padded [B, T] token tensors, value after the last token = 0::

        delta_t = r_t + gamma * V_{t+1} * [t+1 < l] - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t

    Equal to :func:`egae` with no response truncated. Returns (advantages, returns).
    """
    truncated = torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    return egae(rewards, values, mask, truncated, gamma, lam)


def whiten_advantages(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    sums: torch.Tensor | None = None,
    eps: float = 1e-8,
    center: bool = True,
) -> torch.Tensor:
    """PPO's batch normalization of advantages over the masked tokens::

        mu = sum(m A) / sum(m),  var = sum(m A^2) / sum(m) - mu^2,  A' = m (A - mu) / sqrt(var + eps)

    It removes a critic's bias (a critic that over-estimates every state makes every advantage negative
    and pushes the sampled tokens down). With ``center`` False (algorithm.whiten scale) A' = m A / sqrt(var + eps):
    the same scale, each token's sign kept. ``sums`` = [sum(m A), sum(m A^2), sum(m)] over the whole batch
    (e.g. all-reduced over workers, so every worker whitens with the same statistics); default: this
    tensor's own (see :func:`whitening_sums`).
    """
    sums = whitening_sums(advantages, mask) if sums is None else sums
    count = sums[2].clamp_min(1)
    mean = sums[0] / count
    var = (sums[1] / count - mean**2).clamp_min(0)
    return (advantages - (mean if center else 0)) / torch.sqrt(var + eps) * mask


def whitening_sums(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum(m A), sum(m A^2), sum(m)] in float64, the statistics :func:`whiten_advantages` needs."""
    a, m = advantages.double(), mask.double()
    return torch.stack([(m * a).sum(), (m * a * a).sum(), m.sum()])


def group_centered_sums(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[sum c, sum c^2, N] in float64 over the episodes, c_i = r_i - mean_g (the group-centered reward): the sums
    :func:`batch_normalized_advantages` needs, which add over workers that hold whole groups (zeros for none)."""
    if rewards.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=rewards.device)
    centered = _group_stats(rewards, group_index)[0]
    return torch.stack([centered.sum(), (centered * centered).sum(), centered.new_tensor(float(centered.numel()))])


def batch_normalized_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, sums: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++-baseline: the group mean as the baseline, the whole batch's spread as the scale::

        c_i = r_i - mean_g                                   (the group-centered reward)
        mu = sum(c) / N,  sigma = sqrt(sum(c^2) / N - mu^2)  over the batch's N episodes
        A_i = (c_i - mu) / (sigma + eps)

    Unlike GRPO's per-group std, a group whose rewards barely differ keeps small advantages. ``sums`` =
    :func:`group_centered_sums` over the whole batch (the learner all-reduces every worker's; mu is 0 when every
    group is whole); default: these episodes' own. A constant group gets exactly 0. Returns [N] in rewards' dtype
    (float32 for integer rewards)."""
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    sums = group_centered_sums(rewards, group_index) if sums is None else sums.to(torch.float64)
    centered, _, constant = _group_stats(rewards, group_index)
    count = sums[2].clamp_min(1)
    mean = sums[0] / count
    sigma = torch.sqrt((sums[1] / count - mean**2).clamp_min(0))
    advantages = (centered - mean) / (sigma + eps)
    return torch.where(constant, torch.zeros_like(advantages), advantages).to(out_dtype)


@dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage rule and what it asks of the rest of the loop, so that checks and the learner ask the estimator
    instead of naming it. Calling it calls `compute`.

    needs_groups: a baseline from the other responses to the same prompt (rollout.group_size >= 2; DAPO's dynamic
        sampling filters such groups). compute(rewards [N], group_index [N]) -> [N], one advantage per episode.
    needs_critic: values from a learned critic (PPO): compute(token_rewards, values, mask, ...) per token.
    bootstraps_cut: T-PPO's: a response cut at a generation window gets advantages from V at the cut. Such an
        estimator runs with producer.window, and only such an estimator can (the others need whole responses).
    batch_sums: a formula over the whole batch (e.g. its reward spread), which workers holding parts of it must
        agree on: batch_sums(rewards [N], group_index [N]) -> float64 [k], sums that add over workers (zeros for a
        worker with no episode). The learner sums them over every worker before any batch is built (every rank
        calls it, kept groups or none) and calls compute(rewards, group_index, sums=total): N workers then compute
        what one worker holding the whole batch computes. None: the formula is per group, exact because each
        worker holds whole groups (it generates all rollout.group_size samples of its prompts, and dynamic sampling
        keeps or drops whole groups: allsync.producers.groups); a group cut over two workers would get two baselines.
    """

    compute: Callable[..., torch.Tensor]
    needs_groups: bool
    needs_critic: bool
    bootstraps_cut: bool = False
    batch_sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, *args, **kwargs):
        return self.compute(*args, **kwargs)


ADVANTAGE_ESTIMATORS = Registry(
    "advantage",
    {
        "grpo": AdvantageEstimator(grpo_advantages, needs_groups=True, needs_critic=False),
        "drgrpo": AdvantageEstimator(drgrpo_advantages, needs_groups=True, needs_critic=False),
        "reinforce_pp_baseline": AdvantageEstimator(
            batch_normalized_advantages, needs_groups=True, needs_critic=False, batch_sums=group_centered_sums
        ),
        "gae": AdvantageEstimator(gae, needs_groups=False, needs_critic=True),
        "egae": AdvantageEstimator(egae, needs_groups=False, needs_critic=True, bootstraps_cut=True),
    },
)


def estimators_that(**needs: bool) -> str:
    """The names of the registered estimators whose AdvantageEstimator fields equal `needs` (e.g. needs_critic=True),
    joined for a refusal's hint ("gae or egae"): hints name the registry, never a hand-kept list."""
    names = [n for n, e in ADVANTAGE_ESTIMATORS.items() if all(getattr(e, k) == v for k, v in needs.items())]
    return " or ".join(names)


def split_advantage_sums(advantages: torch.Tensor, mask: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Sums over the trained tokens (``mask``) that add up over workers, float64 [4]:
    [sum A over rows cut at a window, their tokens, sum A over finished rows, their tokens].

    A cut row's advantages are the critic's own differences (EGAE with no reward yet: with lam 1,
    A_t = V_{l-1} - V_t), so their mean shows what bootstrapping adds: about 0 from a critic whose values are
    expectations of the later ones, and a steady sign from one that, say, values later positions lower.
    ``cut``: [B] bool."""
    m = mask.double()
    a = advantages.double() * m
    rows = cut.to(a.dtype)[:, None]
    return torch.stack([(a * rows).sum(), (m * rows).sum(), (a * (1 - rows)).sum(), (m * (1 - rows)).sum()])
