"""Token-balanced minibatches across the workers (optim.balance_ranks; issue 48, lever 4).

Every worker trains the rows it generated. Under expert parallelism the ranks run their forwards in lockstep, and
every minibatch ends in a gradient all-reduce over all workers, so each minibatch lasts as long as the worker with
the most tokens in it. With optim.balance_ranks the rows of each minibatch move between workers before the update so
that every worker holds nearly the same tokens:

    per minibatch: every worker's episodes (whole: an episode's rows stay together) and their tokens t_e (the sum of
    their rows' lengths) are gathered; the episodes, largest first (ties: by worker, then position), go one by one to
    the worker with the fewest tokens so far (ties: the lowest rank), the longest-processing-time rule (within 4/3 of
    the best assignment), or, with a token budget per forward, into forwards packed as the learner packs them and
    dealt to the workers in turn (`assign_episodes`); then every row's tensors go to its worker (all-to-alls of rows
    padded to the widest).

A minibatch holds the same rows as without balancing and its loss shares use counts all-reduced over every worker, so
the update is the same token-mean loss: only where each row's gradient is computed moves (float sums in another
order). With a token budget each worker runs the forwards dealt to it (TrainBatch.forward_groups), not its own
packing (allsync.update.sequences.token_budget_chunks).
"""

from __future__ import annotations

import heapq

import torch

from allsync.update.sequences import SequenceBatch, token_budget_chunks
from allsync.update.train_batch import TrainBatch
from moe_lora.expert_parallel import all_to_all

# a minibatch's per-token tensors ([rows, width - 1]; TrainBatch.minibatch keeps these), moved with their rows
PER_TOKEN = ("old_logprobs", "advantages", "returns", "value_mask", "ref_logprobs", "engine_logprobs")


def assign_episodes(tokens: list[list[int]], workers: int, budget: int | None = None) -> list[list[tuple[int, int]]]:
    """For each worker's episodes (their tokens): (the worker that trains it, the forward it goes in there); pure and
    the same on every worker. Every episode of the minibatch, largest first (ties: by worker, then position):
    - without a token budget (one forward a worker) the longest-processing-time rule: each to the worker with the
      fewest tokens so far (ties: the lowest rank), forward 0;
    - with optim.max_tokens_per_forward = budget, packed into forwards as the learner packs rows (an episode joins
      the current forward while (episodes + 1) x the forward's largest <= budget), and the forwards, largest padded
      size first, dealt in turns back and forth (workers 0, 1, .., W - 1, then W - 1, .., 0, ...), turn t being each
      worker's forward t: the ranks' t-th forwards, which run together under expert parallelism, are about the same
      size, and every worker's total about the same."""
    order = sorted(((-t, w, i) for w, episodes in enumerate(tokens) for i, t in enumerate(episodes)))
    out = [[(0, 0)] * len(episodes) for episodes in tokens]
    if budget is None:
        load = [(0, w) for w in range(workers)]
        for negative, w, i in order:
            held, dest = heapq.heappop(load)
            out[w][i] = (dest, 0)
            heapq.heappush(load, (held - negative, dest))
        return out
    packed: list[list[tuple[int, int]]] = []  # forwards: their (worker, position) episodes
    largest = 0
    for negative, w, i in order:
        if not packed or (len(packed[-1]) + 1) * max(largest, -negative) > budget:
            packed.append([])
            largest = 0
        packed[-1].append((w, i))
        largest = max(largest, -negative)
    size = lambda f: len(f) * max(tokens[w][i] for w, i in f)  # noqa: E731 - a forward's padded tokens
    for k, f in enumerate(sorted(packed, key=lambda f: -size(f))):  # a turn's forwards of about the same size
        turn, place = divmod(k, workers)
        for w, i in f:
            out[w][i] = (place if turn % 2 == 0 else workers - 1 - place, turn)
    return out


def dealt_forwards(forwards: list[int]) -> list[list[int]]:
    """Row groups from each received row's forward number (assign_episodes'), in forward order, rows in order."""
    groups: dict[int, list[int]] = {}
    for row, f in enumerate(forwards):
        groups.setdefault(f, []).append(row)
    return [groups[f] for f in sorted(groups)]


def dealt(tokens: list[list[int]], workers: int, budget: int | None = None) -> list[tuple[list, list | None]]:
    """assign_episodes from each destination's side: per worker, the (worker, position) of the episodes it trains in
    the order they arrive (by source worker, then position, as `balanced` receives them) and, with a budget, its
    forwards (row groups of indices into that list; None without one)."""
    taken: list[list[tuple[int, int]]] = [[] for _ in range(workers)]
    slots: list[list[int]] = [[] for _ in range(workers)]
    for w, destinations in enumerate(assign_episodes(tokens, workers, budget)):
        for i, (d, f) in enumerate(destinations):
            taken[d].append((w, i))
            slots[d].append(f)
    return [(t, dealt_forwards(s) if budget is not None else None) for t, s in zip(taken, slots)]


