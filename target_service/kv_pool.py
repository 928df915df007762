"""A KV pool of fixed slots: one row per open session, so a batch of sessions needs no cache copies.

Layout per layer: K and V of shape [slots, kv_heads, capacity, head_dim]. A session owns one
slot and its tokens occupy positions 0..length-1 of that row; rolling back after a rejection is
just a shorter length (the stale rows are overwritten by the next step and masked until then).
Slots and capacity grow by doubling on demand, so an idle server holds little memory.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import torch

# A batch whose slots span at most this many times its rows reads the span as one slice
# (`covering_rows`) rather than gathering its rows.
COVER_MOST = 1.5

@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> "KVShape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device, slots: int = 4, capacity: int = 256):
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.k = self._zeros(slots, capacity)
        self.v = self._zeros(slots, capacity)
        self._free = list(range(slots))
        heapq.heapify(self._free)
        # Growth caps (None: none): the target sets them from its session limit and the model's
        # context, so doubling never takes the pool past the KV budget.
        self.max_slots: int | None = None
        self.max_capacity: int | None = None

    def _zeros(self, slots: int, capacity: int) -> torch.Tensor:
        s = self.shape
        return torch.zeros(s.num_layers, slots, s.num_kv_heads, capacity, s.head_dim, dtype=self.dtype, device=self.device)

    def set_limits(self, max_slots: int | None, max_capacity: int | None) -> None:
        """Caps growth at `max_slots` rows of `max_capacity` positions; a pool with nothing
        allocated yet that is already larger shrinks to them now."""
        self.max_slots, self.max_capacity = max_slots, max_capacity
        if len(self._free) != self.slots:
            return
        slots = self.slots if max_slots is None else min(self.slots, max_slots)
        capacity = self.capacity if max_capacity is None else min(self.capacity, max_capacity)
        if (slots, capacity) != (self.slots, self.capacity):
            self.k, self.v = self._zeros(slots, capacity), self._zeros(slots, capacity)
            self._free = list(range(slots))
            heapq.heapify(self._free)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def allocate(self) -> int:
        """The lowest free slot (low slots keep batches contiguous, which avoids gathers)."""
        if not self._free:
            slots = self.slots * 2 if self.max_slots is None else min(self.slots * 2, max(self.max_slots, self.slots + 1))
            self._resize(slots, self.capacity)
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def ensure_capacity(self, positions: int) -> None:
        if positions > self.capacity:
            capacity = self.capacity
            while capacity < positions:
                capacity *= 2
            if self.max_capacity is not None:
                capacity = min(capacity, max(positions, self.max_capacity))
            self._resize(self.slots, capacity)

    def _resize(self, slots: int, capacity: int) -> None:
        old_slots, old_cap = self.slots, self.capacity
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self._zeros(slots, capacity)
            new[:, :old_slots, :, :old_cap] = old
            setattr(self, name, new)
        for slot in range(old_slots, slots):
            heapq.heappush(self._free, slot)


def covering_rows(slots: list[int], most: float = COVER_MOST) -> list[int] | None:
    """Where each of `slots` (ascending) sits in the slice of pool rows from the first to the
    last, when a batch should read that slice, gaps and all, instead of gathering its rows; None
    when the slots are contiguous (the slice is the batch) or the slice would be more than `most`
    times the batch.

    Gathering copies every layer's keys and values of the whole batch before attention reads
    them again: at 16 sessions over 350 cached tokens a plain pass of 15 rows with one gap cost
    161 ms against 117 for 15 contiguous rows, and at 16 sessions a session is missing from a
    pass whenever its request has just ended or it came back late (docs/benchmarks.md, "Gaps in
    a batch's slots"). Reading a gap row costs a row of attention reads and nothing else."""
    lo, hi = slots[0], slots[-1]
    if hi - lo + 1 == len(slots) or hi - lo + 1 > most * len(slots):
        return None
    return [slot - lo for slot in slots]


class BatchCacheView:
    """What a transformers model sees as its cache during one batched forward pass.

    Row b belongs to pool slot slots[b] and writes its new keys/values at positions
    starts[b] .. starts[b] + n - 1; attention reads positions 0 .. kv_length - 1 of each row,
    and the caller's mask hides what a row must not see. With `lengths` the pass is packed
    (target_service/packed_attention.py): the new keys/values arrive as one sequence, row b's
    `lengths[b]` of them after the rows before it.

    Slots in ascending order with gaps between them are read as one slice, gap rows included,
    when `cover` is set and the gaps are few (`covering_rows`): `cover_rows` then says where
    each row of the batch sits in it, and the attention (target_service/packed_attention.py)
    computes only those rows. Otherwise rows that are not one slice are gathered.
    """

    def __init__(self, pool: KVPool, slots: list[int], starts: list[int], kv_length: int,
                 lengths: list[int] | None = None, cover: bool = False):
        self.pool = pool
        self.slots = slots
        self.starts = starts
        self.kv_length = kv_length
        self.lengths = lengths
        lo = slots[0]
        self.cover_rows = covering_rows(slots) if cover and slots == sorted(slots) else None
        contiguous = slots == list(range(lo, lo + len(slots)))
        self._range = (slice(lo, lo + len(slots)) if contiguous else
                       slice(lo, slots[-1] + 1) if self.cover_rows is not None else None)
        self._index = None if self._range is not None else torch.tensor(slots, device=pool.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        # key_states, value_states: [batch, kv_heads, n_new, head_dim], packed: [1, kv_heads, T, head_dim]
        k_layer, v_layer = self.pool.k[layer_idx], self.pool.v[layer_idx]
        if self.lengths is None:
            n = key_states.shape[2]
            for b, (slot, start) in enumerate(zip(self.slots, self.starts)):
                k_layer[slot, :, start:start + n] = key_states[b]
                v_layer[slot, :, start:start + n] = value_states[b]
        else:
            offset = 0
            for slot, start, n in zip(self.slots, self.starts, self.lengths):
                k_layer[slot, :, start:start + n] = key_states[0, :, offset:offset + n]
                v_layer[slot, :, start:start + n] = value_states[0, :, offset:offset + n]
                offset += n
        rows = self._range if self._range is not None else self._index
        return k_layer[rows, :, : self.kv_length], v_layer[rows, :, : self.kv_length]
