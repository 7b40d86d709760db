"""Continuous batching over KV slots: the torch engine's decode loop.

A fixed pool of slots (moe_lora.kv_caches.SlotKVCache: each slot a row's cache, preallocated) and a queue of rows
(prompt, seed). Every iteration:
    admission  while slots are free and rows wait, the next rows are prefilled (each distinct prompt of a run of
               equal ones once, right-padded: a row attends only to its own earlier tokens, so no mask) and their
               caches copied into the free slots; each samples its first token from its prompt's last logits;
    decode     one forward of every live slot (each at its own length), one token each;
    finish     a row that sampled eos or its max_new_tokens-th token frees its slot: the last live slots move into
               the holes, so the live rows are always the first slots and a decode step computes no finished row.
A row's tokens depend on its prompt, its seed and the weights only, not on its neighbours or its slot: its
sampling draws are counter-based (`gumbel_noise`: a hash of the row's seed, its token index and the vocabulary
index), and argmax(log p + Gumbel noise) samples from p exactly (the Gumbel-max trick).

Under expert parallelism (`lockstep`) every rank's MoE layers exchange tokens, so every rank makes every forward:
at each iteration the ranks agree (one all-reduce) whether any of them admits rows (then every rank runs a
prefill forward, a one-token dummy where it has none) and whether any has live rows (then every rank runs a
decode forward, a dummy where it has none); the loop ends when no rank has rows left. Decode steps in fixed shapes
(`FixedShapeStep`, what a CUDA graph captures) run on every slot of every rank (the same slots everywhere, the free
ones fed a pad token), at a span the ranks agree on (one more all-reduce a step).

A `RowSource` (dynamic sampling's streamed rounds, allsync/producers/streamed.py) adds rows while the loop runs: at
every iteration it may queue more (a round whose rows wait behind the last one's), hears which rows ended, and
decides when the stream stops; the rows still queued or live then are dropped (finish reason "dropped").
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import TopPLogitsWarper

from moe_lora.kv_caches import ExpandedKVCache, LatentKVCache, SavedRow, SlotKVCache
from quant.modules import fixed_shapes

_HASH = 0x45D9F3B  # the multiplier of a well-mixing 32-bit integer hash; < 2^27, so int64 products never overflow
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of x in [0, 2^32) (int64): x = ((x >> 16) ^ x) * m twice, then (x >> 16) ^ x."""
    x = (((x >> 16) ^ x) * _HASH) & _MASK32
    x = (((x >> 16) ^ x) * _HASH) & _MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) draws [rows, vocab] for each row's token index `steps` under its seed (int64, [rows]):
    g = -log(-log u), u = (24 bits of hash(seed, step, token) + 1/2) / 2^24. The draws of a row depend on
    (seed, step, token) only (counter-based: no generator state shared between rows)."""
    low, high = seeds & 0x7FFFFFFF, (seeds >> 31) & 0x7FFFFFFF
    key = _mix32(_mix32(_mix32(high) ^ low) ^ (steps & _MASK32))
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(key[:, None] ^ tokens[None, :]) ^ key[:, None])
    u = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return -torch.log(-torch.log(u))


def sample_rows(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, sampling) -> tuple:
    """(tokens, logprobs) [rows] from float32 scores [rows, V]: argmax when greedy, else the Gumbel-max sample of
    softmax(scores / T) (after top_p when set, transformers' TopPLogitsWarper); the logprob of each chosen token is
    log softmax(scores / T)[token] (T = 1 when greedy)."""
    temperature = 1.0 if sampling.greedy else sampling.temperature
    if sampling.greedy:
        chosen = scores.argmax(-1)
    else:
        warped = scores / temperature
        if sampling.top_p < 1.0:
            warped = TopPLogitsWarper(sampling.top_p)(None, warped)
        chosen = (warped + gumbel_noise(seeds, steps, scores.shape[-1])).argmax(-1)
    logprobs = torch.log_softmax(scores / temperature, dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
    return chosen, logprobs


@dataclass
class Decoded:
    """What `decode_in_slots` returns: per row its tokens (eos included) and their logprobs, its finish reason
    ("stop" or "length"); the work done (positions computed, slot-steps of decode forwards and the tokens they
    produced); for routing replay the record's call index and rows of every forward."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    reasons: list[str]
    positions: int
    decode_slots: int
    decoded_tokens: int
    # (record call, rows, distinct prompt of each row, width, (first, end) of the positions each row records there)
    prefills: list[tuple[int, list[int], list[int], int, list[tuple[int, int]]]]
    decodes: list[tuple[int, list[int]]]  # (record call, the row in each live slot)
    # with keep: each row that reached max_new_tokens, its slot's positions (its prompt and tokens but the last), to
    # continue it without a prefill (decode_in_slots' `resumed`)
    saved: dict[int, SavedRow] = field(default_factory=dict)


class RowSource(Protocol):
    """Rows that arrive while `decode_in_slots` runs (module docstring)."""

    capacity: int  # the most positions a row it gives holds: its prompt + max_new_tokens, or fewer
    most_rows: int  # the most rows it gives in all

    def more(self, waiting: int, free: int) -> tuple[list[list[int]], torch.Tensor]:
        """Rows to queue now (prompts) and their seeds [rows] int64, with `waiting` rows queued and `free` slots free;
        ([], empty) for none."""
        ...

    def ended(self, rows: list[int], result: Callable[[int], tuple[list[int], str]]) -> None:
        """Rows (indices in arrival order) that ended; result(i) is row i's (tokens, finish reason)."""
        ...

    def stopped(self) -> bool:
        """Whether the stream ends here (every rank asks once per iteration of the loop, so it may agree over ranks)."""
        ...


def runs_of_equal(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Consecutive equal rows collapsed: (distinct rows, how many times each repeats), in order."""
    distinct, repeats = [], []
    for row in rows:
        if distinct and distinct[-1] == row:
            repeats[-1] += 1
        else:
            distinct.append(row)
            repeats.append(1)
    return distinct, repeats


def right_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] ids padded on the right, and each row's length."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids.to(device), torch.tensor([len(p) for p in prompts], device=device)


def decode_forward(
    model, pool: SlotKVCache, last: torch.Tensor, longest: int, live: torch.Tensor | None = None
) -> torch.Tensor:
    """One decode forward of the first len(last) slots of `pool` (each fed its last token at its own length, the
    longest holding `longest` positions): their next-token scores [live, V]; the slots' lengths advance by one, or,
    for a fixed-shape step of every slot, by `live` [slots] (SlotKVCache.advance)."""
    pool.begin_step(len(last), longest + 1, live)
    scores = model(
        input_ids=last[:, None],
        position_ids=pool.lengths[: len(last), None],
        past_key_values=pool,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    pool.advance(live)
    return scores


def span_bucket(needed: int, capacity: int) -> int:
    """The attention span a fixed-shape decode step reads when the longest live slot needs `needed` positions:
    `needed` rounded up to a multiple of 2^(b - 4) (b = bit length of needed - 1, at least 64), at most `capacity`:
    8 spans per doubling, so a step reads at most 1/8 more cached positions than it needs (a quarter at the first
    spans) and a CUDA graph per span covers every length with about 8 log2(capacity / 64) graphs."""
    quantum = max(64, 1 << max((needed - 1).bit_length() - 4, 0))
    return min(capacity, -(-needed // quantum) * quantum)


class FixedShapeStep:
    """One decode step of every slot of a pool with tensors whose shapes depend on (slots, span) only and no host read
    (what a CUDA graph can capture; `allsync.engines.graphs.GraphedStep` captures it): every slot is fed its last token
    at its own length, a free slot a pad token whose result nobody reads; its length advances by `live` [slots] (1 for
    a live slot, 0 for a free one); the routed experts run in fixed shapes (quant.modules.fixed_shapes). Returns the
    sampled tokens and their logprobs [slots]."""

    def __init__(self, model, pool: SlotKVCache, sampling):
        self.model, self.pool, self.sampling = model, pool, sampling

    def __call__(self, last, live, seeds, steps, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        with fixed_shapes(self.model):
            scores = decode_forward(self.model, self.pool, last, span - 1, live)
        return sample_rows(scores.float(), seeds, steps, self.sampling)


@torch.no_grad()
def decode_in_slots(
    model,
    rows: list[list[int]],
    seeds: torch.Tensor,
    sampling,
    eos_id: int,
    pad_id: int,
    slots: int,
    expanded: bool,
    lockstep=None,
    calls=lambda: 0,
    fixed_step=None,
    resumed: dict[int, SavedRow] | None = None,
    keep: bool = False,
    fp8_rank: int | None = None,
    kernel: bool = False,
    source: RowSource | None = None,
    pages: int | None = None,
) -> Decoded:
    """Sample one response to each of `rows` (prompts, consecutive equal ones prefilled once) with `slots` KV slots
    (module docstring). seeds [rows] int64: each row's sampling stream. expanded: the slots hold expanded MLA keys
    and values (else the latent). calls(): how many forwards the routing record holds so far (0 when none).
    fixed_step(model, pool, sampling): a decode step of every slot in fixed shapes (FixedShapeStep or a graph of it)
    that decode steps take instead of a forward of the live slots alone (None). resumed: rows whose positions but
    the last are saved from an earlier call under the same weights (SavedRow of len(row) - 1 positions): they take
    a slot without a prefill, fed their last token at the next decode step. keep: save the positions of every row
    that reaches max_new_tokens (Decoded.saved). fp8_rank: the slots keep the latent's first fp8_rank values in FP8
    (SlotKVCache; with expanded False). kernel: decode steps attend with moe_lora.latent_attention's kernel (SlotKVCache;
    with expanded False). source: a RowSource whose rows are appended to `rows` (their seeds to `seeds`) as they
    arrive; the loop then ends when it says stop (under lockstep, once no rank has rows left), `rows` holding every row
    it gave. pages: the slots share this many KV pages (SlotKVCache's paged pool, rollout.kv_cache_tokens), taken as
    rows grow: a row is admitted when its positions fit the free pages with one to spare per live row, and when a
    decode step's rows need more pages than are free, the latest admitted live rows are preempted (`preempt`)."""
    device = model.device
    total, limit = len(rows), sampling.max_new_tokens
    if limit < 1 and source is None:
        return Decoded([[] for _ in rows], [[] for _ in rows], ["length"] * total, 0, 0, 0, [], [])
    tokens = torch.full((max(total, 1), limit), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(tokens.shape, device=device)
    counts = torch.zeros(max(total, 1), dtype=torch.long, device=device)  # tokens each row has so far
    seeds = seeds.to(device) if total else torch.zeros(1, dtype=torch.long, device=device)  # free slots draw row 0's
    reasons = [""] * total
    queue = collections.deque(range(total))
    capacity = source.capacity if source is not None else max(map(len, rows), default=1) + limit
    if lockstep is not None and (fixed_step is not None or pages is not None):
        # fixed shapes: every rank's MoE layers take the same T = slots, and the ranks agree on each step's span, which
        # must fit every rank's pool; pages: every rank's pool admits the longest row of any rank, or all refuse
        pool = SlotKVCache(slots, lockstep.max_over_ranks(capacity), fp8_rank, kernel, pages)
    else:
        most = total if source is None else source.most_rows
        pool = SlotKVCache(max(min(slots, most), 1), capacity, fp8_rank, kernel, pages)
    live: list[int] = []  # live[i]: the row in slot i (on the device: live_rows)
    live_rows = torch.zeros(0, dtype=torch.long, device=device)
    last = torch.zeros(0, dtype=torch.long, device=device)  # each live slot's last token
    longest = 0  # the most positions a live slot holds
    out = Decoded([], [], [], 0, 0, 0, [], [])
    resumed = dict(resumed or {})
    preempted: dict[int, int] = {}  # a preempted row -> the positions it held (recomputed at its next prefill)
    admitted: dict[int, int] = {}  # a live row -> when it was admitted (the latest goes first when pages run out)
    admissions = itertools.count()
    step = fixed_step(model, pool, sampling) if fixed_step is not None else None
    every_slot = torch.arange(pool.slots, device=device)

    def extend(new_rows: list[list[int]], new_seeds: torch.Tensor) -> None:
        """Rows from the source at the back of the queue (the row-sized tensors grown to hold them)."""
        nonlocal tokens, logprobs, counts, seeds
        start, n = len(rows), len(new_rows)
        tokens = torch.cat([tokens[:start], tokens.new_full((n, limit), pad_id)])
        logprobs = torch.cat([logprobs[:start], logprobs.new_zeros((n, limit))])
        counts = torch.cat([counts[:start], counts.new_zeros(n)])
        seeds = torch.cat([seeds[:start], new_seeds.to(device)])
        rows.extend(new_rows)
        reasons.extend([""] * n)
        queue.extend(range(start, start + n))

    def drop() -> None:
        """The stream stopped: its queued and live rows end here, unfinished."""
        nonlocal live, live_rows, last, longest
        for r in [*queue, *live]:
            reasons[r] = "dropped"
        queue.clear()
        live, live_rows, last, longest = [], live_rows[:0], last[:0], 0

    def result(row: int) -> tuple[list[int], str]:
        return tokens[row, : int(counts[row])].tolist(), reasons[row]

    def take(index: torch.Tensor, chosen: torch.Tensor, chosen_lp: torch.Tensor) -> torch.Tensor:
        """Rows `index` get their next token; returns [2, rows]: sampled eos, reached the limit."""
        tokens[index, counts[index]] = chosen
        logprobs[index, counts[index]] = chosen_lp.float()
        counts[index] += 1
        return torch.stack([chosen == eos_id, counts[index] >= limit])

    def finish(ended: list[list[int]]) -> None:
        """Free the slots of the live rows that ended (ended: [eos, limit, positions held] per live slot)."""
        eos, full, held = ended
        gone = [i for i in range(len(live)) if eos[i] or full[i]]
        for i in gone:
            reasons[live[i]] = "stop" if eos[i] else "length"
            if keep and not eos[i]:
                out.saved[live[i]] = pool.saved(i, held[i])
        if source is not None and gone:
            source.ended([live[i] for i in gone], result)
        vacate(gone, held)

    def vacate(gone: list[int], held: list[int]) -> None:
        """Free slots `gone` (live slot indices; held: positions per live slot): the last live slots move into the
        holes, so the live rows stay the first slots."""
        nonlocal live, live_rows, last, longest
        stay = len(live) - len(gone)
        for i in gone:
            admitted.pop(live[i], None)
        gone_set = set(gone)
        holes = [i for i in gone if i < stay]
        movers = [i for i in range(stay, len(live)) if i not in gone_set]
        pool.release(gone)
        if holes:
            pool.move(movers, holes, max(held[m] for m in movers))
            src, dst = torch.tensor(movers, device=device), torch.tensor(holes, device=device)
            last[dst], live_rows[dst] = last[src], live_rows[src]
            for h, m in zip(holes, movers):
                live[h], held[h] = live[m], held[m]
        live, live_rows, last = live[:stay], live_rows[:stay], last[:stay]
        longest = max(held[:stay], default=0)

    def preempt() -> None:
        """While the live rows' next positions need more pages than are free, the latest admitted live row leaves
        its slot and goes back to the front of the queue with the tokens it has (vLLM's recompute preemption: its
        next prefill is its prompt and those tokens; its draws continue where they were, being counted per token)."""
        while pool.pages_short(len(live)) > 0:
            i = max(range(len(live)), key=lambda j: admitted[live[j]])
            row = live[i]
            preempted[row] = int(pool.sizes[i])
            resumed.pop(row, None)
            queue.appendleft(row)
            vacate([i], [int(n) for n in pool.sizes[: len(live)]])
        pool.reserve(len(live))

    def prompt_of(row: int) -> list[int]:
        """What a row's prefill computes: its prompt, and for a preempted row the tokens it had."""
        if row in preempted:
            return rows[row] + tokens[row, : int(counts[row])].tolist()
        return rows[row]

    def admissible(room: int) -> int:
        """How many rows at the front of the queue take a slot now: at most `room`, as many as the pool's pages
        admit (SlotKVCache.can_admit)."""
        if not pool.paged:
            return room
        pages = 0
        for taken, r in enumerate(itertools.islice(queue, room)):
            # the positions its prefill (or restore) fills: a preempted row's held ones and the token it sampled last
            held = resumed[r].length if r in resumed else preempted[r] + 1 if r in preempted else len(rows[r])
            pages += pool.pages_for(held + 1)
            if not pool.can_admit(pages, len(live) + taken + 1):
                return taken
        return room

    def serve_other_ranks() -> None:
        """A one-token forward, so that this rank's MoE layers take part in the other ranks' all-to-alls. With a
        fixed-shape step the first one also shapes the pool's buffers (slot 0, which stays free), so that this rank
        can take part in fixed-shape steps before any row of its own has filled a slot."""
        pad = torch.full((1, 1), pad_id, device=device)
        if step is None or pool.lengths is not None:
            model(input_ids=pad, use_cache=False)
            return
        cache = (ExpandedKVCache if expanded else LatentKVCache)(reserve=0)
        model.model(input_ids=pad, position_ids=torch.zeros_like(pad), past_key_values=cache, use_cache=True)
        pool.fill(
            0, cache, torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, dtype=torch.long, device=device)
        )
        pool.release([0])  # a paged pool: slot 0 stays free, its page back in the pool

    def fixed_shape_decode() -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape step over every slot (the live ones first, a free one fed a pad token and row 0's draws),
        at the span of the longest live row (under lockstep the longest over ranks); the live rows' tokens and
        logprobs."""
        span = span_bucket(longest + 1, pool.capacity) if live else 0
        if lockstep is not None:
            span = lockstep.max_over_ranks(span)
        if span == 0:  # no rank has a live row (each admitted row ended at its first token): no step anywhere
            return last[:0], last[:0].float()
        free = pool.slots - len(live)
        rows_in = torch.cat([live_rows, live_rows.new_zeros(free)])
        chosen, chosen_lp = step(
            torch.cat([last, last.new_full((free,), pad_id)]),
            (every_slot < len(live)).long(),
            seeds[rows_in],
            counts[rows_in],
            span,
        )
        return chosen[: len(live)], chosen_lp[: len(live)]

    streaming = source is not None  # the source may still give rows
    while True:
        if streaming:
            if source.stopped():
                drop()
                streaming = False
                if lockstep is None:
                    break
            else:
                new_rows, new_seeds = source.more(len(queue), pool.slots - len(live))
                if new_rows:
                    extend(new_rows, new_seeds)
        admit = admissible(min(len(queue), pool.slots - len(live)))
        if lockstep is not None:
            agreed = lockstep.max_over_ranks(2 * int(admit > 0) + int(admit > 0 or bool(live)))
            any_admit, any_live = agreed >= 2, agreed >= 1
        else:
            any_admit, any_live = admit > 0, admit > 0 or bool(live)
        if not any_live:
            if streaming:  # nothing to decode until the source says more or stop (global filling: the others)
                continue
            break
        if admit:
            taken = [queue.popleft() for _ in range(admit)]
            admitted.update((r, next(admissions)) for r in taken)
            back, new = [r for r in taken if r in resumed], [r for r in taken if r not in resumed]
            if back:  # saved positions into slots: fed their last token at this iteration's decode step
                pool.restore(len(live), [resumed[r] for r in back])
                index = torch.tensor(back, device=device)
                last_tokens = torch.tensor([rows[r][-1] for r in back], device=device)
                live, live_rows, last = live + back, torch.cat([live_rows, index]), torch.cat([last, last_tokens])
                longest = max(longest, *(resumed[r].length for r in back))
        if admit and new:
            prompts = [prompt_of(r) for r in new]
            distinct, repeats = runs_of_equal(prompts)
            ids, lengths = right_pad(distinct, pad_id, device)
            cache = (ExpandedKVCache if expanded else LatentKVCache)(reserve=0)
            call = calls()
            hidden = model.model(
                input_ids=ids,
                position_ids=torch.arange(ids.shape[1], device=device)[None].expand_as(ids),
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state
            scores = model.lm_head(hidden[torch.arange(len(distinct), device=device), lengths - 1]).float()
            which = torch.repeat_interleave(
                torch.arange(len(distinct), device=device), torch.tensor(repeats, device=device)
            )
            pool.fill(len(live), cache, which, lengths[which])
            index = torch.tensor(new, device=device)
            chosen, chosen_lp = sample_rows(scores[which], seeds[index], counts[index], sampling)
            ended = take(index, chosen, chosen_lp)
            # the positions whose routing this prefill records first: a preempted row's last one (the rest were
            # recorded before it was preempted)
            spans = [(preempted[r], preempted.pop(r) + 1) if r in preempted else (0, len(rows[r])) for r in new]
            out.prefills.append((call, new, which.tolist(), ids.shape[1], spans))
            out.positions += ids.numel()
            held = [longest] * len(live) + [len(p) for p in prompts]
            flags = [[False] * len(live) + f for f in ended.tolist()]
            live, live_rows, last = live + new, torch.cat([live_rows, index]), torch.cat([last, chosen])
            longest = max(held)
            finish([*flags, held])  # rows whose first token ended them
        elif any_admit and lockstep is not None:  # lockstep: serve the other ranks' prefill
            serve_other_ranks()
        if live:
            preempt()
        if live:
            call = calls()
            if step is None:
                scores = decode_forward(model, pool, last, longest)
                chosen, chosen_lp = sample_rows(scores.float(), seeds[live_rows], counts[live_rows], sampling)
            else:
                chosen, chosen_lp = fixed_shape_decode()
            ended = take(live_rows, chosen, chosen_lp)
            out.decodes.append((call, list(live)))
            out.positions += len(live)
            out.decode_slots += pool.slots
            out.decoded_tokens += len(live)
            last = chosen
            pool.grow(len(live))
            finish(torch.cat([ended.long(), pool.lengths[None, : len(live)]]).tolist())
        elif any_live and lockstep is not None:  # lockstep: serve the other ranks' decode step
            serve_other_ranks() if step is None else fixed_shape_decode()
    total = len(rows)
    lengths = counts[:total].tolist()
    out.tokens = [t[:n] for t, n in zip(tokens[:total].tolist(), lengths)]
    out.logprobs = [lp[:n] for lp, n in zip(logprobs[:total].tolist(), lengths)]
    out.reasons = reasons
    return out
