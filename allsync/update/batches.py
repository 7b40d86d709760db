"""Episodes to a TrainBatch (one row per segment), the update's first stage: `episode_batch` for group baselines,
`critic_batch` for PPO / T-PPO (advantages from the critic). The no-gradient forwards they need (old, reference and
critic values) are allsync/update/passes.py's.
"""

from __future__ import annotations

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
from allsync.episodes import Episode, flatten
from allsync.update.passes import ForwardPasses
from allsync.update.sequences import (
    SequenceBatch,
    build_sequences,
    response_positions,
    scatter_response_values,
    to_response_layout,
    to_sequence_layout,
)
from allsync.update.train_batch import TrainBatch


def reuses_update_forward(config) -> bool:
    """One minibatch: every forward of the update runs before its one optimizer step, so the policy it computes is
    the sampling policy and its own detached logprobs are the old ones (no separate no-gradient pass;
    loss.minibatch_loss). A critic's values still come from a forward before the update: its advantages need them."""
    return config.optim.minibatches == 1


def recomputes_old_logprobs(config) -> bool:
    """Several minibatches and algorithm.old_logprobs recompute: a no-gradient forward before the update."""
    return not reuses_update_forward(config) and config.algorithm.old_logprobs == "recompute"


class BatchBuilder:
    def __init__(self, config, passes: ForwardPasses, pad_id: int, device: torch.device, all_reduce):
        """all_reduce(tensor): the sum over every worker, in place (the learner's, timed as waiting)."""
        self.config, self.passes, self.pad_id, self.device, self.all_reduce = config, passes, pad_id, device, all_reduce

    def old_logprobs(self, batch: SequenceBatch, engine_logprobs: torch.Tensor | None) -> torch.Tensor | None:
        """The sampling policy's logprobs at the batch's tokens: None when the update's own forward gives them
        (reuses_update_forward), a no-gradient forward (current_logprobs) with algorithm.old_logprobs recompute,
        else the engine's (the torch engine samples from this model and adapter)."""
        if reuses_update_forward(self.config):
            return None
        return self.passes.current_logprobs(batch) if recomputes_old_logprobs(self.config) else engine_logprobs

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

    def critic_batch(self, episodes: list[Episode], critic) -> TrainBatch:
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
        old_values = self.passes.current_values(seqs, critic)
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
