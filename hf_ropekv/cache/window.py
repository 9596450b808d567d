"""A static cache's sliding-window layers: transformers' own ``StaticSlidingWindowLayer``, prepared before the forward.

transformers' layer branches in ``update`` on a Python counter of the tokens seen, which a compiled step guards on
(recompiling until the window is full). :class:`StaticWindowLayer` keeps its storage (``[batch, kv_heads, window,
head_dim]`` at a static address) but lays the window out right-aligned: slot ``j`` holds token ``seen - window + j``
(zero and masked before the first token). Every decoding step then rolls left by one and writes the last slot,
and the counter is advanced before the forward by the static driver: one graph.

Mask: a forward of ``q`` tokens attends over ``window - 1 + q`` slots of this layer. The static cache's 2-D mask
holds the full-attention layers' slot mask (``kv_length`` columns) and then this part; the layer reports
``(window - 1 + q, kv_length)`` as its mask sizes and ``kv_length + window - 1`` as its query offset, so
transformers' sliding-window mask reads exactly its own part.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticSlidingWindowLayer

from .. import _compat
from ..storage.buffers import WINDOW_KEYS, WINDOW_VALUES, BufferLease, mark_static, normal_tensors, static_buffer
from ..storage.paged import attention_view

#: The error of a rollback that reaches past the window (tokens already rolled out of it).
CANNOT_CROP_WINDOW = (
    "RopeKVCache cannot crop a static sliding-window layer that has rolled tokens out of its window: they are gone. "
    "Use a plain DynamicCache for assisted/speculative decoding and DoLa on this model.")


class StaticWindowLayer(StaticSlidingWindowLayer):
    """A sliding-window layer of a static cache: ``sliding_window`` tokens a query attends to (itself included),
    ``layer_idx`` names its buffers in ``lease`` (the static cache's buffers; None: its own). Compileable and
    sliding, as transformers' layer; ``get_seq_length`` is its ``cumulative_length_int``, which the driver advances."""

    def __init__(self, sliding_window: int, layer_idx: int, lease: BufferLease | None = None) -> None:
        _compat.init_static_sliding_layer(self, sliding_window)
        self.window = sliding_window
        self.layer_idx = layer_idx
        self._lease = lease
        self.mask_offset = 0  # columns of the forward's 2-D mask in front of this layer's part (prepare_forward)

    def __repr__(self) -> str:
        return f"StaticWindowLayer(window={self.window}, seen={self.cumulative_length_int})"

    @normal_tensors
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the window for these keys' batch, heads, dtype and device (zeroed: a masked slot still multiplies
        its zero weight, so it must be finite), from the lease when it has one."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys, self.values = (
            static_buffer(self._lease, (purpose, self.layer_idx, self.device),
                          (self.batch_size, self.num_heads, self.window, like.shape[-1]), like.dtype, self.device)
            for purpose, like in ((WINDOW_KEYS, key_states), (WINDOW_VALUES, value_states)))
        attention_view([self.keys, self.values], decode=False, fixed=True)  # a static window: grouped sdpa, no copy
        self.cumulative_length = torch.tensor(self.cumulative_length_int, dtype=torch.int64, device=self.device)
        # The last slot as a tensor index made once: made in the step, it is a host-to-device copy a CUDA graph
        # cannot capture.
        self._last_slot = torch.tensor([-1], dtype=torch.int64, device=self.device)
        self.is_initialized = True

    def prepare_forward(self, seen: int, new: int, mask_offset: int) -> None:
        """Before a forward of ``new`` tokens: count them; this layer's part of the mask starts at ``mask_offset``."""
        self.cumulative_length_int = seen + new
        self.mask_offset = mask_offset
        if self.is_initialized:
            self.cumulative_length.fill_(seen + new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens as the window's last slots; return what this forward attends over: the window for one
        token, the last ``window - 1`` kept tokens and the new ones for several. Reads no counter."""
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

    def get_max_length(self) -> int:
        return -1  # the sequence is not bounded (the window is: it rolls)

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Whether no token has rolled out of the window yet."""
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

    def reorder_cache(self, index: torch.Tensor) -> None:
        """Select rows in place (the window keeps its address); another row count reallocates."""
        if not self.is_initialized:
            return
        index = index.to(self.keys.device)
        if index.numel() == self.keys.shape[0]:
            for tensor in (self.keys, self.values):
                tensor.copy_(tensor.index_select(0, index))
            return
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.batch_size = self.keys.shape[0]
        mark_static(self.keys, self.values)
        attention_view([self.keys, self.values], decode=False, fixed=True)

    batch_select_indices = reorder_cache

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.reorder_cache(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def reset(self) -> None:
        """Forget every token; the window's buffers go back to the lease (the next cache of the model takes them)."""
        if self.is_initialized and self._lease is not None:
            self._lease.give_back(self.keys)
            self._lease.give_back(self.values)
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length_int = 0
        self.mask_offset = 0
