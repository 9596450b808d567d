"""Cache layers, one small class per storage behaviour (as transformers' ``cache_utils``): full-attention layers get
a :class:`BudgetedLayer` (paged, compacted in place) or, in a static cache, a :class:`StaticBudgetedLayer` (a fixed
arena); sliding-window layers, already bounded, stay transformers' ``DynamicSlidingWindowLayer`` or become a
:class:`~hf_ropekv.cache.window.StaticWindowLayer`."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from .. import _compat
from ..model.geometry import FULL, ModelGeometry
from ..model.layouts import pair_partner
from ..storage.buffers import step_is_recorded
from ..storage.paged import PagedKV
from ..storage.static import StaticKV
from .options import PAGE_SIZE, CacheOptions
from .window import StaticWindowLayer

#: How to get a croppable cache: the end of every "cannot crop" error.
CROPPABLE_FIX = ("Assisted/speculative decoding (assistant_model=, prompt_lookup_num_tokens=) and DoLa need a "
                 "croppable cache; use a plain DynamicCache for them, or a budget larger than the whole generation.")
#: The error of a rollback after an eviction.
CANNOT_CROP = (
    "RopeKVCache cannot crop: tokens were already evicted, so the cache cannot be rolled back. " + CROPPABLE_FIX)


class BudgetedLayer(CacheLayerMixin):
    """A full-attention layer whose kept tokens stay within the cache's budget; it only stores.

    It reports the tokens seen as its sequence length and, to the mask, the geometry of a sliding-window layer
    (``kv_length = kept + q``, ``kv_offset = seen - kept``): kept slots line up with the rightmost columns of
    generate's 2-D attention mask. Of its cache it asks only the ``coordinator`` (``cache.forward``): the plan of
    the forward and the compaction before it writes.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: Any, layer_idx: int, storage: PagedKV) -> None:
        super().__init__()
        # A proxy: a reference would make a cycle, and the arenas (and model hooks) would wait for the cyclic
        # garbage collector instead of going when the cache does.
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.storage = storage
        self.tokens_seen = 0

    def __repr__(self) -> str:
        return f"BudgetedLayer(seen={self.tokens_seen}, kept={self.storage.length})"

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return self.tokens_seen == self.storage.length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # Compaction happens here, before writing: no tensor this forward returned still aliases the arena.
        self._cache.coordinator.before_update(self, key_states, kwargs)
        if self.storage.needs_balance:
            self.storage.balance_keys(key_states, self._cache.coordinator.rows.pads)
        self.keys, self.values = self.storage.append(key_states, value_states, first_position=self.tokens_seen)
        self.tokens_seen += key_states.shape[-2]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = self._cache.coordinator.plan_for(query_length).slots_after  # once this forward's compaction is done
        return kept + query_length, self.tokens_seen - kept

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.storage.clear()
        self.keys = self.values = None
        self.tokens_seen = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.storage.select_batch(beam_idx)

    batch_select_indices = reorder_cache

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.storage.repeat_batch(repeats)

    def crop(self, n: int) -> None:
        """Drop tokens from the end as transformers' ``crop(n)`` does (``_compat.crop_target``); only while nothing
        was evicted."""
        target = _compat.crop_target(self.tokens_seen, n)
        if target == self.tokens_seen:
            return  # nothing to undo, which an evicted layer can honour too (generate calls crop(0) often)
        if not self.is_croppable:
            raise ValueError(CANNOT_CROP)
        self.storage.truncate(target)
        self.tokens_seen = target


class StaticBudgetedLayer(BudgetedLayer):
    """A budgeted layer over a fixed arena (:class:`~hf_ropekv.storage.static.StaticKV`): compileable.

    Attention reads the whole arena (``get_mask_sizes`` reports ``(kv_length, 0)``) and the cache hands the model a
    slot-validity mask. Every decision is taken before the forward (``prepare_forward``), so ``update`` only writes:
    a compiled decode step reads no host counter and is the same graph at every step.
    """

    is_compileable = True

    def __init__(self, cache: Any, layer_idx: int, storage: StaticKV) -> None:
        super().__init__(cache, layer_idx, storage)
        self.kv_length = storage.static_capacity  # slots attention reads in the coming forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        # Refuse, eagerly, a forward the cache's model did not announce. A compiled or graphed step skips the check
        # (is_compiling() folds to a constant, adding no guard): the model's pre-hook announced it.
        if not step_is_recorded() and self._cache.coordinator.full_layers[0] is self:
            self._cache.coordinator.check_announced()
        if not self.is_initialized:  # the cache could not allocate before the forward: the arena's shape is known now
            self.initialize(key_states, value_states, self.kv_length)
        if self.storage.needs_balance:  # the first forward, eager
            self.storage.balance_keys(key_states, self._cache.coordinator.rows.pads)
        self.keys, self.values = self.storage.write(key_states, value_states)
        return self.keys, self.values

    def prepare_forward(self, first_slot: int, new: int, seen: int, kv_length: int,
                        write_index: torch.Tensor | None) -> None:
        """Before a forward: its ``new`` tokens go to ``write_index`` (slots from ``first_slot``; None: decided at
        the first write) and attention reads ``kv_length`` slots."""
        self.storage.plan_write(first_slot, new, seen, write_index)
        self.kv_length = kv_length
        self.tokens_seen = seen + new

    def initialize(self, key_like: torch.Tensor, value_like: torch.Tensor, kv_length: int) -> None:
        """Allocate the arena for keys and values shaped like these (only batch, heads, head dim, dtype and device
        count), with room for the coming forward's ``kv_length`` slots."""
        self.kv_length = kv_length
        self.lazy_initialization(key_like, value_like)
        self.storage.allocate(key_like, value_like, kv_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv_length, 0


def make_layers(cache: Any, geometry: ModelGeometry, options: CacheOptions, lease: Any,
                static: bool) -> list[CacheLayerMixin]:
    """One layer per model layer; ``lease``: a static cache's buffers; ``static``: whether the layers are static
    (``options.static`` may be ``"auto"``)."""
    hint, bits = options.steady_slots, options.kv_bits
    partner = None  # the balance of int8 keys ties the two channels of each rotary pair
    if bits is not None and geometry.rotary_layout is not None:
        partner = pair_partner(geometry.rotary_layout, geometry.rotary_dim // 2, geometry.head_dim)
    layers: list[CacheLayerMixin] = []
    for idx, (kind, sliding_window) in enumerate(zip(geometry.layer_types, geometry.sliding_windows)):
        if kind == FULL and static:
            layers.append(StaticBudgetedLayer(cache, idx, StaticKV(hint, PAGE_SIZE, idx, lease, bits, partner)))
        elif kind == FULL:
            layers.append(BudgetedLayer(cache, idx, PagedKV(PAGE_SIZE, hint, bits, partner)))
        elif static:
            layers.append(StaticWindowLayer(sliding_window, idx, lease))
        else:
            layers.append(DynamicSlidingWindowLayer(sliding_window=sliding_window))
    return layers
