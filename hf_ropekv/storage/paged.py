"""Paged key/value storage of one attention layer, compacted in place.

A layer's slots live in *planes* ``[batch, kv_heads, capacity, *]``: keys and values, or with ``kv_bits=8`` their
int8 codes plus a float32 scale per token and head (keys divided first by their channel balance, fixed at the
layer's first write: ``kernels.quantize.channel_balance``). Live slots are the prefix ``[0, length)`` of every
(row, head): attention reads a view (no copy), and compaction moves survivors forward in place
(``kernels.compact``). Capacity grows in whole pages up to the steady state (``budget + compress_every``);
``static.py`` has the fixed arena.
"""

from __future__ import annotations

import torch

from ..kernels.compact import compact_
from ..kernels.quantize import channel_balance, dequantize_kv, quantize_kv
from .buffers import normal_tensors

# Attributes of the keys a layer hands the model's attention (read by ``hf_ropekv.model.attention``): the int8
# codes' float32 [B, H, S] scales and the keys' [B, H, 1, D] channel balance ``(key_scale, value_scale, balance)``;
# whether to attend with the decode kernel (once the layer compacted: before, sdpa keeps DynamicCache's tokens);
# whether they are a static cache's fixed arena.
SCALES, DECODE, FIXED = "_hf_ropekv_scales", "_hf_ropekv_decode", "_hf_ropekv_fixed"


