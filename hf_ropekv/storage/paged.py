"""Paged key/value storage of one attention layer.

One arena per layer, ``[batch, kv_heads, capacity, head_dim]`` for keys and values plus the absolute
token index of every slot. Live slots are always the prefix ``[0, length)`` of every (row, head), so
attention reads a view of the arena (no copy), appending ``q`` tokens writes ``q`` slots, and
compaction moves survivors forward in place (``hf_ropekv.kernels.compact``): the trailing pages it frees
are the ones the next tokens are written to. Capacity is counted in pages of ``page_size`` slots and only
grows while the cache is filling up (prompt, or before the first compaction).
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

from ..kernels.compact import compact_
from .buffers import mark_static

if TYPE_CHECKING:
    from .buffers import BufferLease


class PagedKV:
    """Keys, values and slot positions of one layer, compacted in place.

    Args:
        page_size: slots per page; capacity is always a whole number of pages.
        capacity_hint: slots the arena holds in steady state (``budget + compress_every``); growth stops
            there, so once the cache is full, decoding never reallocates.
    """

    def __init__(self, page_size: int, capacity_hint: int | None = None) -> None:
        self.page_size = page_size
        self.capacity_hint = capacity_hint
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # int64 [B, H, capacity]: token index of each slot
        self.length = 0
        # Appends are consecutive tokens, so positions are written lazily (only scorers and compaction read
        # them): slots from `_positions_valid` on hold tokens `_pending_position`, `_pending_position + 1`, ...
        self._positions_valid = 0
        self._pending_position = 0
        self.num_compactions = 0
        self._step_views = _StepViews()

    # -- introspection -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def pages_allocated(self) -> int:
        return self.capacity // self.page_size

    @property
    def pages_in_use(self) -> int:
        return -(-self.length // self.page_size)

    @property
    def bytes_held(self) -> int:
        if self.keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))

    # -- writes --------------------------------------------------------------------------------
    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor, first_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``q`` new tokens after the live slots; return views of all live slots (keys, values)."""
        q = key_states.shape[2]
        length = self.length
        end = length + q
        if self.keys is None or end > self.keys.shape[2]:
            self._reserve(key_states, value_states, end)
        views = self._step_views.get(self) if q == 1 else None
        if views is not None:
            write_keys, write_values, keys, values = views
            write_keys.copy_(key_states)  # what `self.keys[:, :, length:end] = key_states` does, minus the slicing
            write_values.copy_(value_states)
        else:
            self.keys[:, :, length:end] = key_states
            self.values[:, :, length:end] = value_states
            keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        self.advance(q, first_position)
        return keys, values

    def advance(self, new: int, first_position: int) -> None:
        """Count ``new`` tokens (positions ``first_position, ...``) as written after the live slots (host only;
        their positions are written lazily, see ``_write_positions``)."""
        if self._positions_valid == self.length:
            self._pending_position = first_position
        self.length += new

    def _after_compaction(self, keep: torch.Tensor, start: torch.Tensor | None) -> None:
        kept = keep.shape[-1]
        # Positions are 8 bytes a slot: a small gather is cheaper than another kernel launch path.
        moved = self.positions.gather(2, keep.clamp_min(0))
        if start is not None:
            slot = torch.arange(kept, device=keep.device)
            moved = moved.masked_fill(slot[None, None, :] < start.view(-1, 1, 1), -1)
        self.positions[:, :, :kept] = moved
        self.length = self._positions_valid = kept
        self.num_compactions += 1
        self._shrink_to_hint()

    def truncate(self, length: int) -> None:
        """Forget the live slots from ``length`` on (a crop before anything was evicted)."""
        self.length = max(0, min(self.length, length))
        self._positions_valid = min(self._positions_valid, self.length)

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select batch rows (beam search, contrastive search)."""
        if self.keys is None:
            return
        index = index.to(self.keys.device)
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self.positions = self.positions.index_select(0, index)

    def repeat_batch(self, repeats: int) -> None:
        if self.keys is None:
            return
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)
        self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def clear(self) -> None:
        """Drop everything, memory included."""
        self.keys = self.values = self.positions = None
        self.length = self._positions_valid = self._pending_position = 0
        self.num_compactions = 0
        self._step_views = _StepViews()

    # -- views ---------------------------------------------------------------------------------
    def live_keys(self) -> torch.Tensor:
        return self.keys[:, :, : self.length]

    def live_positions(self) -> torch.Tensor:
        """int64 ``[B, H, length]``: the token index (padding included) held by each live slot."""
        self._write_positions()
        return self.positions[:, :, : self.length]

    def _write_positions(self) -> None:
        start, end = self._positions_valid, self.length
        if end > start:
            first = self._pending_position
            self.positions[:, :, start:end] = torch.arange(first, first + end - start, device=self.positions.device)
            self._positions_valid = end

    # -- allocation ----------------------------------------------------------------------------
    def _shrink_to_hint(self) -> None:
        """Give back what a long, unpinned prefill made the arena grow to, once it fits the steady state."""
        if self.capacity_hint is None:
            return
        steady = -(-self.capacity_hint // self.page_size) * self.page_size
        if self.capacity > steady and self.length <= steady:
            self.keys = self.keys[:, :, :steady].clone()
            self.values = self.values[:, :, :steady].clone()
            self.positions = self.positions[:, :, :steady].clone()

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        if self.keys is not None and needed <= self.capacity:
            return
        batch, heads, _, head_dim = key_states.shape
        # Grow geometrically (amortised O(1) appends) but never past the steady-state size unless asked: a
        # short generation then holds about what it uses, and a long one stops reallocating at the budget.
        target = needed if self.keys is None else max(needed, 2 * self.capacity)
        if self.capacity_hint is not None:
            target = max(needed, min(target, self.capacity_hint))
        capacity = -(-target // self.page_size) * self.page_size
        device = key_states.device
        keys = torch.empty(batch, heads, capacity, head_dim, dtype=key_states.dtype, device=device)
        values = torch.empty(batch, heads, capacity, value_states.shape[-1], dtype=value_states.dtype, device=device)
        positions = torch.empty(batch, heads, capacity, dtype=torch.int64, device=device)
        if self.keys is not None and self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
            positions[:, :, : self.length] = self.positions[:, :, : self.length]
        self.keys, self.values, self.positions = keys, values, positions


class _StepViews:
    """Views of one arena for single-token appends, made once per live length and reused.

    In steady state a decoding step appends at one of the ``compress_every`` or so lengths the compaction cycle
    goes through, every cycle: slicing the arena anew each step (the slot to write, the live slots to return:
    four views per layer and step, about a microsecond of host time each) is the same work over again. The views
    are reused only under ``torch.no_grad()`` (``generate``), where an in-place write into them is exactly the
    sliced assignment; with autograd or inference mode on, ``append`` slices as before. They belong to the
    arenas they were cut from (checked by identity, so a reallocated arena starts afresh) and are never copied:
    a deep copy of the storage starts with none.
    """

    #: Lengths remembered per arena: a whole compaction cycle for ``compress_every`` up to this.
    LIMIT = 512

    __slots__ = ("keys", "values", "by_length")

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.by_length: dict[int, tuple[torch.Tensor, ...]] = {}

    def __deepcopy__(self, memo: dict) -> "_StepViews":
        return _StepViews()

    def get(self, arena: "PagedKV") -> tuple[torch.Tensor, ...] | None:
        """``(slot keys, slot values, live keys, live values)`` for appending one token to ``arena``, or None."""
        if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return None
        if self.keys is not arena.keys or self.values is not arena.values:
            self.keys, self.values, self.by_length = arena.keys, arena.values, {}
        length = arena.length
        views = self.by_length.get(length)
        if views is None and len(self.by_length) < self.LIMIT:
            end = length + 1
            keys, values = arena.keys, arena.values
            views = (keys[:, :, length:end], values[:, :, length:end], keys[:, :, :end], values[:, :, :end])
            self.by_length[length] = views
        return views


def compact_arenas(arenas: list[PagedKV], keep: torch.Tensor, start: torch.Tensor | None = None) -> None:
    """Compact several arenas that keep the same slots, one kernel launch per device.

    At batch 1 a single layer gives the kernel only ``kv_heads`` programs; all layers together fill the GPU.
    Each arena keeps slots ``keep[b, :, start[b]:]`` (ascending per row and head), moved in order to
    ``[start[b], K')`` with ``K' = keep.shape[-1]``; slots before ``start[b]`` become holes (their position reads -1).
    ``start`` [B] (optional): first destination slot of each row (see :func:`hf_ropekv.kernels.compact.compact_`).
    """
    by_device: dict[torch.device, list[PagedKV]] = {}
    for arena in arenas:
        by_device.setdefault(arena.keys.device, []).append(arena)
    for device, group in by_device.items():
        keep_here = keep.to(device)
        start_here = None if start is None else start.to(device)
        for arena in group:
            arena._write_positions()
        compact_([t for arena in group for t in (arena.keys, arena.values)], keep_here, start_here)
        for arena in group:
            arena._after_compaction(keep_here, start_here)


class StaticKV(PagedKV):
    """Keys, values and slot positions of one layer in a fixed arena that a compiled decode step can hold on to.

    The arena (``capacity`` slots, ``budget + compress_every`` rounded up to whole pages) is allocated once, zeroed
    (masked slots must hold finite values: attention multiplies them by a zero weight) and marked as a static
    address, so CUDA graphs replay over it. The cache decides everything on the host before a forward
    (:meth:`advance`, and ``write_index``: where the forward's tokens go, a device tensor); the forward itself only
    writes there (:meth:`write`), which reads no host counter, so the compiled step never sees a changing
    Python value.

    A single forward longer than the arena (a long prompt that is not pinned, sent in one piece) spills into a
    temporary larger arena; the compaction that brings the layer back within ``capacity`` moves the survivors
    into the fixed arena again (:meth:`_shrink_to_hint`).
    """

    def __init__(self, capacity: int, page_size: int, layer_idx: int = 0, lease: "BufferLease | None" = None) -> None:
        super().__init__(page_size, capacity_hint=capacity)
        self.layer_idx = layer_idx
        self._lease = lease  # where the arena's keys and values come from (hf_ropekv.storage.buffers)
        self.static_capacity = -(-capacity // page_size) * page_size
        self._arena: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the fixed keys, values, positions
        self.write_index: torch.Tensor | None = None  # int64 [q] on the arena's device: slots of this forward's tokens
        self.planned_write = (0, 0)  # (first slot, tokens) of the coming forward, for a layer not allocated yet

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """Allocate the fixed arena for ``key_states``' batch, heads, dtype and device (the layer's first write),
        and a temporary one when the first forward needs ``needed`` slots, more than the fixed arena holds."""
        batch, heads, _, head_dim = key_states.shape
        device, capacity = key_states.device, self.static_capacity
        keys = self._buffer("keys", (batch, heads, capacity, head_dim), key_states.dtype, device)
        values = self._buffer("values", (batch, heads, capacity, value_states.shape[-1]), value_states.dtype, device)
        positions = torch.full((batch, heads, capacity), -1, dtype=torch.int64, device=device)  # read eagerly only
        self._arena = (keys, values, positions)
        self.keys, self.values, self.positions = keys, values, positions
        if needed > capacity:  # nothing is stored before the first forward: a fresh temporary arena, no copy
            self.keys = None
            super()._reserve(key_states, value_states, needed)
            self._zero_from(0)

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
        self.keys.index_copy_(2, self.write_index, key_states)
        self.values.index_copy_(2, self.write_index, value_states)
        return self.keys, self.values

    def append(self, *args, **kwargs):  # type: ignore[override]
        raise TypeError("StaticKV is written with advance() + write(); append() belongs to the growing PagedKV.")

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder rows in place (beam search keeps the arena's address); a new row count reallocates."""
        if self.keys is None:
            return
        index = index.to(self.keys.device)
        if self._arena is not None and self.keys is self._arena[0] and index.numel() == self.keys.shape[0]:
            for tensor in self._arena:
                tensor.copy_(tensor.index_select(0, index))
            return
        super().select_batch(index)
        self._arena = None  # a different row count: the fixed arena is reallocated from what select_batch built
        self._adopt_as_arena()

    def repeat_batch(self, repeats: int) -> None:
        super().repeat_batch(repeats)
        self._arena = None
        self._adopt_as_arena()

    def clear(self) -> None:
        if self._arena is not None and self._lease is not None:
            for tensor in self._arena[:2]:
                self._lease.give_back(tensor)
        super().clear()
        self._arena = None
        self.write_index = None

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer at a static address: from the lease (the model's previous static cache), or new."""
        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        if self._lease is not None:
            return self._lease.take((name, self.layer_idx, device), shape, dtype, make)
        tensor = make()
        mark_static(tensor)
        return tensor

    def _adopt_as_arena(self) -> None:
        if self.keys is not None and self.capacity == self.static_capacity:
            self._arena = (self.keys, self.values, self.positions)
            mark_static(*self._arena)

    def _shrink_to_hint(self) -> None:
        """After a compaction: leave a temporary arena for the fixed one once the survivors fit in it."""
        if self._arena is None or self.keys is self._arena[0] or self.length > self.static_capacity:
            return
        keys, values, positions = self._arena
        live = self.length
        keys[:, :, :live] = self.keys[:, :, :live]
        values[:, :, :live] = self.values[:, :, :live]
        positions[:, :, :live] = self.positions[:, :, :live]
        self.keys, self.values, self.positions = keys, values, positions
