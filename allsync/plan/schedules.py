"""Four ways to schedule one RL step's generation and training on a set of GPUs, in one model, from each GPU's work.

    all-sync (ours)       every GPU generates its share, then every GPU trains; the step waits for the slowest
                          GPU in each phase:           T = max_i gen_i + max_i train_i + fixed
    all-sync + overlap    the same GPUs, but a GPU trains a group as soon as the group's responses are all done
                          while its other sequences still decode; one update at the end of the step, so it stays
                          on-policy. Expert parallelism keeps training in lockstep: the j-th group trains once
                          every GPU of the step has its j-th group ready. Modelled, not built; decode and training
                          are assumed not to slow each other, so this is the bound of what overlap can gain.
    disaggregated sync    G_gen GPUs generate everything, G_train GPUs train on it, the adapter goes back:
                          T = max gen + transfer + max train; each side idles while the other works
    one-step-off async    the same split, generation of step n+1 running while step n trains (one step
                          off-policy): T = max(max gen, max train) + transfer. Modelled, not built.

Each StepTime's parts are its critical path: `generate`, `train` (in the overlapping schedules, the training left
beyond the end of generation) and the fixed costs; they add up to the step's seconds.
Idle fraction: the share of GPU-seconds in which a GPU neither generates nor trains (waiting for others, sleep-mode
transfers, adapter syncs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCHEDULES = ("all-sync", "all-sync + overlap", "disaggregated", "one-step-off")


@dataclass
class StepTime:
    schedule: str
    seconds: float
    idle_fraction: float
    parts: dict = field(default_factory=dict)  # name -> seconds on the step's critical path
    built: bool = True
    note: str = ""  # what the estimate assumes beyond the model's measured rates
    per_draw: list[float] | None = None  # seconds of each draw of the step's lengths (mean_over_draws); None: one

    def to_json(self) -> dict:
        out = {
            "schedule": self.schedule,
            "step_seconds": self.seconds,
            "idle_fraction": self.idle_fraction,
            "parts": self.parts,
            "built": self.built,
            "note": self.note,
        }
        return out | ({"step_seconds_per_draw": self.per_draw} if self.per_draw is not None else {})


def mean_over_draws(draws: list[list[StepTime]]) -> list[StepTime]:
    """Each schedule's StepTime averaged over draws of one step's response lengths and kept groups (the seconds, the
    idle share and every part; per_draw keeps each draw's seconds), in the order they first appear. A schedule that
    only some draws have (all-sync + overlap needs one sampling round) is averaged over those, and its note says so."""
    out = []
    for name in dict.fromkeys(s.schedule for d in draws for s in d):
        same = [s for d in draws for s in d if s.schedule == name]
        first, n = same[0], len(same)
        note = first.note
        if n < len(draws):
            note = f"{note}; " if note else ""
            note += f"in {n} of {len(draws)} draws"
        keys = dict.fromkeys(k for s in same for k in s.parts)
        parts = {k: sum(s.parts.get(k, 0.0) for s in same) / n for k in keys}
        idle_share = sum(s.idle_fraction for s in same) / n
        seconds = [s.seconds for s in same]
        out.append(StepTime(name, sum(seconds) / n, idle_share, parts, first.built, note, seconds))
    return out


def idle(busy_gpu_seconds: float, gpus: int, seconds: float) -> float:
    return 1.0 - busy_gpu_seconds / (gpus * seconds) if seconds > 0 else 0.0


def all_sync(gen: np.ndarray, train: np.ndarray, fixed: dict[str, float], train_wall: float | None = None) -> StepTime:
    """gen, train: each GPU's busy seconds; fixed: seconds every GPU spends outside both (syncs, sleep transfers);
    train_wall: the train phase's wall seconds when GPUs wait for each other inside it (lockstep; default the
    slowest GPU's)."""
    parts = {"generate": float(gen.max()), "train": float(train.max()) if train_wall is None else train_wall, **fixed}
    seconds = sum(parts.values())
    return StepTime("all-sync", seconds, idle(float(gen.sum() + train.sum()), len(gen), seconds), parts)


def all_sync_overlap(
    ready: list[np.ndarray], group_train: list[np.ndarray], gen: np.ndarray, fixed: dict[str, float]
) -> StepTime:
    """ready[i]: when GPU i's groups finish generating (sorted); group_train[i]: their training seconds in that
    order. The j-th group trains on every GPU at once (lockstep), starting when all have it and the (j-1)-th is
    trained: start_j = max(done_{j-1}, max_i ready[i][j]), done_j = start_j + max_i group_train[i][j]. A GPU is busy
    while it generates or trains: [0, gen_i] and [start_j, start_j + group_train[i][j]] merged."""
    ready_all = np.stack(ready).max(axis=0)
    trains = np.stack(group_train)  # [gpus, groups]
    starts, done = [], 0.0
    for r, t in zip(ready_all, trains.max(axis=0)):
        starts.append(max(done, float(r)))
        done = starts[-1] + float(t)
    end = max(done, float(gen.max()))
    parts = {"generate": float(gen.max()), "train": end - float(gen.max()), **fixed}  # train: beyond generation
    seconds = sum(parts.values())
    start = np.array(starts)[None, :]
    outside_gen = np.clip(start + trains - np.maximum(start, gen[:, None]), 0.0, None)
    busy = float(gen.sum() + outside_gen.sum())
    return StepTime("all-sync + overlap", seconds, idle(busy, len(gen), seconds), parts, built=False)


def disaggregated(gen: np.ndarray, train: np.ndarray, transfer: float, train_wall: float | None = None) -> StepTime:
    """gen: each generating GPU's seconds, train: each training GPU's busy seconds; transfer: the adapter to the
    generators; train_wall as in all_sync."""
    wall = float(train.max()) if train_wall is None else train_wall
    parts = {"generate": float(gen.max()), "adapter transfer": transfer, "train": wall}
    seconds = sum(parts.values())
    busy = float(gen.sum() + train.sum())
    return StepTime("disaggregated", seconds, idle(busy, len(gen) + len(train), seconds), parts)


def one_step_off(gen: np.ndarray, train: np.ndarray, transfer: float, train_wall: float | None = None) -> StepTime:
    wall = float(train.max()) if train_wall is None else train_wall
    parts = {  # train: what is left of it beyond the generation it runs beside
        "generate": float(gen.max()),
        "train": max(wall - float(gen.max()), 0.0),
        "adapter transfer": transfer,
    }
    seconds = sum(parts.values())
    busy = float(gen.sum() + train.sum())
    return StepTime("one-step-off", seconds, idle(busy, len(gen) + len(train), seconds), parts, built=False)