class PagedKV:
    """Keys, values (int8 codes and scales with ``bits=8``; ``None``: the model's dtype) and slot positions of one
    layer, in pages of ``page_size`` slots up to ``capacity_hint`` (the steady state, ``budget + compress_every``).
    ``pair_partner [D]``: the other channel of each key channel's rotary pair (None: unknown), for the balance."""

    def __init__(self, page_size: int, capacity_hint: int | None = None, bits: int | None = None,
                 pair_partner: torch.Tensor | None = None) -> None:
        self.page_size = page_size
        self.capacity_hint = capacity_hint
        self.bits = bits
        self.pair_partner = pair_partner
        self.balance: torch.Tensor | None = None  # float32 [B, H, 1, D] with bits=8, from the first write on
        self.planes: list[torch.Tensor] | None = None  # keys, values[, key scales, value scales] [B, H, C, *]
        self.dtype: torch.dtype | None = None  # what keys and values come in (and are dequantized to)
        # int64 [B, H, capacity]: the token index of each slot, made when first read (scoring, compaction).
        self.positions: torch.Tensor | None = None
        self.length = 0
        # Written lazily: slots from `_positions_valid` on hold tokens `_pending_position`, `_pending_position + 1`...
        self._positions_valid = self._pending_position = 0
        self.num_compactions = 0
        self._step_views = _StepViews()

    # -- introspection -------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.planes is None else self.planes[0]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.planes is None else self.planes[1]

    @property
    def capacity(self) -> int:
        return 0 if self.planes is None else self.planes[0].shape[2]

    @property
    def pages_allocated(self) -> int:
        return -(-self.capacity // self.page_size)  # the last page may be cut to the steady-state bound

    @property
    def pages_in_use(self) -> int:
        return -(-self.length // self.page_size)

    @property
    def needs_balance(self) -> bool:
        """Whether the next write is the first of an int8 layer: :meth:`balance_keys` must see its keys first."""
        return self.bits is not None and self.balance is None

    @property
    def bytes_held(self) -> int:
        tensors = [*(self.planes or ()), self.positions, self.balance]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # -- writes --------------------------------------------------------------------------------
    @normal_tensors
    def balance_keys(self, key_states: torch.Tensor, real_from: torch.Tensor | None) -> None:
        """Fix the keys' channel balance from the layer's first keys (``real_from [B]``: each row's first real token
        among them), before they are written."""
        partner = self.pair_partner
        if partner is not None and partner.numel() != key_states.shape[-1]:
            partner = None
        self.balance = channel_balance(key_states, real_from, partner)

    def encode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[torch.Tensor]:
        """New tokens as planes: keys and values, or their int8 codes and ``[B, H, q, 1]`` scales."""
        if self.bits is None:
            return [key_states, value_states]
        key_codes, key_scale = quantize_kv(key_states, balance=self.balance)
        value_codes, value_scale = quantize_kv(value_states)
        return [key_codes, value_codes, key_scale.unsqueeze(-1), value_scale.unsqueeze(-1)]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor,
               first_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``q`` new tokens after the live slots; return views of all live slots (keys, values)."""
        q = key_states.shape[2]
        end = self.length + q
        self.dtype = key_states.dtype
        new = self.encode(key_states, value_states)
        if self.planes is None or end > self.capacity:
            self._reserve(new, end)
        views = self._step_views.get(self) if q == 1 else None
        if views is not None:
            for write, plane in zip(views[0], new):
                write.copy_(plane)  # what `plane[:, :, length:end] = new` does, minus the slicing
            live = views[1]
        else:
            for plane, part in zip(self.planes, new):
                plane[:, :, self.length : end] = part
            live = [plane[:, :, :end] for plane in self.planes]
        self.advance(q, first_position)
        return attention_view(live, decode=self.num_compactions > 0, balance=self.balance)

    def advance(self, new: int, first_position: int) -> None:
        """Count ``new`` tokens (positions ``first_position, ...``) as written after the live slots (host only)."""
        if self._positions_valid == self.length:
            self._pending_position = first_position
        self.length += new

    def _after_compaction(self, keep: torch.Tensor, start: torch.Tensor | None) -> None:
        kept = keep.shape[-1]
        moved = self.positions.gather(2, keep.clamp_min(0))  # 8 bytes a slot: a gather is cheap enough
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

    @normal_tensors
    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select batch rows (beam search, contrastive search)."""
        if self.planes is not None:
            index = index.to(self.keys.device)
            self.planes = [plane.index_select(0, index) for plane in self.planes]
            if self.positions is not None:
                self.positions = self.positions.index_select(0, index)
            if self.balance is not None:
                self.balance = self.balance.index_select(0, index)

    @normal_tensors
    def repeat_batch(self, repeats: int) -> None:
        if self.planes is not None:
            self.planes = [plane.repeat_interleave(repeats, dim=0) for plane in self.planes]
            if self.positions is not None:
                self.positions = self.positions.repeat_interleave(repeats, dim=0)
            if self.balance is not None:
                self.balance = self.balance.repeat_interleave(repeats, dim=0)

    def clear(self) -> None:
        self.planes = self.positions = self.balance = None
        self.length = self._positions_valid = self._pending_position = self.num_compactions = 0
        self._step_views = _StepViews()

    # -- views ---------------------------------------------------------------------------------
    def live_keys(self) -> torch.Tensor:
        """The live keys ``[B, H, length, D]`` in the model's dtype (dequantized, a copy, with ``bits=8``)."""
        if self.bits is None:
            return self.keys[:, :, : self.length]
        return dequantize_kv(self.keys[:, :, : self.length], self.planes[2][:, :, : self.length, 0], self.dtype,
                             self.balance)

    def live_positions(self) -> torch.Tensor:
        """int64 ``[B, H, length]``: the token index (padding included) held by each live slot."""
        self._write_positions()
        return self.positions[:, :, : self.length]

    @normal_tensors
    def _write_positions(self) -> None:
        if self.positions is None:
            self.positions = torch.empty(self.keys.shape[:3], dtype=torch.int64, device=self.keys.device)
        start, end = self._positions_valid, self.length
        if end > start:
            first = self._pending_position
            self.positions[:, :, start:end] = torch.arange(first, first + end - start, device=self.positions.device)
            self._positions_valid = end

    # -- allocation ----------------------------------------------------------------------------
    @normal_tensors
    def _shrink_to_hint(self) -> None:
        """Give back what a long, unpinned prefill made the arena grow to, once it fits the steady state."""
        steady = self.capacity_hint
        if steady is not None and self.capacity > steady and self.length <= steady:
            self._move_live_to(_empty_planes(self.planes, steady))

    @normal_tensors
    def _reserve(self, like: list[torch.Tensor], needed: int) -> None:
        """Room for ``needed`` slots, planes shaped like ``like``: whole pages, never past the steady-state bound
        unless one forward needs more."""
        if self.planes is not None and needed <= self.capacity:
            return
        capacity = -(-needed // self.page_size) * self.page_size
        if self.capacity_hint is not None and needed <= self.capacity_hint:
            capacity = min(capacity, self.capacity_hint)
        self._move_live_to(_empty_planes(like, capacity))

    def _move_live_to(self, planes: list[torch.Tensor]) -> None:
        """Make ``planes`` the storage: the live slots copied into them, the slot positions resized to match."""
        if self.planes is not None and self.length:
            for new, old in zip(planes, self.planes):
                new[:, :, : self.length] = old[:, :, : self.length]
        if self.positions is not None:
            positions = torch.empty(planes[0].shape[:3], dtype=torch.int64, device=planes[0].device)
            positions[:, :, : self.length] = self.positions[:, :, : self.length]
            self.positions = positions
        self.planes = planes


def _empty_planes(like: list[torch.Tensor], capacity: int) -> list[torch.Tensor]:
    """Uninitialised planes shaped like ``like`` with ``capacity`` slots."""
    return [torch.empty(*p.shape[:2], capacity, p.shape[3], dtype=p.dtype, device=p.device) for p in like]


def attention_view(planes: list[torch.Tensor], decode: bool, fixed: bool = False,
                   balance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(keys, values)`` a layer hands the model's attention, marked for ``hf_ropekv.model.attention`` (with int8
    planes: the codes, carrying their scales and the keys' channel balance)."""
    keys, values = planes[0], planes[1]
    setattr(keys, DECODE, decode)
    setattr(keys, FIXED, fixed)
    if len(planes) > 2:
        setattr(keys, SCALES, (planes[2][..., 0], planes[3][..., 0], balance))
    return keys, values


class _StepViews:
    """Views of one arena for single-token appends, made once per live length (a compaction cycle goes through the
    same lengths every cycle) and reused under ``no_grad``; they belong to the planes they were cut from."""

    LIMIT = 512  #: lengths remembered per arena: a whole compaction cycle for ``compress_every`` up to this

    __slots__ = ("planes", "by_length")

    def __init__(self) -> None:
        self.planes: list[torch.Tensor] | None = None
        self.by_length: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def __deepcopy__(self, memo: dict) -> "_StepViews":
        return _StepViews()

    def get(self, arena: PagedKV) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """``(slot views to write, live views)`` for appending one token to ``arena``, or None."""
        if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return None
        if self.planes is not arena.planes:
            self.planes, self.by_length = arena.planes, {}
        length = arena.length
        views = self.by_length.get(length)
        if views is None and len(self.by_length) < self.LIMIT:
            end = length + 1
            views = ([p[:, :, length:end] for p in arena.planes], [p[:, :, :end] for p in arena.planes])
            self.by_length[length] = views
        return views


def compact_arenas(arenas: list[PagedKV], keep: torch.Tensor, start: torch.Tensor | None = None) -> None:
    """Compact arenas in place: each keeps slots ``keep[b, :, start[b]:]`` (ascending), moved in order to
    ``[start[b], K)``; slots before ``start[b]`` become holes (position -1)."""
    for arena in arenas:
        keep_here = keep.to(arena.keys.device)
        start_here = None if start is None else start.to(keep_here.device)
        arena._write_positions()
        compact_(arena.planes, keep_here, start_here)
        arena._after_compaction(keep_here, start_here)
