"""A layer's keys and values in a fixed arena that a compiled decode step can hold on to."""

from __future__ import annotations

import torch

from ..kernels.quantize import quantize_into_
from .buffers import BufferLease, mark_static, normal_tensors, static_buffer
from .paged import PagedKV, attention_view


class StaticKV(PagedKV):
    """A layer's planes (``PagedKV``) in a fixed arena that a recorded (graphed or compiled) decode step holds on to.

    The arena holds ``budget + compress_every`` slots in whole pages, or fewer for a shorter generation (:meth:`fit`).
    It is allocated once, zeroed and marked as a static address. The cache plans each forward on the host
    (:meth:`plan_write`); the forward only writes at ``write_index`` (:meth:`write`), so a recorded step reads no host
    counter. A forward longer than the arena spills into a temporary larger one until a compaction brings it back.
    """

    def __init__(self, capacity: int, page_size: int, layer_idx: int = 0, lease: BufferLease | None = None,
                 bits: int | None = None, pair_partner: torch.Tensor | None = None) -> None:
        super().__init__(page_size, capacity_hint=capacity, bits=bits, pair_partner=pair_partner)
        self.layer_idx = layer_idx
        self._lease = lease  # where the arena's planes come from (hf_ropekv.storage.buffers)
        self.steady_capacity = self.static_capacity = -(-capacity // page_size) * page_size
        self._arena: list[torch.Tensor] | None = None  # the fixed planes
        self.write_index: torch.Tensor | None = None  # int64 [q] on the arena's device: slots of this forward's tokens
        self.planned_write = (0, 0)  # (first slot, tokens) of the coming forward, for a layer not allocated yet

    @normal_tensors
    def fit(self, tokens: int) -> None:
        """Size the fixed arena for at most ``tokens`` tokens per row (whole pages, at most the steady state); an
        allocated arena only grows, its live slots copied."""
        capacity = min(self.steady_capacity, -(-tokens // self.page_size) * self.page_size)
        if self._arena is None:
            self.static_capacity = capacity
            return
        if capacity <= self.static_capacity:
            return
        old = self._arena
        self._give_back_arena()
        self.static_capacity = capacity
        arena = self._new_arena(old)
        if self.planes is old:  # the live slots are in the fixed arena: move them
            self._move_live_to(arena)
            self._mark()

    def plan_write(self, first_slot: int, new: int, seen: int, index: torch.Tensor | None) -> None:
        """Before a forward: count its ``new`` tokens (positions from ``seen``) as written from ``first_slot``, at
        ``index`` (device slots; None until the arena exists, then made at the first write)."""
        self.advance(new, seen)
        self.write_index = index
        self.planned_write = (first_slot, new)

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """Allocate the fixed arena like these keys (the layer's first write), and a temporary one when the first
        forward needs ``needed`` slots, more than it holds."""
        self.dtype = key_states.dtype
        like = self.encode(key_states[:, :, :0], value_states[:, :, :0])
        self.planes = self._new_arena(like)
        self._mark()
        if needed > self.static_capacity:  # nothing is stored before the first forward: a temporary arena, no copy
            self.planes = None
            self._reserve(like, needed)
            self._zero_from(0)

    def _new_arena(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        self._arena = [static_buffer(self._lease, (f"plane{i}", self.layer_idx, p.device),
                                     (*p.shape[:2], self.static_capacity, p.shape[3]), p.dtype, p.device)
                       for i, p in enumerate(like)]
        return self._arena

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots before a forward: beyond the fixed arena, a temporary one (eager only)."""
        if self.planes is not None and needed > self.capacity:
            self._reserve(self.planes, needed)
            self._zero_from(self.length)

    def _zero_from(self, slot: int) -> None:
        # Attention reads the whole arena: a masked slot still multiplies its zero weight, so it must be finite.
        for plane in self.planes:
            plane[:, :, slot:].zero_()

    def balance_keys(self, key_states: torch.Tensor, real_from: torch.Tensor | None) -> None:
        """As :meth:`PagedKV.balance_keys`, into a buffer at a static address (a recorded step reads it)."""
        super().balance_keys(key_states, real_from)
        balance = self.balance
        self.balance = static_buffer(self._lease, ("balance", self.layer_idx, balance.device), tuple(balance.shape),
                                     balance.dtype, balance.device)
        self.balance.copy_(balance)
        self._mark()

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's tokens at ``write_index``; return the whole arena (the mask hides unused slots)."""
        if self.write_index is None:  # allocated by this forward's first write: its slots are known now
            start, count = self.planned_write
            self.write_index = torch.arange(start, start + count, device=key_states.device)
        if self.bits is None:
            self.keys.index_copy_(2, self.write_index, key_states)
            self.values.index_copy_(2, self.write_index, value_states)
        else:  # codes and scales in one launch per tensor
            quantize_into_(self.planes[0], self.planes[2], key_states, self.write_index, self.balance)
            quantize_into_(self.planes[1], self.planes[3], value_states, self.write_index)
        return self.keys, self.values  # marked for attention outside the step (see _mark), so it traces no setattr

    def _mark(self) -> None:
        """Mark the planes attention reads now (``attention_view``): eagerly, between steps, never inside one."""
        if self.planes is not None:
            attention_view(self.planes, decode=self.num_compactions > 0, fixed=True, balance=self.balance)

    def _after_compaction(self, keep: torch.Tensor, start: torch.Tensor | None) -> None:
        super()._after_compaction(keep, start)
        self._mark()

    def _reserve(self, like: list[torch.Tensor], needed: int) -> None:
        super()._reserve(like, needed)
        self._mark()

    def append(self, *args, **kwargs):  # type: ignore[override]
        raise TypeError("StaticKV is written with plan_write() + write(); append() belongs to the growing PagedKV.")

    @normal_tensors
    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder rows in place (beam search keeps the arena's address); a new row count reallocates."""
        if self.planes is None:
            return
        index = index.to(self.keys.device)
        if self.planes is self._arena and index.numel() == self.keys.shape[0]:
            for plane in self._arena if self.balance is None else [*self._arena, self.balance]:
                plane.copy_(plane.index_select(0, index))
            if self.positions is not None:
                self.positions = self.positions.index_select(0, index)
            return
        super().select_batch(index)
        self._adopt_as_arena()

    def repeat_batch(self, repeats: int) -> None:
        super().repeat_batch(repeats)
        self._adopt_as_arena()

    def _give_back_arena(self) -> None:
        if self._arena is not None and self._lease is not None:
            for plane in self._arena:
                self._lease.give_back(plane)

    def clear(self) -> None:
        if self._lease is not None:
            self._lease.give_back(self.balance)
        self._give_back_arena()
        super().clear()
        self._arena = self.write_index = None

    def _adopt_as_arena(self) -> None:
        """A new row count: what ``select_batch`` built becomes the fixed arena (when it has the fixed size)."""
        self._arena = None
        if self.planes is not None and self.capacity == self.static_capacity:
            self._arena = self.planes
            mark_static(*self._arena)
        self._mark()

    @normal_tensors
    def _shrink_to_hint(self) -> None:
        """After a compaction: leave a temporary arena for the fixed one once the survivors fit in it."""
        if self._arena is None or self.planes is self._arena or self.length > self.static_capacity:
            return
        self._move_live_to(self._arena)
        self._mark()
