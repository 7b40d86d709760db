"""The KV caches of the torch engine's MLA decode (moe_lora/mla_decode.py reads them):

- `ExpandedKVCache` / `LatentKVCache` (`ReservedKVCache`): one row per sequence of a static batch, positions written
  into buffers with room for more (`ReservedLayer`) instead of transformers' concatenation at every step;
- `SlotKVCache`: a fixed pool of slots for continuous batching, paged, each row's cache in a slot from its prefill
  until it ends, optionally with the latent stored in FP8 (`FP8LatentLayer`, DeepSeek's FlashMLA layout).

What a layer holds (expanded keys and values, or the latent [c_s ; k_rope_s] with an empty value) is the cache's
kind; `expanded_cache_fits` says which takes less memory per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from quant.formats import FP8_DTYPE, FP8_MAX


class ReservedKVCache(DynamicCache):
    """A DynamicCache whose layers keep their positions in buffers with room for `reserve` more (`ReservedLayer`).
    What they hold, and so how attention reads them, is the subclass's."""

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(ReservedLayer, reserve)


class ExpandedKVCache(ReservedKVCache):
    """Layers holding expanded MLA keys [B, H, S, d_nope + d_rope] and values [B, H, S, d_v]."""


class LatentKVCache(ReservedKVCache):
    """Layers holding MLA's latent keys [B, 1, S, kv_lora_rank + d_rope] ([c_s ; k_rope_s], the value c_s being their
    first kv_lora_rank values, so the value slot holds nothing: [B, 1, S, 0]). Attention reads it in latent space
    (`absorbed_attention`)."""


class ReservedLayer(DynamicLayer):
    """A DynamicLayer that writes new positions into preallocated buffers instead of concatenating.

    transformers' layer copies the whole cache at every step (torch.cat): O(S) per token. This one writes
    the new positions into buffers [B, H, S + reserve, d] and hands out views of their first S positions, so a
    decode step copies only its own token until the reserve runs out (then one copy into a new buffer with the
    same reserve). Reordering the batch (batch_select_indices after prefill) replaces the cache with a fresh
    tensor, which the next update copies into a new buffer. The values are the concatenation's, bit for bit."""

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = reserve
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._buffers_hold_cache(end):
            self.buffers = (
                _with_room(self.keys, key_states, end + self.reserve),
                _with_room(self.values, value_states, end + self.reserve),
            )
        keys, values = self.buffers
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def _buffers_hold_cache(self, end: int) -> bool:
        """The buffers still back self.keys/values (nothing replaced them) and have room up to `end`."""
        if self.buffers is None:
            return False
        keys, values = self.buffers
        return (
            keys.shape[-2] >= end
            and self.keys.shape[0] == keys.shape[0]
            and self.keys.data_ptr() == keys.data_ptr()
            and self.values.data_ptr() == values.data_ptr()
        )


def _with_room(cached: torch.Tensor, new_states: torch.Tensor, capacity: int) -> torch.Tensor:
    """A [B, H, capacity, d] buffer (B, H, d of new_states) holding `cached` (possibly empty) at its first positions."""
    batch, heads, _, dim = new_states.shape
    buffer = new_states.new_empty(batch, heads, capacity, dim)
    if cached.numel():
        buffer[:, :, : cached.shape[-2]] = cached
    return buffer


FP8_GROUP = 128  # latent values sharing one scale (DeepSeek's FlashMLA FP8 cache: 4 tiles of 128 for kv_lora_rank 512)


KV_PAGE_TOKENS = 64  # positions in a page of a paged SlotKVCache (a multiple of the kernel's 32-position blocks)


