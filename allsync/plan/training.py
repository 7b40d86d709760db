"""A step's training phase in the plan: the kept sequences packed into forwards as the learner packs them
(allsync.update.balance.dealt), at step_time.forward_seconds each with expert-parallel ranks in lockstep, plus one
all-reduce of the LoRA gradients per minibatch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from allsync.update.balance import dealt
from allsync.plan.hardware import Hardware
from allsync.plan.step_time import (
    allreduce_seconds,
    forward_seconds,
    train_passes,
)
from allsync.plan.weights import (
    LORA_VALUE_BYTES,
    held_experts,
    lora_values,
    routed_lora_values,
)

from allsync.plan.generation import lockstep_seconds


def grad_sync_seconds(run, model_config: dict, hw: Hardware, gpus: int, ep: int) -> float:
    """One all-reduce of the LoRA gradients: the per-expert routed factors' over gpus / ep replicas, the rest (the
    factors a shared_outer layer's experts share included) over all GPUs."""
    targets = tuple(run.lora.targets)
    experts = held_experts(model_config, ep)
    held = lora_values(model_config, run.lora.rank, targets, experts, run.lora.expert_layout)
    routed = 0
    if "routed_experts" in targets:
        routed = routed_lora_values(model_config, run.lora.rank, experts, run.lora.expert_layout)[0]
    replicas = gpus // ep
    link = hw.link_bytes_per_second(gpus)
    return allreduce_seconds((held - routed) * LORA_VALUE_BYTES, gpus, link) + allreduce_seconds(
        routed * LORA_VALUE_BYTES, replicas, link
    )


@dataclass
class Training:
    """A train phase: each GPU's busy seconds, the phase's wall seconds (waits included), each GPU's seconds per
    trained sequence (its share of its forwards)."""

    busy: np.ndarray
    wall: float
    per_sequence: list[np.ndarray]


def train_phase(
    run,
    model_config,
    hw,
    ep: int,
    routed_format: str,
    sequences: list[np.ndarray],
    prompt_tokens: int,
    offloaded_per_token: float = 0.0,
) -> Training:
    """The train phase of GPUs holding `sequences` (each GPU's response lengths, in the order it trains them), as
    the learner runs it: optim.minibatches contiguous parts, each packed longest first into forwards whose padded size
    (rows x longest) stays within optim.max_tokens_per_forward (allsync.update.sequences.token_budget_chunks; one forward of
    the part without a budget); with optim.balance_ranks each minibatch's rows first go to the GPUs as
    allsync.update.balance.dealt deals them (one row an episode): with a budget in forwards packed globally and dealt in
    turns, which the GPUs run as dealt; without one by the longest-processing-time rule. Expert-parallel ranks run
    their j-th forwards together (a rank with fewer runs idle ones), so each costs the group's slowest; every
    minibatch ends in a gradient all-reduce over all GPUs:
        wall = sum over minibatches m of max over EP groups g of sum over forwards j of max over ranks r in g t[r,m,j]
    (EP 1: groups of one). Activation offload copies each forward's saved bytes out and back over the host link."""
    from allsync.update.sequences import token_budget_chunks

    o = run.optim
    a = run.algorithm
    passes = train_passes(o.activation_checkpointing, o.minibatches, a.kl_coef > 0, a.uses_critic, a.old_logprobs)
    gpus = len(sequences)
    times = [[[] for _ in range(o.minibatches)] for _ in range(gpus)]  # [gpu][minibatch] -> seconds per forward
    per_sequence = [np.zeros(len(responses)) for responses in sequences]
    # parts[gpu][m]: (tokens, the GPU that generated the row, its index there) of the rows GPU gpu trains in minibatch m
    parts = []
    for i, responses in enumerate(sequences):
        tokens = np.asarray(responses, dtype=np.int64) + prompt_tokens
        bounds = np.cumsum([0] + [len(p) for p in np.array_split(tokens, o.minibatches)])
        parts.append([[(int(tokens[j]), i, j) for j in range(a, b)] for a, b in zip(bounds, bounds[1:])])
    forwards = [[None] * o.minibatches for _ in range(gpus)]  # [gpu][m]: the dealt forwards' rows (None: its own)
    if run.optim.balance_ranks and gpus > 1:  # allsync/update/balance.py: each minibatch's rows spread by their tokens
        for m in range(o.minibatches):
            shares = dealt([[row[0] for row in p[m]] for p in parts], gpus, o.max_tokens_per_forward)
            moved = [[parts[w][m][i] for w, i in taken] for taken, _ in shares]
            for i, (rows, (_, groups)) in enumerate(zip(moved, shares)):
                parts[i][m], forwards[i][m] = rows, groups
    for i in range(gpus):
        for m, part in enumerate(parts[i]):
            lengths = [row[0] for row in part]
            groups = (
                forwards[i][m] if forwards[i][m] is not None else token_budget_chunks(lengths, o.max_tokens_per_forward)
            )
            for rows in groups:
                longest = max(lengths[r] for r in rows)
                t = forward_seconds(model_config, hw, routed_format, passes, ep, len(rows), longest)
                t += 2 * len(rows) * longest * offloaded_per_token / hw.host_link_bytes_per_second
                times[i][m].append(t)
                for r in rows:
                    _, gpu, j = part[r]
                    per_sequence[gpu][j] = t / len(rows)
    busy = np.array([sum(sum(m) for m in gpu) for gpu in times])
    group = max(ep, 1)
    wall = sum(
        max(lockstep_seconds([times[r][m] for r in range(g, min(g + group, gpus))]) for g in range(0, gpus, group))
        for m in range(o.minibatches)
    )
    return Training(busy, wall, per_sequence)
