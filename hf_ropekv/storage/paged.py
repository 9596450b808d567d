"""Paged key/value storage of one attention layer.

One arena per layer, ``[batch, kv_heads, capacity, head_dim]`` for keys and values plus the absolute
token index of every slot. Live slots are always the prefix ``[0, length)`` of every (row, head), so
attention reads a view of the arena (no copy), appending ``q`` tokens writes ``q`` slots, and
compaction moves survivors forward in place (``hf_ropekv.kernels.compact``): the trailing pages it frees
are the ones the next tokens are written to. Capacity grows in pages of ``page_size`` slots, only while the cache
is filling up (prompt, or before the first compaction), and stops at the steady-state bound
(``budget + compress_every``) even inside a page. The fixed arena of a static cache is in ``storage/static.py``.
"""

from __future__ import annotations

import torch

from ..kernels.compact import compact_


class PagedKV:
    """Keys, values and slot positions of one layer, compacted in place.

    Args:
        page_size: slots per page; capacity grows in whole pages up to ``capacity_hint``.
        capacity_hint: slots the arena holds in steady state (``budget + compress_every``); growth stops
            there, so once the cache is full, decoding never reallocates.
    """

    def __init__(self, page_size: int, capacity_hint: int | None = None) -> None:
        self.page_size = page_size
        self.capacity_hint = capacity_hint
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        # int64 [B, H, capacity]: the token index of each slot, made when first read (scoring, compaction): a cache
        # that never evicts holds no more than a DynamicCache, plus at most one page.
        self.positions: torch.Tensor | None = None
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
        return -(-self.capacity // self.page_size)  # the last page may be cut to the steady-state bound

    @property
    def pages_in_use(self) -> int:
        return -(-self.length // self.page_size)

    @property
    def bytes_held(self) -> int:
        if self.keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions) if t is not None)

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
        if self.positions is not None:
            self.positions = self.positions.index_select(0, index)

    def repeat_batch(self, repeats: int) -> None:
        if self.keys is None:
            return
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)
        if self.positions is not None:
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
        if self.positions is None:
            self.positions = torch.empty(self.keys.shape[:3], dtype=torch.int64, device=self.keys.device)
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
        steady = self.capacity_hint
        if self.capacity > steady and self.length <= steady:
            self.keys = self.keys[:, :, :steady].clone()
            self.values = self.values[:, :, :steady].clone()
            self.positions = self.positions[:, :, :steady].clone()

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        if self.keys is not None and needed <= self.capacity:
            return
        batch, heads, _, head_dim = key_states.shape
        # Whole pages, never past the steady-state bound unless one forward needs more: a cache that never evicts
        # holds at most one page more than a DynamicCache, and copies its layer once a page (DynamicCache: each step).
        capacity = -(-needed // self.page_size) * self.page_size
        if self.capacity_hint is not None and needed <= self.capacity_hint:
            capacity = min(capacity, self.capacity_hint)
        device = key_states.device
        keys = torch.empty(batch, heads, capacity, head_dim, dtype=key_states.dtype, device=device)
        values = torch.empty(batch, heads, capacity, value_states.shape[-1], dtype=value_states.dtype, device=device)
        positions = None
        if self.positions is not None:
            positions = torch.empty(batch, heads, capacity, dtype=torch.int64, device=device)
            positions[:, :, : self.length] = self.positions[:, :, : self.length]
        if self.keys is not None and self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
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