class SlotKVCache(DynamicCache):
    """A fixed pool of `slots` rows for continuous batching, each with room for `capacity` positions: a row's cache
    lives in a slot from its prefill until it ends, and the next row's prefill then takes the slot. Per layer the
    buffers hold what the two caches above hold (expanded keys and values, or the latent with an empty value) in
    pages, [pages, H, page, d]; `table` [slots, capacity / page] names the page that holds each slot's positions
    [j page, (j + 1) page), and `lengths` [slots] counts each slot's cached positions (`sizes` is the host's copy).
    The live rows occupy the first slots (`live`); a decode step writes each live slot's new position at its own
    length (`SlotLayer.update`) and attends under `mask`: position p of slot s is seen when p <= lengths[s], up to
    `span` positions (the longest live row's, so that attention reads no more than it needs). The engine fills
    slots from a prefill's cache (`fill`), moves the last live slots into the holes of finished rows (`move`) and
    advances the lengths after every decode forward (`advance`, `grow`).

    pages None: each slot is one page of `capacity` positions (page = capacity, table[s] = [s]): every slot can
    hold a row at full length, and attention reads views of the buffers. pages N (rollout.kv_cache_tokens): N pages
    of KV_PAGE_TOKENS positions shared by the slots, as vLLM's paged cache shares blocks, plus page 0, a scratch page
    that every position no row owns maps to (a free slot's writes in a fixed-shape step, a prefill's right padding):
    a slot takes pages as its row grows (`fill`, `reserve`) and gives them back when the row ends or is preempted
    (`release`), so the pool holds as many rows as their actual lengths fit, not as many as fit at full length.
    `can_admit` and `pages_short` say when the pages run out (the engine preempts then, allsync/engines/slots.py).

    fp8_rank r (rollout.kv_cache_dtype fp8; the latent only): each layer keeps the latent's first r values (c_s) in
    float8_e4m3fn with one float32 scale per FP8_GROUP of them, and k_rope_s as computed (`FP8LatentLayer`).

    kernel (rollout.attention_kernel triton; the latent only): a decode step attends with
    moe_lora.latent_attention's kernel, each slot reading its own `counts` positions as stored (through `table`),
    instead of the live slots' buffers up to the span under `mask`."""

    def __init__(
        self, slots: int, capacity: int, fp8_rank: int | None = None, kernel: bool = False, pages: int | None = None
    ):
        super().__init__()
        self.slots, self.capacity, self.fp8_rank, self.kernel = slots, capacity, fp8_rank, kernel
        self.paged = pages is not None
        self.page = KV_PAGE_TOKENS if self.paged else capacity
        self.page_count = pages + 1 if self.paged else slots  # buffer pages (the scratch page 0 when paged)
        self.width = -(-capacity // self.page)  # table columns: the most pages a slot can hold
        if self.paged and pages < self.width + 1:
            raise ValueError(
                f"a paged KV pool of {pages} pages of {self.page} positions (rollout.kv_cache_tokens) cannot admit one "
                f"row of {capacity:,} positions: it needs {self.width} pages and one to spare"
            )
        self.free = list(range(pages, 0, -1)) if self.paged else []  # free pages (pop() takes the lowest)
        self.owned: list[list[int]] = [[] for _ in range(slots)]  # each slot's pages in order (paged)
        self.owned_count = np.zeros(slots, dtype=np.int64)  # len(owned[s])
        self.sizes = np.zeros(
            slots, dtype=np.int64
        )  # positions each slot holds (the host's copy of lengths; paged only)
        self.lengths: torch.Tensor | None = None
        self.table: torch.Tensor | None = None
        self.live, self.span = 0, 0
        self.mask: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # kernel: positions each stepped slot reads
        self.latent = False  # the buffers hold the latent (filled from a LatentKVCache)

    def _on(self, device: torch.device) -> None:
        """lengths and table on `device` (at the first fill or restore)."""
        if self.lengths is not None:
            return
        self.lengths = torch.zeros(self.slots, dtype=torch.long, device=device)
        if self.paged:
            self.table = torch.zeros(self.slots, self.width, dtype=torch.long, device=device)
        else:
            self.table = torch.arange(self.slots, device=device)[:, None]

    def new_layer(self, keys: torch.Tensor, values: torch.Tensor) -> "SlotLayer":
        """A layer for states shaped like keys [., H, ., d] and values [., H, ., d_v] (what this pool stores of them)."""
        if self.fp8_rank is not None:
            if not self.latent:
                raise ValueError("an FP8 KV cache holds MLA's latent only (fill it from a LatentKVCache)")
            rope = keys.shape[-1] - self.fp8_rank
            return FP8LatentLayer(self, self.fp8_rank, rope, keys.dtype, keys.device)
        parts = [(keys.shape[1], keys.shape[-1], keys.dtype), (values.shape[1], values.shape[-1], values.dtype)]
        return SlotLayer(self, parts, keys.device)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page)

    def can_admit(self, pages: int, live: int) -> bool:
        """Whether rows needing `pages` pages in all (each its positions and the one its next decode step writes)
        fit the free pages with one page to spare for each of the `live` rows there would be: vLLM's admission
        watermark, so that a row just admitted is not the next step's preemption. Always, unpaged."""
        return not self.paged or pages + live <= len(self.free)

    def full_slots(self, live: int) -> np.ndarray:
        """Which of the first `live` slots fill every position of their pages (their next position needs a new page):
        size >= pages owned x page size (paged)."""
        return self.sizes[:live] >= self.owned_count[:live] * self.page

    def pages_short(self, live: int) -> int:
        """Pages the first `live` slots' next positions need beyond the free ones (> 0: preempt; 0 unpaged)."""
        if not self.paged:
            return 0
        return int(self.full_slots(live).sum()) - len(self.free)

    def reserve(self, live: int) -> None:
        """Pages for the position each of the first `live` slots writes next (before a decode step)."""
        if self.paged:
            self._take({int(s): int(self.sizes[s]) + 1 for s in np.flatnonzero(self.full_slots(live))})

    def _take(self, positions: dict[int, int]) -> None:
        """Slot s owns pages for its first positions[s] positions (one table write for all new pages)."""
        if not self.paged:
            return
        new = []
        for slot, count in positions.items():
            owned = self.owned[slot]
            while len(owned) * self.page < count:
                new.append((slot, len(owned), self.free[-1]))
                owned.append(self.free.pop())
            self.owned_count[slot] = len(owned)
        if new:
            where = torch.tensor([(s, j) for s, j, _ in new], device=self.table.device).T
            self.table[where[0], where[1]] = torch.tensor([p for _, _, p in new], device=self.table.device)

    def release(self, slots: list[int]) -> None:
        """These slots' rows are gone (ended or preempted): their pages go back to the free list and their table
        rows to the scratch page."""
        if not self.paged or not slots:
            return
        for slot in slots:
            self.sizes[slot] = 0
            self.free.extend(reversed(self.owned[slot]))
            self.owned[slot] = []
            self.owned_count[slot] = 0
        self.table[torch.tensor(slots, device=self.table.device)] = 0

    def grow(self, live: int) -> None:
        """The host's sizes after a decode step of the first `live` slots (advance is the device's; paged only: an
        unpaged pool needs no host copy of its lengths)."""
        if self.paged:
            self.sizes[:live] += 1

    def fill(self, start: int, source: DynamicCache, which: torch.Tensor, lengths: torch.Tensor) -> None:
        """Slots start, start + 1, ... get rows `which` of a prefill's cache (ExpandedKVCache or LatentKVCache of
        right-padded prompts: a row's positions [0, lengths) are its own) and those lengths."""
        self.latent = isinstance(source, LatentKVCache)
        self._on(lengths.device)
        width = source.get_seq_length()
        end = start + len(which)
        if self.paged:  # the host's copy of the lengths (one device read), for the pages
            sizes = lengths.tolist()
            self.sizes[start:end] = sizes
            self._take(dict(zip(range(start, end), sizes)))
        slots = torch.arange(start, end, device=lengths.device)
        positions = torch.arange(width, device=lengths.device)
        for index, layer in enumerate(source.layers):
            if index == len(self.layers):
                self.layers.append(self.new_layer(layer.keys, layer.values))
            self.layers[index].write(slots, positions, layer.keys[which], layer.values[which])
        self.lengths[start:end] = lengths

    def saved(self, slot: int, length: int) -> "SavedRow":
        """A copy of slot `slot`'s first `length` positions, every layer, as stored (for `restore` in a later pool)."""
        pages = self.table[slot, : self.pages_for(length)]
        return SavedRow(
            [tuple(layer.gather(b, pages[None], length)[0].clone() for b in layer.buffers) for layer in self.layers],
            self.latent,
        )

    def restore(self, start: int, rows: list["SavedRow"]) -> None:
        """Slots start, start + 1, ... get the positions `rows` saved (`saved`), and their lengths."""
        self.latent = rows[0].latent
        device = rows[0].buffers[0][0].device
        self._on(device)
        self.sizes[start : start + len(rows)] = [row.length for row in rows]
        self._take({slot: row.length for slot, row in enumerate(rows, start)})
        for index, parts in enumerate(rows[0].buffers):
            if index == len(self.layers):
                self.layers.append(self.restored_layer(parts))
            layer = self.layers[index]
            for slot, row in enumerate(rows, start):
                positions = torch.arange(row.length, device=device)
                layer.store(torch.tensor([slot], device=device), positions, [p[None] for p in row.buffers[index]])
        self.lengths[start : start + len(rows)] = torch.tensor([row.length for row in rows])

    def restored_layer(self, parts: tuple[torch.Tensor, ...]) -> "SlotLayer":
        """An empty layer whose buffers take saved `parts` ([H, length, d_i] each, as a layer of this pool stored
        them)."""
        if self.fp8_rank is not None:  # quantized c, scales, k_rope
            rope = parts[2]
            return FP8LatentLayer(self, self.fp8_rank, rope.shape[-1], rope.dtype, rope.device)
        return SlotLayer(self, [(p.shape[0], p.shape[-1], p.dtype) for p in parts], parts[0].device)

    def move(self, sources: list[int], targets: list[int], span: int) -> None:
        """Slot targets[i] takes slot sources[i]'s row (its first `span` positions, at least what it holds) and length;
        the targets were released. Paged, the pages change hands (table rows); unpaged, the positions are copied."""
        if not sources:
            return
        src = torch.tensor(sources, device=self.lengths.device)
        dst = torch.tensor(targets, device=self.lengths.device)
        if self.paged:
            self.table[dst] = self.table[src]
            self.table[src] = 0
        else:
            for layer in self.layers:
                for buffer in layer.buffers:
                    buffer[dst, :, :span] = buffer[src, :, :span]
        for s, t in zip(sources, targets):
            self.sizes[t], self.sizes[s] = self.sizes[s], 0
            self.owned[t], self.owned[s] = self.owned[s], []
            self.owned_count[t], self.owned_count[s] = self.owned_count[s], 0
        self.lengths[dst] = self.lengths[src]

    def begin_step(self, live: int, span: int, live_slots: torch.Tensor | None = None) -> None:
        """A decode forward of the first `live` slots, the longest live one holding span - 1 positions; live_slots
        [slots] (a fixed-shape step of every slot): 1 for a live slot, 0 for a free one, which the kernel gives one
        position (its result is not read)."""
        self.live, self.span = live, span
        if self.kernel:  # each slot's cached positions and the new one, never past the span
            counts = (self.lengths[:live] + 1).clamp_max(span)
            self.counts = counts if live_slots is None else torch.where(live_slots.bool(), counts, 1)
            return
        positions = torch.arange(span, device=self.lengths.device)
        self.mask = (positions[None, :] <= self.lengths[:live, None])[:, None, None, :]

    def advance(self, live: torch.Tensor | None = None) -> None:
        """The live slots' lengths after a decode forward: the first `live` slots' + 1 (begin_step's), or, for a step
        of every slot in fixed shapes, + live [slots] (1 for a live slot, 0 for a free one)."""
        if live is None:
            self.lengths[: self.live] += 1
        else:
            self.lengths += live

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.span - 1, 0)


