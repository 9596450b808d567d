"""A static cache's sliding-window layers: transformers' own ``StaticSlidingWindowLayer``, prepared before the forward.

transformers' ``StaticSlidingWindowLayer`` branches, inside ``update``, on a Python counter of the tokens it has
seen (filling the window, becoming full, full): compiled, each value of that counter is a guard, and the decode
step is recompiled until the window is full. :class:`StaticWindowLayer` keeps its storage (``keys``/``values`` of
``[batch, kv_heads, window, head_dim]`` at a static address) but lays the window out *right-aligned*: slot ``j``
holds token ``seen - window + j`` (a slot before the first token is zero and masked). Then every decoding step
does the same thing, filling or full: roll left by one and write the new token in the last slot. The counter is
advanced by the static driver before the forward (:meth:`prepare_forward`), like the budgeted layers' counters,
so a compiled step reads no host value that changes from step to step: one graph.

Mask. A forward of ``q`` tokens attends over ``window - 1 + q`` slots of this layer (the last ``window - 1`` kept
tokens and the new ones). The 2-D mask the static cache hands the model is made of two parts: first the
budgeted full-attention layers' slot mask (``kv_length`` columns, what they report), then this layer's window
(``hf_ropekv.cache.masks.window_mask_part``). A window layer reports ``(window - 1 + q, kv_length)`` as its
mask sizes and ``kv_length + window - 1`` as its query offset, so transformers' sliding-window mask (causal,
``kv > q - window``, padding from the 2-D mask) reads exactly its own part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import StaticSlidingWindowLayer

from .. import _compat
from ..storage.buffers import WINDOW_KEYS, WINDOW_VALUES, mark_static, normal_tensors, static_buffer

if TYPE_CHECKING:
    from ..storage.buffers import BufferLease

#: The error of a rollback that reaches past the window (tokens already rolled out of it).
CANNOT_CROP_WINDOW = (
    "RopeKVCache cannot crop a static sliding-window layer that has rolled tokens out of its window: they are gone. "
    "Use a plain DynamicCache for assisted/speculative decoding and DoLa on this model."
)


class StaticWindowLayer(StaticSlidingWindowLayer):
    """A sliding-window layer of a static :class:`~hf_ropekv.RopeKVCache`: compileable, one decode graph.

    Args:
        sliding_window: the layer's window (tokens a query attends to, itself included).
        layer_idx: the model layer it caches (names its leased buffers).
        lease: the static cache's buffers (``hf_ropekv.storage.buffers``); None: buffers of its own.
    """

    is_compileable = True
    is_sliding = True

    def __init__(self, sliding_window: int, layer_idx: int, lease: "BufferLease | None" = None) -> None:
        _compat.init_static_sliding_layer(self, sliding_window)
        self.window = sliding_window
        self.layer_idx = layer_idx
        self._lease = lease
        self.mask_offset = 0  # columns of the forward's 2-D mask in front of this layer's part (prepare_forward)

    def __repr__(self) -> str:
        return f"StaticWindowLayer(window={self.window}, seen={self.cumulative_length_int})"

    # ------------------------------------------------------------------ storage
    @normal_tensors
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the window for these keys' batch, heads, dtype and device (zeroed: a masked slot still multiplies
        its zero weight, so it must be finite), from the lease when it has one."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.window)
        self.keys = self._buffer(WINDOW_KEYS, (*shape, self.k_head_dim), key_states.dtype)
        self.values = self._buffer(WINDOW_VALUES, (*shape, self.v_head_dim), value_states.dtype)
        self.cumulative_length = torch.tensor(self.cumulative_length_int, dtype=torch.int64, device=self.device)
        # The last slot as a tensor index, made once: made in the step, it is a host-to-device copy each step,
        # which a CUDA graph of the eager step (benchmarks/graphed_step_probe.py) cannot capture.
        self._last_slot = torch.tensor([-1], dtype=torch.int64, device=self.device)
        self.is_initialized = True

    def _buffer(self, purpose: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return static_buffer(self._lease, (purpose, self.layer_idx, self.device), shape, dtype, self.device)

    def initialize(self, key_like: torch.Tensor, value_like: torch.Tensor) -> None:
        """Allocate before the first forward (the static driver), from tensors shaped like the keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)

    # ------------------------------------------------------------------ the forward
    def prepare_forward(self, seen: int, new: int, mask_offset: int) -> None:
        """Before a forward of ``new`` tokens (the static driver): count them, and note where this layer's part of
        the forward's 2-D mask starts (after the full-attention layers' ``mask_offset`` columns)."""
        self.cumulative_length_int = seen + new
        self.mask_offset = mask_offset
        if self.is_initialized:
            self.cumulative_length.fill_(seen + new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens as the window's last slots; return what this forward attends over: the window itself
        for one token, the last ``window - 1`` kept tokens and the new ones for several. Reads no counter."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1:
            # As transformers' own layer does for a full window: roll, write the last slot through a tensor index
            # (pytorch#159855), copy back in place (the static address a CUDA graph replays at).
            index = self._last_slot
            keys, values = self.keys.roll(-1, dims=-2), self.values.roll(-1, dims=-2)
            keys[:, :, index] = key_states
            values[:, :, index] = value_states
            self.keys.copy_(keys)
            self.values.copy_(values)
            return self.keys, self.values
        keys = torch.cat((self.keys[:, :, 1:], key_states), dim=-2)
        values = torch.cat((self.values[:, :, 1:], value_states), dim=-2)
        self.keys.copy_(keys[:, :, -self.window :])
        self.values.copy_(values[:, :, -self.window :])
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window - 1 + query_length, self.mask_offset

    def query_offset(self) -> int:
        """The first new token's column in the forward's 2-D mask (see the module docstring)."""
        return self.mask_offset + self.window - 1

    def get_seq_length(self) -> int:
        return self.cumulative_length_int

    def get_max_length(self) -> int:
        return -1  # the sequence is not bounded (the window is: it rolls)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Whether no token has rolled out of the window yet (a rollback can then be honoured)."""
        return self.cumulative_length_int <= self.window

    def crop(self, n: int) -> None:
        """Roll back as transformers' ``crop(n)`` does (``_compat.crop_target``), while nothing left the window."""
        seen = self.cumulative_length_int
        target = _compat.crop_target(seen, n)
        removed = seen - target
        if removed == 0:
            return
        if not self.is_croppable:
            raise ValueError(CANNOT_CROP_WINDOW)
        if self.is_initialized:
            for tensor in (self.keys, self.values):
                tensor.copy_(tensor.roll(removed, dims=-2))
                tensor[:, :, :removed].zero_()
            self.cumulative_length.fill_(target)
        self.cumulative_length_int = target

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder rows in place (the window keeps its address); another row count reallocates."""
        if self.is_initialized:
            self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def _select(self, index: torch.Tensor) -> None:
        index = index.to(self.keys.device)
        if index.numel() == self.keys.shape[0]:
            for tensor in (self.keys, self.values):
                tensor.copy_(tensor.index_select(0, index))
            return
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.batch_size = self.keys.shape[0]
        mark_static(self.keys, self.values)

    def reset(self) -> None:
        """Forget every token; the window's buffers go back to the lease (the next cache of the model takes them)."""
        if self.is_initialized and self._lease is not None:
            self._lease.give_back(self.keys)
            self._lease.give_back(self.values)
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length_int = 0
        self.mask_offset = 0
