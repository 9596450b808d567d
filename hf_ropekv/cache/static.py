"""The static (compileable) forward driver: every decision of a forward is taken before it runs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _compat
from ..storage.buffers import BufferLease
from .forward import ForwardCoordinator
from .options import PAGE_SIZE
from .window import StaticWindowLayer


class StaticForwardDriver:
    """Prepares each forward of a static cache before it runs, so a compiled decode step reads no host counter.

    It runs the growing cache's prologue (``ForwardCoordinator.prologue``: the same plan, the compaction eagerly
    between two compiled steps), makes room in the arenas, tells each layer where its tokens go and how many slots
    attention reads, advances the sliding-window layers, and fills the clock: per device, two scalars a compiled
    step captured by address (the first new token's slot, the tokens seen before it).
    """

    def __init__(self, coordinator: ForwardCoordinator, lease: BufferLease, layers: list) -> None:
        self.coordinator = coordinator
        self.window_layers = [layer for layer in layers if isinstance(layer, StaticWindowLayer)]
        self.layer_count = len(layers)  # all layers of the model (transformers' shape helper counts them)
        self.lease = lease
        self.clock: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.query_offset = 0  # slots in front of the running forward's first new token
        #: Tokens per row the running generate() call holds at most, when it said so: the arenas are sized for it.
        self.expected_tokens: int | None = None
        #: Tokens seen before the forward now prepared or running (None between forwards): ``get_seq_length`` while
        #: it runs, since the model derives the new tokens' positions from it and ``prepare`` counted them already.
        self.seen_before: int | None = None

    def reset(self) -> None:
        self.query_offset = 0
        self.seen_before = None

    def prepare(self, attention_mask: torch.Tensor | None, new: int, batch: int, device: torch.device,
                model: nn.Module | None, online: Any) -> torch.Tensor:
        """Take every decision of a forward of ``new`` tokens; return its 2-D mask: ``[B, kv_length]`` (each row's
        live slots, right-aligned after its holes), then the sliding-window layers' part."""
        coordinator, rows, layers = self.coordinator, self.coordinator.rows, self.coordinator.full_layers
        rows.check_batch(batch)
        if attention_mask is not None:
            rows.observe_mask(attention_mask, new)
        elif rows.pads is None or rows.pads.shape[0] != batch:
            rows.assume_no_padding(batch, device)
        if not layers:  # sliding-window layers only: the clock and the windows, nothing to plan or compact
            seen = self.seen_before = self.window_layers[0].get_seq_length()
            if not self.window_layers[0].is_initialized:
                self._initialize_layers(model, batch, 0)
            self.query_offset = seen
            self._write_indices(seen, new, seen, device, online)
            mask = self._prepare_windows(attention_mask, seen, new, batch, device, 0)
            return mask if attention_mask is None else mask.to(attention_mask.dtype)
        first, seen = layers[0], layers[0].tokens_seen
        self.seen_before = seen
        plan = coordinator.prologue(seen, new)
        needed = plan.slots_after + new
        for layer in layers:
            if self.expected_tokens is not None:
                layer.storage.fit(self.expected_tokens)
            layer.storage.reserve(needed)
        self.expected_tokens = None
        # What attention reads: the fixed arena, or a temporary one in whole pages for a forward longer than it.
        kv_length = first.storage.capacity or max(first.storage.static_capacity, -(-needed // PAGE_SIZE) * PAGE_SIZE)
        if not first.is_initialized:
            self._initialize_layers(model, batch, kv_length)
        self.query_offset = plan.slots_after
        indices = self._write_indices(plan.slots_after, new, seen, device, online)
        for layer in layers:
            keys = layer.storage.keys
            layer.prepare_forward(plan.slots_after, new, seen, kv_length,
                                  indices.get(keys.device) if keys is not None else None)
        slot = torch.arange(kv_length, device=device)[None, :]
        holes = rows.on_device(plan.holes_after, device)[:, None]
        mask = (slot >= holes) & (slot < plan.slots_after + new)
        if self.window_layers:
            mask = torch.cat([mask, self._prepare_windows(attention_mask, seen, new, batch, device, kv_length)], dim=1)
        return mask if attention_mask is None else mask.to(attention_mask.dtype)

    def _prepare_windows(self, attention_mask: torch.Tensor | None, seen: int, new: int, batch: int,
                         device: torch.device, mask_offset: int) -> torch.Tensor:
        """Advance the sliding-window layers by ``new`` tokens; return their part of the mask, ``[B, window - 1 +
        new]`` bool: column ``j`` is token ``seen - (window - 1) + j``, live where that token exists and generate's
        mask (``[B, seen + new]``; None: no padding) keeps it, as a ``DynamicCache``'s sliding layer reads it."""
        for layer in self.window_layers:
            layer.prepare_forward(seen, new, mask_offset)
        window = self.window_layers[0].window  # one window for every sliding layer (check_static)
        index = torch.arange(seen - (window - 1), seen + new, device=device)
        exists = index >= 0
        if attention_mask is None:
            return exists[None, :].expand(batch, -1)
        return attention_mask.to(device)[:, index.clamp_min(0)].bool() & exists[None, :]

    def _initialize_layers(self, model: nn.Module | None, batch: int, kv_length: int) -> None:
        """Allocate every layer's arena before the first forward, as generate does for a StaticCache: allocated
        inside a CUDA graph, an arena would live in the graph's pool and be overwritten by the next replay. Left to
        the first forward where transformers cannot tell the shapes (layers on several devices)."""
        shape = None if model is None else _compat.static_init_shape(model, self.layer_count)
        if shape is None:
            return
        heads, head_dims = shape
        embeddings = model.get_input_embeddings()
        dtype = embeddings.weight.dtype if embeddings is not None else model.dtype  # what the keys are computed in

        def like(layer_idx: int) -> torch.Tensor:
            return torch.empty(batch, heads[layer_idx], 0, head_dims[layer_idx], dtype=dtype, device=model.device)

        for layer in self.coordinator.full_layers:
            layer.initialize(like(layer.layer_idx), like(layer.layer_idx), kv_length)
        for window in self.window_layers:
            if not window.is_initialized:
                window.lazy_initialization(like(window.layer_idx), like(window.layer_idx))

    def _write_indices(self, slots: int, new: int, seen: int, input_device: torch.device,
                       online: Any) -> dict[torch.device, torch.Tensor]:
        """Where this forward's tokens go, per device, and the clock (refilled, never replaced). A decode step
        writes at the clock's first slot; a multi-token forward gets a fresh ``arange``."""
        layers = self.coordinator.full_layers
        devices = {layer.storage.keys.device for layer in layers if layer.storage.keys is not None}
        for device in devices | {input_device}:
            if device not in self.clock:
                self.clock[device] = tuple(
                    self.lease.take(("clock", i, device), shape, torch.int64,
                                    lambda shape=shape: torch.zeros(shape, dtype=torch.int64, device=device))
                    for i, shape in enumerate(((1,), ())))
            first_slot, seen_before = self.clock[device]
            first_slot.fill_(slots)
            seen_before.fill_(seen)
        if new == 1 and seen > 0 and online is not None and not online.on_buffers:
            # Decoding starts: move the sums a compiled step updates to leased buffers. Not at a one-token prompt
            # (seen == 0): no layer's sums exist yet.
            online.move_to_buffers(self.lease.take)
        if new > 1:
            return {device: torch.arange(slots, slots + new, device=device) for device in devices}
        return {device: self.clock[device][0] for device in devices}

    def clock_on_first_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first new slot, tokens seen before)`` as device scalars, for a compiled step."""
        return next(iter(self.clock.values()))
