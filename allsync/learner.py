"""The update: what every producer's episodes are trained with.

`Learner` owns the trainable tensors (LoRA, and PPO's critic: allsync/critic.py), AdamW, the flat gradient buffers and
the minibatch loop. `train` turns episodes into a `TrainBatch` (one row per segment): `episode_batch` for group
baselines, `critic_batch` for PPO / T-PPO (advantages from the critic), and `update` trains on it. It never knows
how the episodes were generated. The forward passes outside the update (old, reference and critic values, in token
budgets and in lockstep across expert-parallel ranks) are allsync/passes.py's.

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

from allsync.algorithms import (
    egae,
    get,
    overlong_filter_mask,
    split_advantage_sums,
    value_fit_sums,
    whiten_advantages,
    whitening_sums,
)
from allsync.critic import Critic, ValueTargets, critic_loss
from allsync.episodes import Episode, flatten
from allsync.balance import balanced
from allsync.train_batch import TrainBatch
from allsync.passes import ForwardPasses, placed_rows
from allsync.metrics import loss_stat_key
from allsync.forward import (
    LossSettings,
    SequenceBatch,
    build_sequences,
    checkpointed_decoder_layers,
    largest_logprob_gap,
    logprob_gap,
    minibatch_loss,
    response_positions,
    saved_on_host,
    scatter_response_values,
    to_response_layout,
    to_sequence_layout,
)
from moe_lora.expert_parallel import expert_parameters
from moe_lora.routing import replaying


def flat_gradients(
    params: list[torch.nn.Parameter], flag: bool = True, device: torch.device | None = None
) -> torch.Tensor:
    """One zeroed buffer holding every parameter's .grad as a view, plus (flag) one last slot for a flag (a
    rank's non-finite loss): a minibatch's gradients and the flag are all-reduced in one collective."""
    if not params:
        return torch.zeros(int(flag), device=device)
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError(
            f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; one flat gradient buffer needs one"
        )
    flat = torch.zeros(sum(p.numel() for p in params) + int(flag), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """lr(step) = lr * clamp((step + 1) / warmup_steps, 0, 1), step counted from 0 (a param group's own step: the
    policy's is negative during value pretraining, where its group is not stepped)."""
    return lr * min(1.0, max(0.0, (step + 1) / warmup_steps)) if warmup_steps > 0 else lr


def allocate_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state of every parameter now, as its first step would create it (step 0, zero moments exp_avg and
    exp_avg_sq shaped like the parameter), which that step then finds and continues: the same updates. The moments
    (2 x the adapter's bytes; 4 GB per GPU in the 671B config) are held from the start, so a vLLM engine built
    next sees them gone from the free memory its share is read from (rollout.gpu_memory_utilization None), instead
    of the first optimizer.step() allocating them after the engine took that memory for its KV cache."""
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's own
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable") or group.get("amsgrad"):
            raise ValueError("allocate_adamw_state builds the plain AdamW's state (no fused, capturable or amsgrad)")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=step_dtype, device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def load_adamw_state_in_place(optimizer: torch.optim.Optimizer, saved: dict, source: str) -> None:
    """Optimizer.load_state_dict into the state tensors `allocate_adamw_state` holds, copied in place: a resume
    never holds two copies of the moments beside a colocated engine (load_state_dict builds new tensors first). A
    parameter with no saved state (never stepped) gets a fresh one: step 0, zero moments. The saved param groups'
    options are taken too (the learner then sets the config's: Learner.apply_optim_settings)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_counts = [len(group["params"]) for group in saved["param_groups"]]
    if saved_counts != [len(group["params"]) for group in optimizer.param_groups]:
        raise ValueError(
            f"{source}: the saved optimizer has param groups of {saved_counts} tensors, this run "
            f"{[len(g['params']) for g in optimizer.param_groups]} (another lora.rank / targets / critic?)"
        )
    for index, p in enumerate(params):
        values = saved["state"].get(index, {})
        for name, tensor in optimizer.state[p].items():
            if name not in values:
                tensor.zero_()
            elif tuple(values[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{source}: optimizer state {index}.{name} is {list(values[name].shape)}, this run's "
                    f"{list(tensor.shape)} (another lora.rank or lora.expert_layout?)"
                )
            else:
                tensor.copy_(values[name])
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def group_steps(adapter_version: int, algorithm) -> tuple[int, int]:
    """Each param group's own step count from 0, for its warm-up: the policy's (group 0) starts after the critic-only
    steps of value pretraining, the critic's (group 1) at version 0:
        policy step = version - value_pretrain_steps,  critic step = version."""
    return adapter_version - algorithm.value_pretrain_steps, adapter_version


def step_skipping(optimizer: torch.optim.Optimizer, skipped: list[torch.nn.Parameter]) -> None:
    """optimizer.step() that leaves `skipped` and their state untouched. AdamW steps every parameter whose .grad is
    not None: a zero gradient still advances state["step"], which shifts its bias correction
    (1 - beta^t) for every later update, and decays momentum. A parameter whose .grad is None is not visited, so the
    skipped ones' grads (views into the flat buffer) are set aside for the call and put back."""
    grads = [p.grad for p in skipped]
    for p in skipped:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in zip(skipped, grads):
            p.grad = grad


def loss_settings(config) -> LossSettings:
    """The policy loss's settings; the producer says the aggregation (ProducerDefaults.loss_aggregation)."""
    a = config.algorithm
    agg = config.producer.loss_aggregation(a.loss_agg)
    tis = {"tis_level": a.tis.level, "tis_cap": a.tis.cap} if a.tis is not None else {}
    return LossSettings(
        a.clip_low,
        a.clip_high,
        a.clip_c,
        agg,
        config.rollout.temperature,
        a.kl_coef,
        a.kl_estimator,
        a.policy_loss,
        **tis,
    )


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
        """groups: allsync.launch.process_groups.Groups (world / ep / edp); layout: the ExpertLayout or None.
        before_gradient_reduce(flat_grad): called before every gradient all-reduce (fault drills, allsync/health/faults.py)."""
        self.before_gradient_reduce = before_gradient_reduce
        self.model, self.config, self.groups, self.layout = model, config, groups, layout
        self.device, self.pad_id, self.timeline, self.rank = device, pad_id, timeline, rank
        self.lora_params = [p for p in model.parameters() if p.requires_grad]
        sharded = {id(p) for p in expert_parameters(model)} if layout is not None else set()
        self.expert_params = [p for p in self.lora_params if id(p) in sharded]  # summed over the EDP group
        self.replicated_lora_params = [p for p in self.lora_params if id(p) not in sharded]
        self.critic = Critic(model, config.run.seed) if config.algorithm.uses_critic else None
        self.value_params = list(self.critic.trainable_tensors().values()) if self.critic is not None else []
        self.passes = ForwardPasses(model, self.critic, config, groups, pad_id, device)  # the no-gradient passes
        self.params = self.replicated_lora_params + self.value_params  # summed over every rank
        self.flat_grad = flat_gradients(self.params, device=device)  # every rank all-reduces one buffer per minibatch
        self.flat_expert_grad = flat_gradients(self.expert_params, flag=False, device=device)
        for p in self.params:  # replicas start identical whatever their seeds
            self.groups.broadcast(p.data)
        self.optimized = self.lora_params + self.value_params
        self.optimizer = torch.optim.AdamW(
            [{"params": self.lora_params}] + ([{"params": self.value_params}] if self.value_params else [])
        )
        allocate_adamw_state(self.optimizer)  # before a colocated engine measures the memory left free
        self.apply_optim_settings()
        self.loss_settings = loss_settings(config)
        self.consecutive_nan = 0

    def optim_settings(self) -> list[dict]:
        """Per AdamW param group (the adapter's, then the critic's), the settings the config gives it."""
        o = self.config.optim
        common = {"betas": tuple(o.betas), "weight_decay": o.weight_decay}
        return [{"base_lr": o.lr, "lr": o.lr, **common}, {"base_lr": o.value_lr, "lr": o.value_lr, **common}][
            : len(self.optimizer.param_groups)
        ]

    def apply_optim_settings(self) -> list[str]:
        """Set each param group's optim.* settings from the config (after loading a checkpoint, whose saved groups
        would otherwise override them); returns `key: old -> new` for each one that changed."""
        changed = []
        for index, (group, settings) in enumerate(zip(self.optimizer.param_groups, self.optim_settings())):
            for key, value in settings.items():
                if key != "lr" and key in group and group[key] != value:
                    changed.append(f"param group {index} {key}: {group[key]} -> {value}")
                group[key] = value
        return changed

    def all_reduce(self, tensor: torch.Tensor, group: str = "world") -> torch.Tensor:
        """Sum over the workers of `group`, in place; the time blocked in it is not busy time (see Timeline)."""
        before = self.groups.waited
        self.groups.all_reduce(tensor, group)
        self.timeline.waited(self.groups.waited - before)
        return tensor

    @property
    def reuses_update_forward(self) -> bool:
        """One minibatch: every forward of the update runs before its one optimizer step, so the policy it computes
        is the sampling policy and its own detached logprobs are the old ones (no separate no-gradient pass;
        forward.minibatch_loss). A critic's values still come from a forward before the update: its advantages
        need them."""
        return self.config.optim.minibatches == 1

    @property
    def recomputes_old_logprobs(self) -> bool:
        """Several minibatches and algorithm.old_logprobs recompute: a no-gradient forward before the update."""
        return not self.reuses_update_forward and self.config.algorithm.old_logprobs == "recompute"

    def old_logprobs(self, batch: SequenceBatch, engine_logprobs: torch.Tensor | None) -> torch.Tensor | None:
        """The sampling policy's logprobs at the batch's tokens: None when the update's own forward gives them
        (reuses_update_forward), a no-gradient forward (current_logprobs) with algorithm.old_logprobs recompute,
        else the engine's (the torch engine samples from this model and adapter)."""
        if self.reuses_update_forward:
            return None
        return self.passes.current_logprobs(batch) if self.recomputes_old_logprobs else engine_logprobs

    # ------------------------------------------------------------------------------ batches
    def episode_batch(
        self, episodes: list[Episode], group_index: torch.Tensor, batch_sums: torch.Tensor | None = None
    ) -> TrainBatch:
        """Group baselines (GRPO / Dr.GRPO / REINFORCE++-baseline) over the episodes' rewards: one advantage per
        episode, copied to every trained token of each of its segments (allsync.algorithms.segment_credit); the
        producer picks the rows that train (multiconv's producer.credit final: the answer segments). DAPO's overlong
        filter masks a whole episode whose answer was cut at the token budget. batch_sums: the estimator's sums over every
        worker's episodes (`estimator_batch_sums`), for an estimator that declares them."""
        a = self.config.algorithm
        rows = flatten(episodes)
        rewards = torch.tensor([e.reward for e in episodes])
        whole_batch = {"sums": batch_sums} if batch_sums is not None else {}
        episode_advantages = get("advantage", a.advantage)(rewards, group_index, **whole_batch).to(self.device)
        batch = build_sequences(rows.prompt_ids, rows.response_ids, self.pad_id, rows.routing).to(self.device)
        engine_logprobs = scatter_response_values(rows.engine_logprobs, batch)  # before the masks below make gaps
        episode_of_row = torch.tensor(rows.episode_of_row, device=self.device)
        if (masks := rows.loss_masks) is not None:  # tool observations: not chosen by the policy, not trained
            batch.response_mask = batch.response_mask * scatter_response_values(masks, batch)
        engine_mask = batch.response_mask
        # the tokens the producer trains (multiconv's producer.credit final: the answer segments' only)
        batch.response_mask = self.config.producer.trained_mask(
            batch.response_mask, torch.tensor(rows.is_answer, device=self.device)
        )
        if a.overlong is not None and a.overlong.filter_truncated:
            reasons = ["length" if cut else "stop" for cut in rows.truncated_episode]
            batch.response_mask = overlong_filter_mask(reasons, batch.response_mask)
        old_logprobs = self.old_logprobs(batch, engine_logprobs)
        advantages = episode_advantages[episode_of_row][:, None].expand_as(batch.response_mask).float()
        return TrainBatch(
            batch,
            old_logprobs,
            advantages,
            ref_logprobs=self.passes.reference_logprobs(batch),
            episode_of_row=episode_of_row,
            engine_logprobs=engine_logprobs,
            engine_mask=engine_mask,
            segment_kinds=[s.kind for s in rows.segments],
        )

    def estimator_batch_sums(self, episodes: list[Episode], group_index: torch.Tensor) -> torch.Tensor | None:
        """The advantage estimator's whole-batch sums (AdvantageEstimator.batch_sums) of this worker's episodes,
        summed over every worker; None for an estimator without them. Every rank calls it, with episodes or
        none (the all-reduce is collective: a rank that kept no group still takes part)."""
        estimator = get("advantage", self.config.algorithm.advantage)
        if estimator.batch_sums is None:
            return None
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
        return self.all_reduce(estimator.batch_sums(rewards, group_index.cpu()).to(self.device))

    def critic_batch(self, episodes: list[Episode]) -> TrainBatch:
        """PPO / T-PPO (producer.kind windows): one-segment episodes, each a response so far whose loss mask marks the
        tokens to train (T-PPO: the latest window's). Advantages by EGAE over each whole response (the reward on the
        last token of finished ones; a response cut at a window, finish reason "window", bootstraps
        V(s_l) = V(s_{l-1})) with the current critic, whitened over the trained tokens of every worker; the critic
        learns from every token of finished responses, toward returns of lambda algorithm.value_lam."""
        a = self.config.algorithm
        if several := [i for i, e in enumerate(episodes) if len(e.segments) != 1]:
            raise ValueError(
                f"algorithm.advantage {a.advantage} learns a critic over one response per episode, and episode "
                f"{several[0]} of this batch has {len(episodes[several[0]].segments)} segments ({len(several)} such): "
                "its rewards would be paired with the wrong rows; producers of several segments need a group baseline"
            )
        rows = flatten(episodes)
        seqs = build_sequences(rows.prompt_ids, rows.response_ids, self.pad_id).to(self.device)
        engine = scatter_response_values(rows.engine_logprobs, seqs)
        old_values = self.passes.current_values(seqs)
        old_logprobs = self.old_logprobs(seqs, engine)
        index, valid = response_positions(seqs.response_mask)
        width = seqs.response_mask.shape[1]
        reasons = [s.finish_reason for s in rows.segments]
        token_rewards = torch.zeros(valid.shape, device=self.device)
        for i, (episode, reason) in enumerate(zip(episodes, reasons)):
            if reason != "window":
                token_rewards[i, len(episode.final.response_ids) - 1] = episode.reward
        is_finished = torch.tensor([reason != "window" for reason in reasons], device=self.device)
        values, cut = to_response_layout(old_values, index, valid), ~is_finished
        advantages, returns = egae(token_rewards, values, valid.float(), cut, a.gamma, a.lam)
        if a.value_lam != a.lam:  # decoupled GAE: the critic's targets with their own lambda
            returns = egae(token_rewards, values, valid.float(), cut, a.gamma, a.value_lam)[1]
        policy_mask = seqs.response_mask
        if (masks := rows.loss_masks) is not None:
            policy_mask = policy_mask * scatter_response_values(masks, seqs)
        if a.overlong is not None and a.overlong.filter_truncated:
            policy_mask = overlong_filter_mask(reasons, policy_mask)
        value_fit = value_fit_sums(values, returns, valid.float() * is_finished[:, None])
        advantages = to_sequence_layout(advantages, index, valid, width)
        critic_sums = {
            "value_fit_sums": value_fit,
            "advantage_split_sums": split_advantage_sums(advantages, policy_mask, cut),
        }
        sums = self.all_reduce(whitening_sums(advantages, policy_mask))  # the whole batch's statistics
        return TrainBatch(
            SequenceBatch(seqs.input_ids, seqs.attention_mask, policy_mask),
            old_logprobs,
            advantages=whiten_advantages(advantages, policy_mask, sums, center=a.whiten == "batch").float(),
            returns=to_sequence_layout(returns, index, valid, width),
            value_mask=seqs.response_mask * is_finished[:, None],
            ref_logprobs=self.passes.reference_logprobs(seqs),
            engine_logprobs=engine,
            critic_sums=critic_sums,
        )

    @property
    def balances_ranks(self) -> bool:
        """optim.balance_ranks with more than one worker: the rows of each minibatch move between workers first."""
        return self.config.optim.balance_ranks and self.groups.world is not None

    def balanced_minibatches(self, tb: TrainBatch | None, parts: list) -> list:
        """This worker's share of every minibatch after balancing (allsync/balance.py); every worker takes part,
        with rows or without."""
        return [
            balanced(
                tb.minibatch(rows) if tb is not None and len(rows) else None,
                self.groups,
                self.pad_id,
                self.device,
                self.config.optim.max_tokens_per_forward,
            )
            for rows in parts
        ]

    def train(self, episodes: list[Episode], group_index: torch.Tensor, adapter_version: int) -> dict:
        """The one entry of every producer's episodes: `critic_batch` (an estimator that learns a critic) or
        `episode_batch` (group baselines), then `update`; an idle rank under EP runs the same forward passes."""
        if not episodes and self.groups.expert_parallel:  # the forward passes episode_batch would run, on an idle row
            idle = self.passes.idle_batch().sequences
            if self.critic is not None:
                self.passes.current_values(idle)
            if self.recomputes_old_logprobs:
                self.passes.current_logprobs(idle)
            self.passes.reference_logprobs(idle)
        if self.critic is not None:
            make_batch = self.critic_batch
        else:
            batch_sums = self.estimator_batch_sums(episodes, group_index)  # every rank: a collective
            make_batch = lambda e: self.episode_batch(e, group_index, batch_sums)  # noqa: E731
        with replaying(self.model, self.config.algorithm.routing_replay) as routing:
            self.model.routing_replay = routing  # forward_pass hands it each batch's recorded experts
            try:
                tb = make_batch(episodes) if episodes else None
                out = self.update(tb, adapter_version)
            finally:
                del self.model.routing_replay
        mismatched, counted = routing.take_counts()
        if counted:  # the engine recorded its experts: how many (trained token, MoE layer) pairs the trainer differs on
            out.update(routing_mismatched=mismatched, routing_counted=counted)
        if tb is not None and tb.critic_sums is not None:
            out.update({key: sums.tolist() for key, sums in tb.critic_sums.items()})
        return out

    def update(self, tb: TrainBatch | None, adapter_version: int) -> dict:
        """`optim.minibatches` updates on tb's masked tokens. Every worker runs the same collectives whatever
        it holds: one all-reduce of every minibatch's counts, then per minibatch one all-reduce of the
        flat gradient buffer (with a non-finite-loss flag). Loss shares use the all-reduced counts, so the
        summed gradient is the full batch's. A minibatch with no token on any worker is no optimizer step
        (AdamW would still move the adapter through momentum and weight decay), and a model (policy or critic) with
        no token in a minibatch on any worker is not stepped by it (`untrained_params`); a non-finite loss on any
        worker or a non-finite gradient norm skips the step on every worker (`nan_steps`)."""
        c = self.config
        minibatches = c.optim.minibatches
        critic_only = adapter_version < c.algorithm.value_pretrain_steps  # value pretraining; version 0 trains step 1
        for group, step in zip(self.optimizer.param_groups, group_steps(adapter_version, c.algorithm)):
            group["lr"] = warmup_lr(group["base_lr"], step, c.optim.warmup_steps)
        out = {
            "loss_sum": 0.0,
            # the policy loss's own statistics (PolicyLossEntry.logged), token sums; allsync.metrics divides
            **{loss_stat_key(name): 0.0 for name in get("policy_loss", self.loss_settings.policy_loss).logged},
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
            **({"tis_sum": 0.0, "tis_capped_sum": 0.0} if self.loss_settings.tis_level is not None else {}),
        }
        local_sq = torch.zeros(
            (), dtype=torch.float64, device=self.device
        )  # this rank's own gradient, before the all-reduce
        parts: list[torch.Tensor | None] = [None] * minibatches
        local = torch.zeros(
            minibatches, 3, dtype=torch.float64
        )  # per minibatch: policy tokens, episodes, critic tokens (exact past 2^24)
        if tb is not None:
            out["train_positions"] = tb.sequences.input_ids.numel()  # padded token positions: the work (health signal)
            parts = tb.minibatch_rows(minibatches)
            local = torch.stack([tb.counts(rows) for rows in parts])
        batches = self.balanced_minibatches(tb, parts) if self.balances_ranks else None
        if batches is not None:  # this worker's share of each minibatch after balancing (allsync/balance.py)
            local = torch.stack(
                [b.counts(torch.arange(len(b))) if b else torch.zeros(3, dtype=torch.float64) for b in batches]
            )
            out["train_positions"] = sum(b.sequences.input_ids.numel() for b in batches if b is not None)
        totals = self.all_reduce(local.clone())
        # the trainer's sampling-policy logprobs the engine/trainer gap is measured on: the no-gradient pass's
        # (recompute), else the update's own forwards of the first minibatch this worker trains before any optimizer
        # step (one minibatch: all of it; algorithm.old_logprobs engine: the policy has not moved yet)
        gap_batch = None
        for m, rows in enumerate(parts):
            if totals[m, 0] == 0 and totals[m, 2] == 0:
                out["empty_minibatches"] += 1
                continue
            self.flat_grad.zero_()
            self.flat_expert_grad.zero_()
            has_rows = local[m, 0] > 0 or local[m, 2] > 0
            if batches is not None:
                mb = batches[m] if has_rows else None
            else:
                mb = tb.minibatch(rows) if rows is not None and has_rows else None
            micro = (mb.forward_groups or self.passes.forward_chunks(mb.sequences)) if mb is not None else []
            own_logprobs = []  # the micro-batches' detached logprobs: the old ones when tb has none yet
            checkpointing = c.optim.activation_checkpointing
            with (
                checkpointed_decoder_layers(self.model, checkpointing),
                checkpointed_decoder_layers(self.critic, checkpointing and self.critic is not None),
            ):
                for i in range(self.passes.lockstep_count(len(micro))):  # gradients accumulate: each loss is its share
                    if i < len(micro):
                        own_logprobs.append(
                            self._backward_minibatch(
                                mb if len(micro) == 1 else mb.minibatch(torch.tensor(micro[i])),
                                totals[m],
                                out,
                                critic_only,
                            )
                        )
                    else:
                        self._backward_minibatch(self.passes.idle_batch(), totals[m], None, critic_only)
            self.passes.stop_counting_routes()  # later minibatches run after an optimizer step
            measured = own_logprobs and mb.engine_logprobs is not None  # no engine (NLFT's rows): no gap
            if not self.recomputes_old_logprobs and gap_batch is None and measured and out["optimizer_steps"] == 0:
                gap_batch = dataclasses.replace(mb, old_logprobs=placed_rows(own_logprobs, micro, mb.engine_logprobs))
            if self.before_gradient_reduce is not None:
                self.before_gradient_reduce(self.flat_grad)
            local_sq = sum(
                torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
                for g in (self.flat_grad[:-1], self.flat_expert_grad)
            )
            self.all_reduce(
                self.flat_grad
            )  # sum of per-rank shares = the full-batch gradient; [-1] = non-finite losses
            self.all_reduce(self.flat_expert_grad, "edp")  # expert blocks: summed over the ranks holding the same block
            norm, value_norm = self._total_grad_norm(), self._value_grad_norm()
            if self.flat_grad[-1] > 0 or not torch.isfinite(
                norm + value_norm
            ):  # identical on every rank: all skip together
                out["nan_steps"] += 1
                continue
            torch.nn.utils.clip_grads_with_norm_(self.lora_params, c.optim.grad_clip, norm)  # each model its own clip
            if self.value_params:
                torch.nn.utils.clip_grads_with_norm_(self.value_params, c.optim.grad_clip, value_norm)
                out["value_grad_norm"] = float(value_norm)
            step_skipping(self.optimizer, self.untrained_params(critic_only, totals[m]))
            out["optimizer_steps"] += 1
            out["grad_norm"] = float(norm)
        gap = tb if self.recomputes_old_logprobs else gap_batch  # None: no row trained here before that step
        # engine_logprobs None: not sampled (recipes/nlft.py's examples)
        if gap is not None and gap.engine_logprobs is not None:
            out["logprob_gap"] = logprob_gap(gap.engine_logprobs, gap.old_logprobs, gap.sequences.response_mask)
            out["logprob_gap_max"] = largest_logprob_gap(
                gap.engine_logprobs, gap.old_logprobs, gap.sequences.response_mask
            )
            if not math.isfinite(out["logprob_gap"]) or out["logprob_gap"] > c.rollout.logprob_gap_warn:
                print(
                    f"warning: worker {self.rank}: engine/trainer logprob gap {out['logprob_gap']:.4f} nats "
                    f"(> {c.rollout.logprob_gap_warn}): check adapter sync and engine kernels"
                )
        if tb is not None and tb.segment_kinds is not None and c.producer.reports_segment_gaps:
            out.update(segment_gaps(tb.segment_kinds, gap))
        self.consecutive_nan = self.consecutive_nan + 1 if out["nan_steps"] else 0
        out["local_grad_norm"] = float(local_sq.sqrt())  # the last minibatch's share of this rank (health signal)
        return out

    def untrained_params(self, critic_only: bool, totals: torch.Tensor) -> list[torch.nn.Parameter]:
        """The parameters AdamW must not step on a minibatch (`step_skipping`): a model with no token in it on any
        worker (totals = [policy tokens, episodes, critic tokens], all-reduced) has a zero gradient, and a step would
        still move it by momentum and weight decay and advance its bias correction. The policy's also during value
        pretraining (critic_only: its loss is not backpropagated). The critic's when no row of the minibatch has a
        value target (T-PPO: every reply of it cut at a window); the policy's when every reply was filtered."""
        skipped = self.lora_params if critic_only or totals[0] == 0 else []
        return skipped + (self.value_params if totals[2] == 0 else [])

    def _value_grad_norm(self) -> torch.Tensor:
        """||g|| of the critic's adapter and head (replicated: the same on every rank); 0 without a critic. The critic
        is its own model (T-PPO optimizes policy and value independently): its gradient is clipped and logged apart."""
        return (
            torch.nn.utils.get_total_norm([p.grad for p in self.value_params]) if self.value_params else torch.zeros(())
        )

    def _total_grad_norm(self) -> torch.Tensor:
        """||g|| over every LoRA tensor of the policy. The replicated part is the same on every rank; each
        expert block's (identical over its EDP group) is counted once per EDP member by the world all-reduce:
            ||g||^2 = ||g_replicated||^2 + (sum over ranks of ||g_block(rank)||^2) / EDP size.
        One all-reduce gives every rank the same bits, so the clip factor cannot differ between ranks."""
        grads = [p.grad for p in self.replicated_lora_params]
        replicated = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.layout is None:
            return replicated
        block = self.flat_expert_grad.double().pow(2).sum() / self.layout.edp_size
        sq = self.all_reduce(block.reshape(1))[0] + replicated.double() ** 2
        return sq.sqrt().float()

    def _backward_minibatch(
        self, mb: TrainBatch, totals: torch.Tensor, out: dict | None, critic_only: bool = False
    ) -> torch.Tensor:
        """Loss of this worker's part of a minibatch (its share of the global batch) and its backward into the
        flat gradient buffers, the policy's then the critic's (two graphs, one alive at a time, in the same order
        on every rank); a non-finite loss sets the buffer's flag instead. out None: an idle row (expert
        parallelism), whose backward only serves the other ranks' tokens. Returns the policy forward's
        detached logprobs [rows, width - 1]. critic_only (value pretraining): the policy's forward runs without a
        graph and nothing is backpropagated into it."""
        c = self.config
        frozen = torch.no_grad() if critic_only else nullcontext()
        with saved_on_host(c.optim.activation_offload), frozen:  # the forward only: backward's recomputation stays
            loss, sums = minibatch_loss(
                self.model,
                mb.sequences,
                mb.old_logprobs,
                mb.advantages,
                self.loss_settings,
                totals[0],
                totals[1],
                norm_length=c.rollout.max_new_tokens,
                ref_logprobs=mb.ref_logprobs,
                episode_tokens=mb.episode_tokens,
                engine_logprobs=mb.engine_logprobs,
            )
        finite = True if critic_only else self._backward(loss)
        value_loss_share = None
        if self.critic is not None:
            targets = ValueTargets(mb.returns, mb.value_mask, totals[2])
            with saved_on_host(c.optim.activation_offload):
                loss_value, value_loss_share = critic_loss(self.critic, mb.sequences, targets)
            finite = self._backward(loss_value) and finite
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

    def _backward(self, loss: torch.Tensor) -> bool:
        """loss.backward() when finite; otherwise the flat buffer's non-finite flag (every rank skips the step), and
        under expert parallelism the backward all the same: the EP peers wait for this rank's all-to-alls."""
        if torch.isfinite(loss):
            loss.backward()
            return True
        self.flat_grad[-1] = 1.0
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
