"""The `algorithm:` section: advantage estimator, policy loss, clips, dynamic sampling, overlong shaping, TIS."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OverlongSection:
    max_len: int = 16
    cache_len: int = 4
    factor: float = 1.0
    filter_truncated: bool = False

    def check(self, fail) -> None:
        if not 0 < self.cache_len < self.max_len:
            fail(f"algorithm.overlong: need 0 < cache_len ({self.cache_len}) < max_len ({self.max_len})")


@dataclass
class TISSection:
    """algorithm.tis: truncated importance sampling for a sampler that is not the trainer (allsync.algorithms.importance)."""

    level: str = "token"  # token: min(pi_old / pi_engine, cap) per token | sequence: the product over the row, capped
    cap: float = 2.0

    def check(self, fail) -> None:
        from allsync.algorithms import TIS_LEVELS

        if self.level not in TIS_LEVELS:
            fail(f"algorithm.tis.level = {self.level!r}: use token or sequence")
        if not self.cap >= 1.0:
            fail(f"algorithm.tis.cap = {self.cap}: must be >= 1 (a weight of 1 is no correction)")


@dataclass
class AlgorithmSection:
    advantage: str = "grpo"  # grpo | drgrpo (group baselines) | gae | egae (PPO with a critic; egae = T-PPO)
    policy_loss: str = "clipped"  # allsync.algorithms.POLICY_LOSSES: clipped (PPO's surrogate with DAPO's clip-higher)
    loss_agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    dynamic_sampling: bool = True
    max_sampling_rounds: int = 4
    filter_metric: str = (
        "acc"  # dynamic sampling keeps groups whose acc (correctness, DAPO/verl) | reward (shaped) varies
    )
    on_sampling_cap: str = "partial"  # max_sampling_rounds reached: partial (train on the groups kept) | error
    # dynamic sampling fills: worker (each worker its own quota: a step waits for the unluckiest) | global (the
    # workers the whole batch together: as many rounds as they need together; a worker may train on more or fewer)
    sampling_fill: str = "worker"
    # dynamic sampling's rounds: sequential (each starts when the last has ended) | streamed (the next round's rows
    # wait behind the last's in the torch engine's queue and take slots as its rows end; the same batch, without
    # each round's tail: allsync/producers/streamed.py)
    sampling_rounds: str = "sequential"
    overlong: OverlongSection | None = None
    tis: TISSection | None = None  # reweight each token's policy loss by min(pi_old / pi_engine, cap)
    # R3: the trainer's MoE layers use the experts the engine chose for each token (gate weights from the trainer's
    # own router scores at them); moe_lora.routing
    routing_replay: bool = False
    kl_coef: float = 0.0  # beta of the KL penalty to the reference policy (the frozen base, adapters off)
    kl_estimator: str = "k3"
    gamma: float = 1.0  # gae / egae discount
    lam: float = 0.95  # gae / egae lambda
    # lambda of the critic's targets (decoupled GAE, as VAPO): 1 = the Monte Carlo return of a finished response,
    # not biased toward the critic's own bootstrap; the policy's advantages keep algorithm.lam
    value_lam: float = 1.0
    # the first N steps train only the critic, on the starting policy's responses (VAPO's value pretraining):
    # the policy's first advantages come from a critic that has seen its returns
    value_pretrain_steps: int = 0
    # how a critic's advantages (gae / egae) are normalized over the batch's trained tokens: batch (PPO's:
    # (A - mean) / std) | scale (A / std: each token keeps the sign its critic gave it; with T-PPO's windows the
    # batch's mean, set by the finished windows, otherwise shifts every cut window's tokens alike)
    whiten: str = "batch"
    # the sampling policy's logprobs when a step has several minibatches (optim.minibatches > 1; with one, the
    # update's own forward gives them): recompute (a no-gradient forward of the whole batch before the update) |
    # engine (the logprobs the engine sampled with: rollout.engine torch samples from the trainer's own model and
    # adapter, so they are the same policy's in another kernel order, and the forward is saved; the gap is then
    # measured on the forwards before the step's first optimizer step)
    old_logprobs: str = "recompute"

    @property
    def estimator(self):
        """The advantage estimator algorithm.advantage names (allsync.algorithms.ADVANTAGE_ESTIMATORS)."""
        from allsync.algorithms import get

        return get("advantage", self.advantage)

    @property
    def uses_critic(self) -> bool:
        """The estimator learns a critic (PPO's gae, T-PPO's egae; allsync/update/critic.py); group baselines (grpo, drgrpo) do not."""
        return self.estimator.needs_critic

    def check_clips(self, reads: tuple[str, ...], fail) -> None:
        """The clip settings the policy loss reads (PolicyLossEntry.reads) in their ranges; one it does not read
        refused unless left at its default (it would be accepted and ignored)."""
        default = AlgorithmSection()
        if ignored := [
            k for k in ("clip_low", "clip_high", "clip_c") if k not in reads and getattr(self, k) != getattr(default, k)
        ]:
            fail(
                f"algorithm.{ignored[0]} = {getattr(self, ignored[0])} with algorithm.policy_loss {self.policy_loss}: "
                f"the loss does not read it (it reads {', '.join(f'algorithm.{k}' for k in reads) or 'no clip setting'})"
            )
        if "clip_c" in reads and self.clip_c is not None and self.clip_c <= 1:
            fail(f"algorithm.clip_c = {self.clip_c}: the dual clip constant must be > 1")
        if "clip_low" in reads and not 0 < self.clip_low < 1:
            fail(f"algorithm.clip_low = {self.clip_low}: must be in (0, 1)")
        if "clip_high" in reads and not self.clip_high > 0:
            fail(f"algorithm.clip_high = {self.clip_high}: must be > 0")

    def check(self, fail) -> None:
        from allsync.algorithms import estimators_that, get  # registry lookups name the valid choices

        if self.max_sampling_rounds < 1:
            fail(f"algorithm.max_sampling_rounds = {self.max_sampling_rounds}: must be >= 1")
        if self.filter_metric not in ("acc", "reward"):
            fail(
                f"algorithm.filter_metric = {self.filter_metric!r}: use acc (correctness, as DAPO) or reward (shaped reward)"
            )
        if self.sampling_fill not in ("worker", "global"):
            fail(
                f"algorithm.sampling_fill = {self.sampling_fill!r}: use worker (each worker fills its own quota) or "
                "global (the workers fill the batch together)"
            )
        if self.old_logprobs not in ("recompute", "engine"):
            fail(
                f"algorithm.old_logprobs = {self.old_logprobs!r}: use recompute (a forward before the update) or "
                "engine (the torch engine's sampling logprobs)"
            )
        if self.old_logprobs == "engine" and self.tis is not None:
            fail(
                "algorithm.old_logprobs engine with algorithm.tis: TIS weighs pi_old / pi_engine, which is 1 when the "
                "old logprobs are the engine's (use recompute)"
            )
        if self.sampling_rounds not in ("sequential", "streamed"):
            fail(
                f"algorithm.sampling_rounds = {self.sampling_rounds!r}: use sequential (each round after the last) or "
                "streamed (the next round's rows queued behind the last's)"
            )
        if self.sampling_rounds == "streamed" and not self.dynamic_sampling:
            fail("algorithm.sampling_rounds = 'streamed' without algorithm.dynamic_sampling: there is one round only")
        if self.sampling_fill == "global" and not self.dynamic_sampling:
            fail("algorithm.sampling_fill = 'global' without algorithm.dynamic_sampling: there is nothing to fill")
        if self.on_sampling_cap not in ("partial", "error"):
            fail(
                f"algorithm.on_sampling_cap = {self.on_sampling_cap!r}: use partial (train on the groups kept) or error"
            )
        for name, kind in (
            ("advantage", "advantage"),
            ("policy_loss", "policy_loss"),
            ("loss_agg", "loss_aggregation"),
        ):
            try:
                get(kind, getattr(self, name))
            except ValueError as exc:
                fail(f"algorithm.{name}: {exc}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1 and 0 <= self.value_lam <= 1):
            fail(
                f"algorithm.gamma = {self.gamma}, algorithm.lam = {self.lam} and algorithm.value_lam = "
                f"{self.value_lam} must be in [0, 1]"
            )
        loss = get("policy_loss", self.policy_loss)
        if loss.rollout_refusal is not None:
            fail(f"algorithm.policy_loss {self.policy_loss}: {loss.rollout_refusal}")
        if self.value_pretrain_steps < 0:
            fail(f"algorithm.value_pretrain_steps = {self.value_pretrain_steps}: must be >= 0")
        if not self.uses_critic and (self.value_pretrain_steps or self.value_lam != 1.0):
            fail(
                f"algorithm.value_pretrain_steps / value_lam with algorithm.advantage {self.advantage}: group baselines "
                f"have no critic (use {estimators_that(needs_critic=True)})"
            )
        if self.whiten not in ("batch", "scale"):
            fail(f"algorithm.whiten = {self.whiten!r}: use batch ((A - mean) / std) or scale (A / std)")
        if not self.uses_critic and self.whiten != "batch":
            fail(
                f"algorithm.whiten {self.whiten} with algorithm.advantage {self.advantage}: it normalizes a critic's "
                f"advantages (use {estimators_that(needs_critic=True)}); group baselines normalize per group"
            )
        self.check_clips(loss.reads, fail)
        if self.kl_coef > 0:
            try:
                get("kl", self.kl_estimator)
            except ValueError as exc:
                fail(f"algorithm.kl_estimator: {exc}")
        if self.overlong is not None:
            self.overlong.check(fail)
        if self.tis is not None:
            self.tis.check(fail)
