"""The disaggregated layout, the baseline all-sync is measured against (benchmarks/allsync.py): half the workers
only generate, the other half only train; samples go from generators to trainers and the adapter back every step,
so each half waits while the other works."""

from __future__ import annotations

import time

import torch

from allsync.config import RunConfig
from allsync.launch.ray_actors import gather_or_stop, rendezvous_address, start_placement, stop_placement
from allsync.tasks import Problem


# keys every per-worker metric dict carries (see allsync.metrics.aggregate); a worker reports 0 for a phase it does not run
ROLLOUT_KEYS = (
    "samples_generated",
    "reward_sum",
    "correct_sum",
    "response_tokens",
    "truncated",
    "staleness_max",
    "groups_generated",
    "sampling_rounds",
    "groups_kept",
    "groups_wanted",
    "sampling_cap_hits",
    "reward_errors",
)
TRAIN_KEYS = (
    "loss_sum",
    "entropy_sum",
    "kl_ref_sum",
    "logprob_gap",
    "logprob_gap_max",
    "trained_samples",
    "trained_tokens",
    "nan_steps",
    "optimizer_steps",
    "empty_minibatches",
    "grad_norm",
)


def split_groups(samples: list, group_index: torch.Tensor, parts: int) -> list[tuple[list, torch.Tensor]]:
    """Whole groups dealt into `parts` contiguous chunks (as even as possible), group ids renumbered from 0."""
    groups = sorted(set(group_index.tolist()))
    bounds = [round(k * len(groups) / parts) for k in range(parts + 1)]
    out = []
    for k in range(parts):
        mine = {g: j for j, g in enumerate(groups[bounds[k] : bounds[k + 1]])}
        rows = [i for i, g in enumerate(group_index.tolist()) if g in mine]
        out.append(
            ([samples[i] for i in rows], torch.tensor([mine[int(group_index[i])] for i in rows], dtype=torch.long))
        )
    return out


class DisaggregatedGroup:
    """Synchronous RL with separate roles: workers/2 generators and workers/2 trainers (Ray actors).

    Per step: generators make the whole batch (prompts strided over them) -> samples to the trainers (whole
    groups each) -> trainers update with all-reduced gradients -> trainer 0's adapter goes to every
    generator. Still on-policy (staleness 0), but each half idles while the other half works.
    """

    def __init__(self, config: RunConfig, problems: list[Problem], gpus_per_worker: float = 0):
        self.size = config.parallel.workers
        self.config = config
        n_gen = self.size // 2
        self.placement, start = start_placement(self.size, gpus_per_worker)
        address = rendezvous_address(self.placement)
        self.trainers = [
            start(i, config, problems, rank=i, world_size=self.size - n_gen, dist_address=address)
            for i in range(self.size - n_gen)
        ]
        self.generators = [
            start(self.size - n_gen + i, config, problems, rank=i, world_size=n_gen) for i in range(n_gen)
        ]
        self.workers = self.trainers + self.generators
        self.version = 0
        self.sync_bytes = self._sync()  # generators start from the trainers' initial adapter

    def _sync(self) -> list[int]:
        tensors = self.trainers[0].adapter_tensors.remote()
        return self._gather(
            [g.receive_adapter.remote(tensors, self.version) for g in self.generators],
            "receive_adapter",
            self.generators,
        )

    def _gather(self, refs: list, method: str, workers: list) -> list:
        """Results in order; the first worker that fails stops them all (WorkerFailure names its index in
        `self.workers`: trainers first, then generators)."""
        return gather_or_stop(refs, [self.workers.index(w) for w in workers], method, self.workers)

    def step(self, step: int) -> list[dict]:
        """One synchronous step; per-worker metric sums, trainers first."""
        wall0 = time.time()
        per_generator = self.config.rollout.prompts_per_step // len(self.generators)
        rollouts = self._gather(
            [g.rollout_phase.remote(per_generator) for g in self.generators], "rollout_phase", self.generators
        )
        samples, index, offset = [], [], 0
        for s, g, _ in rollouts:
            samples += s
            index.append(g + offset)
            offset += int(g.max()) + 1 if len(g) else 0
        group_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
        parts = split_groups(samples, group_index, len(self.trainers))
        trained = self._gather(
            [t.train_phase.remote(s, g) for t, (s, g) in zip(self.trainers, parts)], "train_phase", self.trainers
        )
        self.version += 1
        received = self._sync()
        reports = self._gather([w.busy_report.remote(wall0) for w in self.workers], "busy_report", self.workers)
        out = []
        for i, report in enumerate(reports):
            m = dict.fromkeys(ROLLOUT_KEYS + TRAIN_KEYS, 0)
            if i < len(self.trainers):
                m.update(trained[i])
            else:
                m.update(rollouts[i - len(self.trainers)][2])
                m["sync_bytes"] = received[i - len(self.trainers)]
            m.setdefault("sync_bytes", 0)
            out.append({**m, **report})
        return out

    def call(self, method: str, *args) -> list:
        return self._gather([getattr(w, method).remote(*args) for w in self.workers], method, self.workers)

    def shutdown(self) -> None:
        self.call("shutdown")
        stop_placement(self.workers, self.placement)
