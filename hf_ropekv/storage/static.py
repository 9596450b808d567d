"""A layer's keys and values in a fixed arena that a compiled decode step can hold on to."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .buffers import mark_static, static_buffer
from .paged import PagedKV

if TYPE_CHECKING:
    from .buffers import BufferLease


class StaticKV(PagedKV):
    """Keys and values of one layer in a fixed arena that a recorded (graphed or compiled) decode step holds on to.

    The arena holds ``budget + compress_every`` slots in whole pages, or fewer for a generation known to be shorter
    (:meth:`fit`: no more than a ``DynamicCache`` would hold, plus a page). It is allocated once, zeroed (a masked
    slot still multiplies its zero weight, so it must be finite) and marked as a static address. The cache decides
    everything on the host before a forward (:meth:`plan_write`); the forward only writes at ``write_index``
    (:meth:`write`), so a recorded step reads no host counter.

    A forward longer than the arena (a long prompt that is not pinned, sent in one piece) spills into a temporary
    larger arena; the compaction that brings the layer back within it moves the survivors back (:meth:`_shrink_to_hint`).
    """

    def __init__(self, capacity: int, page_size: int, layer_idx: int = 0, lease: "BufferLease | None" = None) -> None:
        super().__init__(page_size, capacity_hint=capacity)
        self.layer_idx = layer_idx
        self._lease = lease  # where the arena's keys and values come from (hf_ropekv.storage.buffers)
        self.steady_capacity = self.static_capacity = -(-capacity // page_size) * page_size
        self._arena: tuple[torch.Tensor, torch.Tensor] | None = None  # the fixed keys and values
        self.write_index: torch.Tensor | None = None  # int64 [q] on the arena's device: slots of this forward's tokens
        self.planned_write = (0, 0)  # (first slot, tokens) of the coming forward, for a layer not allocated yet

    def fit(self, tokens: int) -> None:
        """Size the fixed arena for a generation of at most ``tokens`` tokens per row (whole pages, never past the
        steady-state bound). An arena allocated already only grows, its live slots copied."""
        capacity = min(self.steady_capacity, -(-tokens // self.page_size) * self.page_size)
        if self._arena is None:
            self.static_capacity = capacity
            return
        if capacity <= self.static_capacity:
            return
        old_keys, old_values = self._arena
        self._give_back_arena()
        self.static_capacity = capacity
        keys, values = self._new_arena(old_keys, old_values)
        if self.keys is old_keys:  # the live slots are in the fixed arena: move them
            keys[:, :, : self.length] = old_keys[:, :, : self.length]
            values[:, :, : self.length] = old_values[:, :, : self.length]
            self.keys, self.values = keys, values
            if self.positions is not None:
                positions = torch.full(keys.shape[:3], -1, dtype=torch.int64, device=keys.device)
                positions[:, :, : self.length] = self.positions[:, :, : self.length]
                self.positions = positions

    def plan_write(self, first_slot: int, new: int, seen: int, index: torch.Tensor | None) -> None:
        """Before a forward: count its ``new`` tokens (positions from ``seen``) as written from ``first_slot``, at
        ``index`` (device slots; None until the arena exists, then made at the first write)."""
        self.advance(new, seen)
        self.write_index = index
        self.planned_write = (first_slot, new)

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """Allocate the fixed arena for ``key_states``' batch, heads, dtype and device (the layer's first write),
        and a temporary one when the first forward needs ``needed`` slots, more than the fixed arena holds."""
        self.keys, self.values = self._new_arena(key_states, value_states)
        if needed > self.static_capacity:  # nothing is stored before the first forward: a temporary arena, no copy
            self.keys = None
            super()._reserve(key_states, value_states, needed)
            self._zero_from(0)

    def _new_arena(self, key_like: torch.Tensor, value_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, _, head_dim = key_like.shape
        device, capacity = key_like.device, self.static_capacity
        keys = self._buffer("keys", (batch, heads, capacity, head_dim), key_like.dtype, device)
        values = self._buffer("values", (batch, heads, capacity, value_like.shape[-1]), value_like.dtype, device)
        self._arena = (keys, values)
        return keys, values

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots before a forward: beyond the fixed arena, a temporary one (eager only)."""
        if self.keys is not None and needed > self.capacity:
            super()._reserve(self.keys, self.values, needed)
            self._zero_from(self.length)

    def _zero_from(self, slot: int) -> None:
        # Attention reads the whole arena and the mask hides the slots past the live ones; a hidden slot still
        # multiplies its zero weight, so it must hold a finite value, not the garbage of torch.empty (NaN * 0).
        self.keys[:, :, slot:].zero_()
        self.values[:, :, slot:].zero_()

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's tokens at ``write_index``; return the whole arena (the mask hides unused slots)."""
        if self.write_index is None:  # allocated by this forward's first write: its slots are known now
            start, count = self.planned_write
            self.write_index = torch.arange(start, start + count, device=key_states.device)
        self.keys.index_copy_(2, self.write_index, key_states)
        self.values.index_copy_(2, self.write_index, value_states)
        return self.keys, self.values

    def append(self, *args, **kwargs):  # type: ignore[override]
        raise TypeError("StaticKV is written with plan_write() + write(); append() belongs to the growing PagedKV.")

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder rows in place (beam search keeps the arena's address); a new row count reallocates."""
        if self.keys is None:
            return
        index = index.to(self.keys.device)
        if self._arena is not None and self.keys is self._arena[0] and index.numel() == self.keys.shape[0]:
            for tensor in self._arena:
                tensor.copy_(tensor.index_select(0, index))
            if self.positions is not None:
                self.positions = self.positions.index_select(0, index)
            return
        super().select_batch(index)
        self._arena = None  # a different row count: the fixed arena is reallocated from what select_batch built
        self._adopt_as_arena()

    def repeat_batch(self, repeats: int) -> None:
        super().repeat_batch(repeats)
        self._arena = None
        self._adopt_as_arena()

    def clear(self) -> None:
        self._give_back_arena()
        super().clear()
        self._arena = None
        self.write_index = None

    def _give_back_arena(self) -> None:
        if self._arena is not None and self._lease is not None:
            for tensor in self._arena:
                self._lease.give_back(tensor)

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return static_buffer(self._lease, (name, self.layer_idx, device), shape, dtype, device)

    def _adopt_as_arena(self) -> None:
        if self.keys is not None and self.capacity == self.static_capacity:
            self._arena = (self.keys, self.values)
            mark_static(*self._arena)

    def _shrink_to_hint(self) -> None:
        """After a compaction: leave a temporary arena for the fixed one once the survivors fit in it."""
        if self._arena is None or self.keys is self._arena[0] or self.length > self.static_capacity:
            return
        keys, values = self._arena
        live = self.length
        keys[:, :, :live] = self.keys[:, :, :live]
        values[:, :, :live] = self.values[:, :, :live]
        if self.positions is not None:
            self.positions = self.positions[:, :, : self.static_capacity].clone()
        self.keys, self.values = keys, values
