"""Cache layers: one small class per storage behaviour (see transformers' ``cache_utils`` layers).

Full-attention layers get a :class:`BudgetedLayer` (paged, compacted in place); sliding-window layers are
already bounded and stay transformers' own ``DynamicSlidingWindowLayer``, or, in a static cache, its
``StaticSlidingWindowLayer`` (:class:`~hf_ropekv.cache.window.StaticWindowLayer`).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from .. import _compat
from ..model.geometry import FULL, ModelGeometry
from ..storage.buffers import step_is_recorded
from ..storage.paged import PagedKV
from ..storage.static import StaticKV
from .options import PAGE_SIZE
from .window import StaticWindowLayer

class Coordinator(Protocol):
    """What a :class:`BudgetedLayer` asks before storing a forward's tokens (``ForwardCoordinator``)."""

    def before_update(self, layer: "BudgetedLayer", key_states: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Compact this forward's layers if its plan says so (called before the layer writes its new tokens)."""

    def planned_slots(self, new: int) -> int:
        """Slots every full-attention layer holds once this forward's compaction (if any) is done."""

    full_layers: list["BudgetedLayer"]

    def check_announced(self) -> None:
        """Refuse a forward that the cache's own model did not announce (a static layer's eager check)."""


class CoordinatedCache(Protocol):
    """The cache a layer belongs to (``RopeKVCache``; no import of it here): it holds the coordinator."""

    coordinator: Coordinator


#: How to get a croppable cache: the end of every "cannot crop" error.
CROPPABLE_FIX = (
    "Assisted/speculative decoding (assistant_model=, prompt_lookup_num_tokens=) and DoLa need a croppable "
    "cache; use a plain DynamicCache for them, or a budget larger than the whole generation."
)
#: The error of a rollback after an eviction.
CANNOT_CROP = (
    "RopeKVCache cannot crop: tokens were already evicted, so the cache cannot be rolled back. " + CROPPABLE_FIX
)


class BudgetedLayer(CacheLayerMixin):
    """A full-attention layer whose kept tokens stay within the cache's budget.

    It reports ``tokens_seen`` as its sequence length and the geometry of a sliding-window layer to the mask
    (``kv_length = kept + q``, ``kv_offset = seen - kept``): kept slots then line up with the rightmost columns
    of generate's 2-D attention mask, surviving left padding first. Eviction decisions belong to the cache;
    the layer only stores.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: CoordinatedCache, layer_idx: int, storage: PagedKV) -> None:
        super().__init__()
        # A proxy, not a reference: a cache and its layers must not form a cycle, or the arenas (and the
        # model hooks) would wait for the cyclic garbage collector instead of going when the cache does.
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.storage = storage
        self.tokens_seen = 0

    def __repr__(self) -> str:
        return f"BudgetedLayer(seen={self.tokens_seen}, kept={self.storage.length})"

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return self.tokens_seen == self.storage.length

    @property
    def tokens_kept(self) -> int:
        return self.storage.length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # Compaction happens here, before writing: no tensor this forward returned still aliases the arena.
        self._cache.coordinator.before_update(self, key_states, args, kwargs)
        keys, values = self.storage.append(key_states, value_states, first_position=self.tokens_seen)
        self.tokens_seen += key_states.shape[-2]
        self.keys, self.values = keys, values
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kept = self._cache.coordinator.planned_slots(query_length)
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

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.storage.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.storage.repeat_batch(repeats)

    def crop(self, n: int) -> None:
        """Drop tokens from the end, as transformers' ``crop(n)`` does (``_compat.crop_target``: ``n < 0`` removes
        ``-n``, ``0`` removes none). Possible only while nothing was evicted: eviction is not reversible.
        """
        target = _compat.crop_target(self.tokens_seen, n)
        if target == self.tokens_seen:
            return  # nothing to undo, which an evicted layer can honour too (generate calls crop(0) often)
        if not self.is_croppable:
            raise ValueError(CANNOT_CROP)
        self.storage.truncate(target)
        self.tokens_seen = target


class StaticBudgetedLayer(BudgetedLayer):
    """A budgeted full-attention layer over a fixed arena (:class:`~hf_ropekv.storage.static.StaticKV`): compileable.

    Attention always reads the whole arena, ``kv_length`` slots, and the mask hides what is not a live token of a
    row (``get_mask_sizes`` reports ``(kv_length, 0)`` and the cache hands the model a slot-validity mask). Every
    decision (compaction, where the new tokens go, the counters) is taken before the forward (``prepare_forward``), so
    ``update`` only writes: a compiled decode step reads no host counter and is the same graph at every step.
    """

    is_compileable = True

    def __init__(self, cache: CoordinatedCache, layer_idx: int, storage: StaticKV) -> None:
        super().__init__(cache, layer_idx, storage)
        self.kv_length = storage.static_capacity  # slots attention reads in the coming forward (prepare_forward)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A forward the cache's model did not announce (another model runs it) is refused here, eagerly: a compiled
        # step skips the check (is_compiling() folds to a constant, so it adds no guard on the flag), and the
        # model's pre-hook, which runs eagerly before every compiled step, announced that one. (A step recorded as a
        # CUDA graph skips it too: the hook announced it, and its eager run consumed the announce.)
        if not step_is_recorded() and self._cache.coordinator.full_layers[0] is self:
            self._cache.coordinator.check_announced()
        if not self.is_initialized:  # the cache could not allocate before the forward: the arena's shape is known now
            self.initialize(key_states, value_states, self.kv_length)
        keys, values = self.storage.write(key_states, value_states)
        self.keys, self.values = keys, values
        return keys, values

    def prepare_forward(self, first_slot: int, new: int, seen: int, kv_length: int,
                        write_index: torch.Tensor | None) -> None:
        """Before a forward (the static driver): its ``new`` tokens go to ``write_index`` (slots from
        ``first_slot``; None: decided at the first write) and attention reads ``kv_length`` slots."""
        self.storage.plan_write(first_slot, new, seen, write_index)
        self.kv_length = kv_length
        self.tokens_seen = seen + new

    def initialize(self, key_like: torch.Tensor, value_like: torch.Tensor, kv_length: int) -> None:
        """Allocate the arena for keys and values shaped like these (any length: only batch, heads, head dim,
        dtype and device count), with room for the coming forward's ``kv_length`` slots."""
        self.kv_length = kv_length
        self.lazy_initialization(key_like, value_like)
        self.storage.allocate(key_like, value_like, kv_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv_length, 0


def make_layers(cache: CoordinatedCache, geometry: ModelGeometry, options: Any, lease: Any,
                static: bool) -> list[CacheLayerMixin]:
    """One layer per model layer: budgeted (static or growing) for full attention, transformers' own window (static
    or growing) for sliding-window layers. ``options``: the cache's ``CacheOptions``; ``lease``: a static cache's buffers;
    ``static``: whether the full-attention layers are static (``options.static`` may be ``"auto"``)."""
    hint, page_size = options.steady_slots, PAGE_SIZE
    layers: list[CacheLayerMixin] = []
    for idx, (kind, sliding_window) in enumerate(zip(geometry.layer_types, geometry.sliding_windows)):
        if kind == FULL and static:
            layers.append(StaticBudgetedLayer(cache, idx, StaticKV(hint, page_size, idx, lease, options.kv_bits)))
        elif kind == FULL:
            layers.append(BudgetedLayer(cache, idx, PagedKV(page_size, capacity_hint=hint, bits=options.kv_bits)))
        elif static:
            layers.append(StaticWindowLayer(sliding_window, idx, lease))
        else:
            layers.append(DynamicSlidingWindowLayer(sliding_window=sliding_window))
    return layers