def _gather_lists(values: list[int], groups) -> list[list[int]]:
    """Every worker's list of ints (lengths may differ), in rank order."""
    longest = groups.max_over_ranks(len(values))
    padded = torch.full((longest + 1,), -1, dtype=torch.int64)
    padded[0] = len(values)
    padded[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return [g[1 : 1 + int(g[0])].tolist() for g in groups.all_gather(padded, "world")]


def _rows_fields(mb, width: int, schema: dict) -> dict[str, torch.Tensor]:
    """The minibatch's per-row tensors padded to `width` columns ([n, width] or [n, width - 1] and [n] ones)."""
    n = len(mb) if mb is not None else 0
    pad = lambda t, w, value=0: torch.nn.functional.pad(t, (0, w - t.shape[1]), value=value)  # noqa: E731
    if mb is None:
        empty = {
            "input_ids": torch.zeros(0, width, dtype=torch.long),
            "attention_mask": torch.zeros(0, width, dtype=torch.long),
            "response_mask": torch.zeros(0, width - 1),
            "episode": torch.zeros(0, dtype=torch.long),
            "episode_tokens": torch.zeros(0, dtype=torch.float64),
        }
        empty.update({k: torch.zeros(0, width - 1) for k in PER_TOKEN if schema[k]})
        if schema["routing"]:
            layers, k, dtype = schema["routing"]
            empty["routing"] = torch.zeros(0, width, layers, k, dtype=dtype)
            empty["routing_has"] = torch.zeros(0, width, dtype=torch.bool)
        return empty
    s = mb.sequences
    out = {
        "input_ids": pad(s.input_ids.cpu(), width, schema["pad_id"]),
        "attention_mask": pad(s.attention_mask.cpu(), width),
        "response_mask": pad(s.response_mask.cpu().float(), width - 1),
        "episode": mb.episode_of_row.cpu().long(),
        "episode_tokens": mb.episode_tokens.cpu().double(),
    }
    for key in PER_TOKEN:
        if schema[key]:
            value = getattr(mb, key)
            out[key] = pad(value.cpu().float(), width - 1) if value is not None else torch.zeros(n, width - 1)
    if schema["routing"]:
        r = s.routing.cpu()
        out["routing"] = torch.nn.functional.pad(r, (0, 0, 0, 0, 0, width - r.shape[1]))
        out["routing_has"] = pad(s.routing_has.cpu(), width, False)
    return out


def batch_schema(mb, groups, pad_id: int) -> dict:
    """Which optional fields the minibatches hold, agreed over the workers (a worker without rows learns it from the
    others): one all-reduce of presence flags and the routing's shape."""
    flags = torch.zeros(len(PER_TOKEN) + 4, dtype=torch.int64)
    if mb is not None:
        for i, key in enumerate(PER_TOKEN):
            flags[i] = getattr(mb, key) is not None
        if mb.sequences.routing is not None:
            r = mb.sequences.routing
            flags[-4:] = torch.tensor([1, r.shape[2], r.shape[3], r.element_size()])
    flags = groups.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    schema = {key: bool(flags[i]) for i, key in enumerate(PER_TOKEN)}
    schema["routing"] = (
        (int(flags[-3]), int(flags[-2]), torch.uint8 if flags[-1] == 1 else torch.int16) if flags[-4] else None
    )
    schema["pad_id"] = pad_id
    return schema


def balanced(mb, groups, pad_id: int, device, budget: int | None = None):
    """This worker's share of one minibatch after balancing (module docstring): a TrainBatch, or None when it trains
    no row of it. Every worker calls it for every minibatch (mb None: no rows of its own); budget:
    optim.max_tokens_per_forward."""
    schema = batch_schema(mb, groups, pad_id)
    n = len(mb) if mb is not None else 0
    lengths = mb.sequences.attention_mask.sum(-1).tolist() if n else []
    episodes = mb.episode_of_row.tolist() if n else []
    starts = [i for i in range(n) if i == 0 or episodes[i] != episodes[i - 1]]
    ends = starts[1:] + [n]
    tokens = [sum(lengths[a:b]) for a, b in zip(starts, ends)]
    destination = assign_episodes(_gather_lists(tokens, groups), groups.world_size, budget)[groups.rank]
    row_where = [where for where, a, b in zip(destination, starts, ends) for _ in range(a, b)]  # (worker, forward)
    row_dest = [d for d, _ in row_where]
    width = groups.max_over_ranks(max(lengths, default=2))
    order = sorted(range(n), key=lambda i: row_dest[i])  # stable: an episode's rows stay together and in order
    send = [row_dest.count(d) for d in range(groups.world_size)]
    ones = [1] * len(send)
    recv = all_to_all(torch.tensor(send, device=groups.device), ones, ones, groups.world).tolist()
    fields = _rows_fields(mb, width, schema)
    fields["forward"] = torch.tensor([f for _, f in row_where], dtype=torch.long)
    index = torch.tensor(order, dtype=torch.long)
    got = {k: all_to_all(v[index].to(groups.device), send, recv, groups.world).cpu() for k, v in fields.items()}
    rows = sum(recv)
    if rows == 0:
        return None
    source = torch.repeat_interleave(torch.arange(len(recv)), torch.tensor(recv))
    key = source * (int(got["episode"].max()) + 1) + got["episode"]
    episode = torch.cat([torch.zeros(1, dtype=torch.long), (key[1:] != key[:-1]).long()]).cumsum(0)
    routing = (got["routing"], got["routing_has"]) if schema["routing"] else ()
    sequences = SequenceBatch(got["input_ids"], got["attention_mask"], got["response_mask"], *routing)
    keep = int(sequences.attention_mask.sum(-1).max())
    sequences = sequences.trimmed(keep).to(device)
    per_token = {k: got[k][:, : keep - 1].to(device) if schema[k] else None for k in PER_TOKEN}
    out = TrainBatch(
        sequences,
        per_token["old_logprobs"],
        per_token["advantages"],
        per_token["returns"],
        per_token["value_mask"],
        per_token["ref_logprobs"],
        episode.to(device),
        got["episode_tokens"].float().to(device),
        per_token["engine_logprobs"],
    )
    if budget is not None:  # the dealt forwards, any one over the budget (an episode of several rows) split again
        lengths = sequences.attention_mask.sum(-1).tolist()
        out.forward_groups = [
            [group[i] for i in part]
            for group in dealt_forwards(got["forward"].tolist())
            for part in token_budget_chunks([lengths[r] for r in group], budget)
        ]
    return out
