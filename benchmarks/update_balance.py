"""How long expert-parallel ranks wait for each other in the update: forwards packed in row order, longest first, and
longest first after balancing the rows over the ranks (issue 48, lever 4).

    python -m benchmarks.update_balance [--ep 2,4] [--rows 24] [--budget 384] [--repeats 3] [--json FILE]

Under expert parallelism the ranks of a group run their j-th forwards together (their MoE layers exchange tokens),
so each forward lasts as long as the largest of the group's j-th forwards. The learner packs a minibatch's rows into
forwards of at most optim.max_tokens_per_forward padded tokens (allsync.update.sequences.token_budget_chunks): longest first
since this benchmark, consecutive rows in row order before (`in_row_order`, kept here as the baseline); with
optim.balance_ranks the rows first move so that every rank holds nearly the same tokens (allsync/update/balance.py).

Each of --ep ranks (torch.multiprocessing, gloo, the tiny DeepSeek-V3 with its 8 routed experts split over them,
LoRA rank 8, float32) holds --rows responses of long-tailed lengths (lognormal, median 40 tokens, sigma 0.8, at most
240, after a 12-token prompt; each rank its own draw), and runs the update's forward + backward of every forward of
each arm (a rank with fewer forwards runs idle one-token rows, as the learner does; "balanced" includes the rows'
exchange), --repeats times. Reported per arm and EP size:

    padded       each rank's padded positions (rows x longest of each forward, summed)
    lockstep     sum over j of the largest j-th forward's padded positions: what the group steps through together
    wait share   1 - mean padded / lockstep: the share of the group's forward time a rank spends waiting (in
                 positions, a model of time; exact and machine-independent)
    wall         the slowest rank's seconds for the whole update (median of the repeats; 2 cores shared by the ranks)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

PROMPT, MEDIAN, SIGMA, CAP = 12, 40, 0.8, 240


def in_row_order(lengths: list[int], budget: int) -> list[list[int]]:
    """The learner's packing before longest-first: consecutive rows in row order while rows x longest <= budget."""
    chunks, longest = [], 0
    for i, n in enumerate(lengths):
        if chunks and (len(chunks[-1]) + 1) * max(longest, n) <= budget:
            chunks[-1].append(i)
            longest = max(longest, n)
        else:
            chunks.append([i])
            longest = n
    return chunks


def rank_lengths(rank: int, rows: int, seed: int = 0) -> list[int]:
    """A rank's sequence lengths: a 12-token prompt and a lognormal response (its own draw)."""
    gen = np.random.default_rng(1000 * seed + rank)
    responses = np.minimum(np.round(MEDIAN * np.exp(SIGMA * gen.standard_normal(rows))), CAP).astype(int)
    return [PROMPT + max(int(r), 1) for r in responses]


def padded(lengths: list[int], chunks: list[list[int]]) -> list[int]:
    """Each forward's padded positions: rows x its longest row."""
    return [len(c) * max(lengths[i] for i in c) for c in chunks]


def lockstep_positions(per_rank: list[list[int]]) -> int:
    """sum over j of max over ranks of the j-th forward's padded positions (a rank without a j-th: 0)."""
    forwards = max(len(p) for p in per_rank)
    return sum(max(p[j] if j < len(p) else 0 for p in per_rank) for j in range(forwards))


ARMS = ("row order", "longest first", "balanced")


def balanced_forwards(lengths: list[list[int]], budget: int) -> list[list[int]]:
    """Each rank's forwards' padded positions after optim.balance_ranks: the forwards allsync.update.balance.assign_episodes
    packs over every rank's rows and deals in turns (one row an episode), which each rank runs as dealt."""
    from allsync.update.balance import dealt

    shares = dealt(lengths, len(lengths), budget)
    return [padded([lengths[w][i] for w, i in taken], groups) for taken, groups in shares]


def positions_report(ep: int, rows: int, budget: int) -> dict:
    """The deterministic part: padded and lockstep positions of every arm."""
    from allsync.update.sequences import token_budget_chunks

    out = {}
    lengths = [rank_lengths(r, rows) for r in range(ep)]
    arms = {
        "row order": [padded(lens, in_row_order(lens, budget)) for lens in lengths],
        "longest first": [padded(lens, token_budget_chunks(lens, budget)) for lens in lengths],
        "balanced": balanced_forwards(lengths, budget),
    }
    for name, per_rank in arms.items():
        lockstep = lockstep_positions(per_rank)
        own = [sum(p) for p in per_rank]
        out[name] = {
            "forwards": [len(p) for p in per_rank],
            "padded": own,
            "lockstep": lockstep,
            "wait_share": round(1 - statistics.mean(own) / lockstep, 4),
        }
    out["tokens"] = [sum(lens) for lens in lengths]
    return out


