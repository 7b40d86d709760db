"""The update: what every producer's episodes are trained with, one policy (allsync/update/policy_state.py) at a time.

    learner.train(policy, episodes, group_index)

The stages, each calling only those below it: episodes -> a TrainBatch (batches.py, with the no-gradient forwards of
passes.py) -> minibatches of whole episodes (train_batch.py; balance.py moves rows between workers) -> micro-batches
-> the policy's loss (loss.py over forward.py) and the critic's (critic.py) -> backward into the flat gradient
buffers -> one all-reduce -> AdamW (optimizer.py). It never knows how the episodes were generated.

Exactness across micro-batches and workers: every worker all-reduces each minibatch's counts (trained
tokens, episodes with a trained token, critic tokens) before its first backward, so each worker's loss is
its exact share of the global batch's and the summed gradients are the full batch's. Minibatches hold
whole episodes (the rows of one episode are never split), so per-episode denominators are exact too.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext

import torch

from allsync.algorithms import get
from allsync.episodes import Episode
from allsync.metrics import loss_stat_key
from allsync.update.balance import balanced
from allsync.update.batches import BatchBuilder, recomputes_old_logprobs
from allsync.update.critic import ValueTargets, critic_loss
from allsync.update.forward import checkpointed_decoder_layers, saved_on_host
from allsync.update.loss import LossSettings, loss_settings, minibatch_loss
from allsync.update.optimizer import step_skipping
from allsync.update.passes import ForwardPasses, placed_rows
from allsync.update.policy_state import PolicyState
from allsync.update.sequences import largest_logprob_gap, logprob_gap
from allsync.update.train_batch import TrainBatch
from moe_lora.routing import replaying


def update_sums(settings: LossSettings, tb: TrainBatch | None) -> dict:
    """The metrics one update adds up (token sums and counts; allsync.metrics divides them), all zero."""
    return {
        "loss_sum": 0.0,
        # the policy loss's own statistics (PolicyLossEntry.logged), token sums; allsync.metrics divides
        **{loss_stat_key(name): 0.0 for name in get("policy_loss", settings.policy_loss).logged},
        "entropy_sum": 0.0,
        "kl_ref_sum": 0.0,
        "logprob_gap": 0.0,
        "logprob_gap_max": 0.0,
        "trained_samples": tb.num_episodes if tb else 0,
        "trained_tokens": 0,
        "nan_steps": 0,
        "optimizer_steps": 0,
        "empty_minibatches": 0,
        "grad_norm": 0.0,
        **({"tis_sum": 0.0, "tis_capped_sum": 0.0} if settings.tis_level is not None else {}),
    }


def gap_metrics(gap: TrainBatch | None, warn_over: float, rank: int) -> dict:
    """logprob_gap / logprob_gap_max between the engine's and the trainer's sampling-policy logprobs on `gap`'s
    trained tokens (none without a batch or engine logprobs: recipes/nlft.py's examples); warns over `warn_over`
    (rollout.logprob_gap_warn)."""
    if gap is None or gap.engine_logprobs is None:
        return {}
    mask = gap.sequences.response_mask
    out = {
        "logprob_gap": logprob_gap(gap.engine_logprobs, gap.old_logprobs, mask),
        "logprob_gap_max": largest_logprob_gap(gap.engine_logprobs, gap.old_logprobs, mask),
    }
    if not math.isfinite(out["logprob_gap"]) or out["logprob_gap"] > warn_over:
        print(
            f"warning: worker {rank}: engine/trainer logprob gap {out['logprob_gap']:.4f} nats "
            f"(> {warn_over}): check adapter sync and engine kernels"
        )
    return out


class Learner:
    def __init__(
        self,
        model,
        config,
        groups,
        layout,
        device: torch.device,
        pad_id: int,
        timeline,
        rank: int,
        before_gradient_reduce=None,
    ):
        """groups: allsync.distributed.process_groups.Groups (world / ep / edp); layout: the ExpertLayout or None.
        before_gradient_reduce(flat_grad): called before every gradient all-reduce (fault drills, allsync/health/faults.py)."""
        self.before_gradient_reduce = before_gradient_reduce
        self.model, self.config, self.groups, self.layout = model, config, groups, layout
        self.device, self.pad_id, self.timeline, self.rank = device, pad_id, timeline, rank
        self.passes = ForwardPasses(model, config, groups, pad_id, device)  # the no-gradient passes
        self.batches = BatchBuilder(config, self.passes, pad_id, device, lambda t: self.all_reduce(t))
        self.loss_settings = loss_settings(config)

    def all_reduce(self, tensor: torch.Tensor, group: str = "world") -> torch.Tensor:
        """Sum over the workers of `group`, in place; the time blocked in it is not busy time (see Timeline)."""
        before = self.groups.waited
        self.groups.all_reduce(tensor, group)
        self.timeline.waited(self.groups.waited - before)
        return tensor

    def train(self, policy: PolicyState, episodes: list[Episode], group_index: torch.Tensor) -> dict:
        """The one entry of every producer's episodes: `critic_batch` (an estimator that learns a critic) or
        `episode_batch` (group baselines), then `update`; an idle rank under EP runs the same forward passes."""
        if not episodes and self.groups.expert_parallel:  # the forward passes episode_batch would run, on an idle row
            idle = self.passes.idle_batch().sequences
            if policy.critic is not None:
                self.passes.current_values(idle, policy.critic)
            if recomputes_old_logprobs(self.config):
                self.passes.current_logprobs(idle)
            self.passes.reference_logprobs(idle)
        if policy.critic is not None:
            make_batch = lambda e: self.batches.critic_batch(e, policy.critic)  # noqa: E731
        else:
            batch_sums = self.batches.estimator_batch_sums(episodes, group_index)  # every rank: a collective
            make_batch = lambda e: self.batches.episode_batch(e, group_index, batch_sums)  # noqa: E731
        with replaying(self.model, self.config.algorithm.routing_replay) as routing:
            self.model.routing_replay = routing  # forward_pass hands it each batch's recorded experts
            try:
                tb = make_batch(episodes) if episodes else None
                out = self.update(policy, tb)
            finally:
                del self.model.routing_replay
        mismatched, counted = routing.take_counts()
        if counted:  # the engine recorded its experts: how many (trained token, MoE layer) pairs the trainer differs on
            out.update(routing_mismatched=mismatched, routing_counted=counted)
        if tb is not None and tb.critic_sums is not None:
            out.update({key: sums.tolist() for key, sums in tb.critic_sums.items()})
        return out

    def update(self, policy: PolicyState, tb: TrainBatch | None) -> dict:
        """`optim.minibatches` updates of `policy` on tb's masked tokens. Every worker runs the same collectives
        whatever it holds: one all-reduce of every minibatch's counts, then per minibatch one all-reduce of the
        flat gradient buffer (with a non-finite-loss flag). Loss shares use the all-reduced counts, so the
        summed gradient is the full batch's. A minibatch with no token on any worker is no optimizer step
        (AdamW would still move the adapter through momentum and weight decay), and a model (policy or critic) with
        no token in a minibatch on any worker is not stepped by it (PolicyState.untrained_params); a non-finite loss
        on any worker or a non-finite gradient norm skips the step on every worker (`nan_steps`)."""
        policy.set_warmup_lrs()
        out = update_sums(self.loss_settings, tb)
        out["local_grad_norm"] = 0.0  # the last minibatch's share of this rank, before the all-reduce (health signal)
        parts, local, shares = self.minibatches(tb, out)
        totals = self.all_reduce(local.clone())
        # the trainer's sampling-policy logprobs the engine/trainer gap is measured on: the no-gradient pass's
        # (recompute), else the update's own forwards of the first minibatch this worker trains before any optimizer
        # step (one minibatch: all of it; algorithm.old_logprobs engine: the policy has not moved yet)
        gap_batch = None
        for m, rows in enumerate(parts):
            if totals[m, 0] == 0 and totals[m, 2] == 0:
                out["empty_minibatches"] += 1
                continue
            policy.zero_grads()
            has_rows = local[m, 0] > 0 or local[m, 2] > 0
            mb = None if not has_rows else shares[m] if shares is not None else tb.minibatch(rows)
            micro, own_logprobs = self.backward_micro_batches(policy, mb, totals[m], out)
            self.passes.stop_counting_routes()  # later minibatches run after an optimizer step
            measured = own_logprobs and mb.engine_logprobs is not None  # no engine (NLFT's rows): no gap
            recomputed = recomputes_old_logprobs(self.config)
            if not recomputed and gap_batch is None and measured and out["optimizer_steps"] == 0:
                gap_batch = dataclasses.replace(mb, old_logprobs=placed_rows(own_logprobs, micro, mb.engine_logprobs))
            self.optimizer_step(policy, totals[m], out)
        gap = tb if recomputes_old_logprobs(self.config) else gap_batch  # None: no row trained here before that step
        out.update(gap_metrics(gap, self.config.rollout.logprob_gap_warn, self.rank))
        if tb is not None and tb.segment_kinds is not None and self.config.producer.reports_segment_gaps:
            out.update(segment_gaps(tb.segment_kinds, gap))
        policy.consecutive_nan = policy.consecutive_nan + 1 if out["nan_steps"] else 0
        return out

    def minibatches(self, tb: TrainBatch | None, out: dict) -> tuple[list, torch.Tensor, list | None]:
        """(each minibatch's rows of tb, this worker's counts of each [minibatches, 3]: policy tokens, episodes,
        critic tokens (float64: exact past 2^24), this worker's share of each after balancing or None); sets
        out["train_positions"], the padded token positions it trains (the work: a health signal)."""
        minibatches = self.config.optim.minibatches
        parts: list[torch.Tensor | None] = [None] * minibatches
        local = torch.zeros(minibatches, 3, dtype=torch.float64)
        if tb is not None:
            out["train_positions"] = tb.sequences.input_ids.numel()
            parts = tb.minibatch_rows(minibatches)
            local = torch.stack([tb.counts(rows) for rows in parts])
        if not (self.config.optim.balance_ranks and self.groups.world is not None):
            return parts, local, None
        shares = [  # every worker takes part, with rows or without (allsync/update/balance.py)
            balanced(
                tb.minibatch(rows) if tb is not None and len(rows) else None,
                self.groups,
                self.pad_id,
                self.device,
                self.config.optim.max_tokens_per_forward,
            )
            for rows in parts
        ]
        local = torch.stack(
            [b.counts(torch.arange(len(b))) if b else torch.zeros(3, dtype=torch.float64) for b in shares]
        )
        out["train_positions"] = sum(b.sequences.input_ids.numel() for b in shares if b is not None)
        return parts, local, shares

    def backward_micro_batches(
        self, policy: PolicyState, mb: TrainBatch | None, totals: torch.Tensor, out: dict
    ) -> tuple[list, list[torch.Tensor]]:
        """This worker's part of one minibatch, micro-batch by micro-batch (its forward groups, or one per token
        budget), backward into the flat buffers; under expert parallelism as many as the rank with the most, idle rows
        for the rest. Returns (the micro-batches' row groups, their detached logprobs: the old ones when tb has none)."""
        micro = (mb.forward_groups or self.passes.forward_chunks(mb.sequences)) if mb is not None else []
        own_logprobs = []
        checkpointing = self.config.optim.activation_checkpointing
        with (
            checkpointed_decoder_layers(self.model, checkpointing),
            checkpointed_decoder_layers(policy.critic, checkpointing and policy.critic is not None),
        ):
            for i in range(self.passes.lockstep_count(len(micro))):  # gradients accumulate: each loss is its share
                if i < len(micro):
                    part = mb if len(micro) == 1 else mb.minibatch(torch.tensor(micro[i]))
                    own_logprobs.append(self.backward(policy, part, totals, out))
                else:
                    self.backward(policy, self.passes.idle_batch(), totals, None)
        return micro, own_logprobs

    def optimizer_step(self, policy: PolicyState, totals: torch.Tensor, out: dict) -> None:
        """The minibatch's gradients all-reduced (sum of per-rank shares = the full batch's; the flag slot counts
        non-finite losses), each model clipped to optim.grad_clip by its own norm, and AdamW stepped on the models
        that had tokens; skipped on every rank alike when any loss or norm is not finite."""
        if self.before_gradient_reduce is not None:
            self.before_gradient_reduce(policy.flat_grad)
        local_sq = sum(
            torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
            for g in (policy.flat_grad[:-1], policy.flat_expert_grad)
        )
        out["local_grad_norm"] = float(local_sq.sqrt())
        self.all_reduce(policy.flat_grad)
        self.all_reduce(policy.flat_expert_grad, "edp")  # expert blocks: summed over the ranks holding the same block
        norm, value_norm = self.total_grad_norm(policy), policy.value_grad_norm()
        if policy.flat_grad[-1] > 0 or not torch.isfinite(norm + value_norm):  # identical on every rank
            out["nan_steps"] += 1
            return
        grad_clip = self.config.optim.grad_clip
        torch.nn.utils.clip_grads_with_norm_(policy.lora_params, grad_clip, norm)  # each model its own clip
        if policy.value_params:
            torch.nn.utils.clip_grads_with_norm_(policy.value_params, grad_clip, value_norm)
            out["value_grad_norm"] = float(value_norm)
        step_skipping(policy.optimizer, policy.untrained_params(totals))
        out["optimizer_steps"] += 1
        out["grad_norm"] = float(norm)

    def total_grad_norm(self, policy: PolicyState) -> torch.Tensor:
        """||g|| over every LoRA tensor of the policy. The replicated part is the same on every rank; each
        expert block's (identical over its EDP group) is counted once per EDP member by the world all-reduce:
            ||g||^2 = ||g_replicated||^2 + (sum over ranks of ||g_block(rank)||^2) / EDP size.
        One all-reduce gives every rank the same bits, so the clip factor cannot differ between ranks."""
        grads = [p.grad for p in policy.replicated_lora_params]
        replicated = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.layout is None:
            return replicated
        block = policy.flat_expert_grad.double().pow(2).sum() / self.layout.edp_size
        sq = self.all_reduce(block.reshape(1))[0] + replicated.double() ** 2
        return sq.sqrt().float()

    def backward(self, policy: PolicyState, mb: TrainBatch, totals: torch.Tensor, out: dict | None) -> torch.Tensor:
        """Loss of this worker's part of a minibatch (its share of the global batch) and its backward into the
        flat gradient buffers, the policy's then the critic's (two graphs, one alive at a time, in the same order
        on every rank); a non-finite loss sets the buffer's flag instead. out None: an idle row (expert
        parallelism), whose backward only serves the other ranks' tokens. Returns the policy forward's
        detached logprobs [rows, width - 1]. During value pretraining (policy.critic_only) the policy's forward runs
        without a graph and nothing is backpropagated into it."""
        offload = self.config.optim.activation_offload
        frozen = torch.no_grad() if policy.critic_only else nullcontext()
        with saved_on_host(offload), frozen:  # the forward only: backward's recomputation stays
            loss, sums = minibatch_loss(
                self.model,
                mb.sequences,
                mb.old_logprobs,
                mb.advantages,
                self.loss_settings,
                totals[0],
                totals[1],
                norm_length=self.config.rollout.max_new_tokens,
                ref_logprobs=mb.ref_logprobs,
                episode_tokens=mb.episode_tokens,
                engine_logprobs=mb.engine_logprobs,
            )
        finite = True if policy.critic_only else self.backward_finite(policy, loss)
        value_loss_share = None
        if policy.critic is not None:
            targets = ValueTargets(mb.returns, mb.value_mask, totals[2])
            with saved_on_host(offload):
                loss_value, value_loss_share = critic_loss(policy.critic, mb.sequences, targets)
            finite = self.backward_finite(policy, loss_value) and finite
        if out is None or not finite:
            return sums.logprobs
        out["loss_sum"] += float(loss.detach())
        if value_loss_share is not None:
            out["value_loss_sum"] = out.get("value_loss_sum", 0.0) + float(value_loss_share)
        for name, token_sum in sums.policy.items():
            out[loss_stat_key(name)] += token_sum
        out["entropy_sum"] += sums.entropy
        out["kl_ref_sum"] += sums.kl_ref
        if "tis_sum" in out:
            out["tis_sum"] += sums.tis
            out["tis_capped_sum"] += sums.tis_capped
        out["trained_tokens"] += int(mb.sequences.response_mask.sum())
        return sums.logprobs

    def backward_finite(self, policy: PolicyState, loss: torch.Tensor) -> bool:
        """loss.backward() when finite; otherwise the flat buffer's non-finite flag (every rank skips the step), and
        under expert parallelism the backward all the same: the EP peers wait for this rank's all-to-alls."""
        if torch.isfinite(loss):
            loss.backward()
            return True
        policy.flat_grad[-1] = 1.0
        if self.groups.expert_parallel:
            loss.backward()
        return False


def segment_gaps(kinds: list[str], tb: TrainBatch | None) -> dict:
    """Sum and count of |engine - trainer| logprob per segment kind over every token the engine chose (before the
    credit mask) in `tb`, the rows the gap is measured on: logprob_gap_<kind>_sum / logprob_gap_<kind>_tokens, for
    the per-kind mean over the workers. A worker with no such rows (tb None: it trained no row before the step's first
    optimizer step) adds 0 to both for each of its batch's `kinds`."""
    if tb is None:
        return {f"logprob_gap_{kind}_{part}": 0.0 for kind in sorted(set(kinds)) for part in ("sum", "tokens")}
    full = tb.engine_mask
    diff = (tb.engine_logprobs - tb.old_logprobs).abs() * full
    out = {}
    for kind in sorted(set(tb.segment_kinds)):
        rows_of_kind = torch.tensor([k == kind for k in tb.segment_kinds], device=diff.device)
        out[f"logprob_gap_{kind}_sum"] = float(diff[rows_of_kind].sum())
        out[f"logprob_gap_{kind}_tokens"] = float(full[rows_of_kind].sum())
    return out