@dataclass
class SavedRow:
    """A row's cached positions taken out of a SlotKVCache (`SlotKVCache.saved`): per layer its buffers' [H, length, d]
    slices as the pool stored them (keys and values, latent or expanded; or FP8LatentLayer's three parts)."""

    buffers: list[tuple[torch.Tensor, ...]]
    latent: bool

    @property
    def length(self) -> int:
        return self.buffers[0][0].shape[1]


class SlotLayer(DynamicLayer):
    """One layer of a SlotKVCache: one buffer [pages, H, page, d] per (H, d, dtype) of `parts` (keys and values,
    shaped like a prefill layer's)."""

    def __init__(self, pool: SlotKVCache, parts: list[tuple[int, int, torch.dtype]], device: torch.device):
        super().__init__()
        self.pool = pool
        self.buffers = tuple(
            torch.zeros(pool.page_count, heads, pool.page, dim, dtype=dtype, device=device)
            for heads, dim, dtype in parts
        )
        self.dtype, self.device, self.is_initialized = parts[0][2], device, True
        self.keys, self.values = self.buffers[0], self.buffers[-1]

    def stored(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """What the buffers keep of keys and values ([n, H, w, d] each): themselves."""
        return [keys, values]

    def write(self, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Positions `positions` [w] (or [n, w]) of slots `slots` [n] get these keys and values [n, H, w, d]."""
        self.store(slots, positions, self.stored(keys, values))

    def store(self, slots: torch.Tensor, positions: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Positions of slots (`write`) get `parts` as stored, [n, H, w, d_i] each: page table[s, p // page], place
        p % page (a position no page of the slot holds: the scratch page)."""
        pool = self.pool
        positions = positions.expand(len(slots), -1) if positions.dim() == 1 else positions
        pages = pool.table[slots[:, None], positions // pool.page]
        places = positions % pool.page
        for buffer, part in zip(self.buffers, parts):
            buffer[pages, :, places] = part.transpose(1, 2)

    def gather(self, buffer: torch.Tensor, pages: torch.Tensor, span: int) -> torch.Tensor:
        """[n, H, span, d]: the first `span` positions held by `pages` [n, span / page] (each row a slot's pages in
        order) of `buffer`."""
        rows = buffer[pages]  # [n, pages, H, page, d]
        return rows.transpose(1, 2).flatten(2, 3)[:, :, :span]

    def read_buffers(self, live: int, span: int) -> list[torch.Tensor]:
        """Every buffer's first `live` slots up to `span` positions: views of an unpaged pool, gathered pages of a
        paged one."""
        if not self.pool.paged:
            return [b[:live, :, :span] for b in self.buffers]
        pages = self.pool.table[:live, : self.pool.pages_for(span)]
        return [self.gather(b, pages, span) for b in self.buffers]

    def read(self, live: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `live` slots' keys and values up to `span` positions, as attention reads them."""
        keys, values = self.read_buffers(live, span)
        return keys, values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Each live slot's one new position (key_states [live, H, 1, d]) written at its own length."""
        pool = self.pool
        slots = torch.arange(pool.live, device=key_states.device)
        self.write(slots, pool.lengths[: pool.live, None], key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """`append`, then the live slots' keys and values up to the span."""
        self.append(key_states, value_states)
        return self.read(self.pool.live, self.pool.span)

    def stored_latent(self, rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The pool's latent as stored, by page, for moe_lora.latent_attention: (c [pages, page, r], None,
        k_rope [pages, page, d_rope]) of a latent pool (its keys buffer holds [c ; k_rope]; r = kv_lora_rank)."""
        latent = self.buffers[0][:, 0]
        return latent[..., :rank], None, latent[..., rank:]

    def get_seq_length(self) -> int:
        return self.pool.get_seq_length()


class FP8LatentLayer(SlotLayer):
    """A SlotKVCache layer holding MLA's latent [c_s ; k_rope_s] with c_s (the first r values) in float8_e4m3fn:
    per FP8_GROUP values g of a position one float32 scale a_g = max |c_g| / 448 and q_g = e4m3(c_g / a_g), and
    k_rope_s in the compute dtype (rotary keys are not normalized; DeepSeek's FlashMLA FP8 cache keeps them in
    bf16 too). DeepSeek-V3: 512 + 4 x 4 + 64 x 2 = 656 bytes a token and layer against 1,152 in bf16. Attention
    reads c_s = q_g a_g back in the compute dtype (`read`; a fused kernel would read the FP8 bytes directly)."""

    def __init__(self, pool: SlotKVCache, rank: int, rope: int, dtype: torch.dtype, device: torch.device):
        """rank: kv_lora_rank (c_s's values); rope: d_rope; dtype: the compute dtype k_rope is kept and read in."""
        group = fp8_group(rank)
        super().__init__(pool, [(1, rank, FP8_DTYPE), (1, rank // group, torch.float32), (1, rope, dtype)], device)
        self.rank, self.group, self.dtype = rank, group, dtype  # dtype: what `read` gives attention
        self.empty_values = torch.zeros(pool.slots, 1, pool.capacity, 0, dtype=dtype, device=device)  # [slots, ...]
        self.values = self.empty_values

    def stored(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """(c in FP8, its scales, k_rope) of the latent keys [n, 1, w, r + d_rope]."""
        quantized, scales = fp8_quantize(keys[..., : self.rank], self.group)
        return [quantized, scales, keys[..., self.rank :]]

    def stored_latent(self, rank: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(c in FP8 [pages, page, r], its scales [pages, page, r / group], k_rope [pages, page, d_rope])."""
        return tuple(b[:, 0] for b in self.buffers)

    def read(self, live: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The live slots' latent up to `span` in the compute dtype, [live, 1, span, r + d_rope]: c = q a written into
        its first r values, k_rope copied after them (no concatenation)."""
        quantized, scales, rope = self.read_buffers(live, span)
        latent = rope.new_empty(*rope.shape[:-1], self.rank + rope.shape[-1])
        fp8_dequantize(quantized, scales, self.group, self.dtype, out=latent[..., : self.rank])
        latent[..., self.rank :] = rope
        return latent, self.empty_values[:live, :, :span]


def fp8_group(rank: int) -> int:
    """Latent values per FP8 scale: FP8_GROUP where it divides kv_lora_rank, else all of them."""
    return FP8_GROUP if rank % FP8_GROUP == 0 else rank


def fp8_latent_bytes(rank: int, rope: int, rope_bytes: int) -> int:
    """Bytes of one position and layer in an FP8 latent cache: kv_lora_rank FP8 values, a float32 scale per
    fp8_group of them, d_rope values of rope_bytes each (DeepSeek-V3 in bf16: 512 + 16 + 128 = 656)."""
    return rank + rank // fp8_group(rank) * 4 + rope * rope_bytes


def fp8_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (e4m3(x_g / a_g) [..., n], a_g [..., n / group] float32) with a_g = max |x_g| / 448 per group
    of `group` consecutive values (a group of zeros gets a_g = 1e-12 / 448, and zeros)."""
    grouped = x.float().unflatten(-1, (-1, group))
    scales = grouped.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    quantized = (grouped / scales[..., None]).to(FP8_DTYPE)
    return quantized.flatten(-2), scales


def fp8_dequantize(
    quantized: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8_quantize's inverse: q_g a_g in `dtype` (the scales rounded to it first), into `out` when given."""
    grouped = quantized.unflatten(-1, (-1, group)).to(dtype)
    if out is None:
        return (grouped * scales[..., None].to(dtype)).flatten(-2)
    torch.mul(grouped, scales[..., None].to(dtype), out=out.unflatten(-1, (-1, group)))
    return out


def expanded_cache_fits(config) -> bool:
    """True when the expanded cache takes no more memory per token than the latent one:
    H (d_nope + d_rope + d_v) <= kv_lora_rank + d_rope."""
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return config.num_attention_heads * per_head <= config.kv_lora_rank + config.qk_rope_head_dim