def run_rank(rank: int, ep: int, address: str, checkpoint: str, rows: int, budget: int, repeats: int, results) -> None:
    """One rank: its experts' shard, its rows, the update's forwards + backwards of both packings, timed."""
    from allsync.update.balance import balanced
    from allsync.update.forward import forward_logprobs
    from allsync.update.sequences import build_sequences, token_budget_chunks
    from allsync.update.train_batch import TrainBatch
    from allsync.distributed.process_groups import connect
    from moe_lora.expert_parallel import ExpertLayout, shard_experts
    from moe_lora.lora import LoRAConfig, attach_lora, seeded_init_
    from quant.checkpoint_io import read_config
    from quant.loader import QuantPlan, load_frozen_model

    torch.set_num_threads(1)
    layout = ExpertLayout(ep, ep, read_config(checkpoint)["n_routed_experts"])
    groups = connect(rank, ep, address, "gloo", layout)
    model = load_frozen_model(
        checkpoint, QuantPlan(routed_experts="nf4"), torch.float32, progress=False, experts=layout.experts_of(rank)
    )
    attach_lora(model, LoRAConfig(rank=8, alpha=16))
    seeded_init_(model, 0)
    shard_experts(model, groups.ep, layout, rank)
    lengths = rank_lengths(rank, rows)
    gen = torch.Generator().manual_seed(rank)
    seqs = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    mine = build_sequences([s[:PROMPT] for s in seqs], [s[PROMPT:] for s in seqs], 2)
    idle = build_sequences([[2]], [[2]], 2)
    times = {}
    for name in ARMS:
        seconds = []
        for _ in range(repeats):
            groups.max_over_ranks(0)  # start together
            t0 = time.perf_counter()
            batch = mine
            if name == "balanced":  # the rows move first (their exchange is timed too)
                moved = balanced(TrainBatch(mine, None, torch.zeros_like(mine.response_mask)), groups, 2, "cpu", budget)
                batch = moved.sequences
            held = batch.attention_mask.sum(-1).tolist()
            chunks = (in_row_order if name == "row order" else token_budget_chunks)(held, budget)
            if name == "balanced":
                chunks = moved.forward_groups  # the forwards as dealt
            for j in range(groups.max_over_ranks(len(chunks))):
                part = batch.select(chunks[j]) if j < len(chunks) else idle
                part = part.trimmed(part.width)
                (forward_logprobs(model, part) * part.response_mask).sum().backward()
            seconds.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        times[name] = seconds
    results[rank] = times


def measure(ep: int, checkpoint: str, rows: int, budget: int, repeats: int) -> dict:
    from allsync.launch.group import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        address = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(run_rank, args=(ep, address, checkpoint, rows, budget, repeats, results), nprocs=ep)
        times = dict(results)
    out = positions_report(ep, rows, budget)
    for name in ARMS:
        slowest = [max(times[r][name][i] for r in range(ep)) for i in range(repeats)]
        out[name]["wall_seconds"] = round(statistics.median(slowest), 3)
        out[name]["wall_ratio"] = round(out[name]["wall_seconds"] / out["row order"]["wall_seconds"], 3)
    return out


def main(argv=None) -> dict:
    from moe_lora.tiny import make_tiny
    from quant.checkpoint_io import atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", default="2,4")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--budget", type=int, default=384, help="optim.max_tokens_per_forward")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(e) for e in args.ep.split(",")]
    if min(sizes) < 2 or any(8 % e for e in sizes):
        raise SystemExit(f"--ep {args.ep}: each size must be at least 2 and divide the tiny model's 8 experts")
    if args.rows < 1 or args.repeats < 1 or args.budget < PROMPT + CAP:
        raise SystemExit(f"--rows and --repeats must be >= 1 and --budget >= {PROMPT + CAP} (the longest row)")
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        **vars(args),
        "ep": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(make_tiny(Path(tmp) / "tiny"))
        for ep in sizes:
            out["ep"][str(ep)] = result = measure(ep, checkpoint, args.rows, args.budget, args.repeats)
            for name in ARMS:
                r = result[name]
                print(
                    f"EP {ep}, {name:13}: forwards {r['forwards']}, padded {r['padded']}, lockstep {r['lockstep']}, "
                    f"wait share {r['wait_share']:.1%}, wall {r['wall_seconds']:.2f} s ({r['wall_ratio']}x row order's)",
                    flush=True,
                )
            if args.json:
                atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
