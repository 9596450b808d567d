"""RopeKVCache: a budgeted, paged ``transformers.Cache`` that ``generate()`` accepts unchanged. A thin composition of
its options, per-row bookkeeping (``rows``), the plan and prologue of every forward (``forward``), the compactor,
the model's attachment (hooks) and, for a static cache, the driver that prepares each forward (``static``)."""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.configuration_utils import PretrainedConfig

from ..adapter.attach import ModelAttachment
from ..eviction.compactor import Compactor
from ..kernels.attention import register_op
from ..model.geometry import FULL, ModelGeometry, shared_geometry
from ..scorers.base import Scorer
from ..storage.buffers import BufferLease, BufferPool, step_is_recorded
from .forward import ForwardCoordinator
from .layers import CANNOT_CROP, BudgetedLayer, make_layers
from .model_checks import check_static, checked_options, static_unsupported
from .options import SEED
from .rows import BatchRows, padding_holes
from .scorer_setup import resolve_scorer
from .static import StaticForwardDriver
from .summary import CacheSummary
from .window import StaticWindowLayer

if TYPE_CHECKING:  # importing it at run time loads transformers' model-loading code
    from transformers import PreTrainedModel


class RopeKVCache(Cache):
    """A KV cache that keeps at most ``budget + compress_every`` tokens per row and full-attention layer.

    When a row would hold more than ``budget + compress_every`` real tokens, the cache scores its kept keys, keeps
    the best ``budget`` per KV head and compacts them in place. Each row counts only its own real tokens and
    compacts on its own schedule, so its output depends on neither its padding nor its batch-mates. Sliding-window
    layers stay windows. With ``budget=None`` nothing is evicted and outputs equal ``DynamicCache``'s.

    Args:
        model_or_config: the model (recommended: the cache then sees padding and gathers query statistics) or its
            ``PretrainedConfig``.
        budget: tokens kept per row, KV head and layer after a compaction (the pinned prompt included); ``None``
            never evicts.
        scorer: the eviction policy (``hf_ropekv.scorers``; the cache works on its own copy); default
            ``FrequencyScorer()``: RoPE geometry with statistics gathered online.
        **options: ``compress_every``, ``window``, ``sink``, ``protect_prompt``, ``static``, ``kv_bits``: see
            :class:`~hf_ropekv.cache.options.CacheOptions`, which holds their defaults.

    Raises:
        TypeError: an unknown option (the message lists the valid ones).
        ValueError: an invalid value, or a model the cache cannot hold.
    """

    def __init__(self, model_or_config: PreTrainedModel | PretrainedConfig, budget: int | None = None, *,
                 scorer: Scorer | None = None, **options: Any) -> None:
        self.options, geometry = checked_options(model_or_config, budget, options, "RopeKVCache")
        options = self.options
        model = model_or_config if isinstance(model_or_config, nn.Module) else None
        self.geometry: ModelGeometry = geometry if model is None else shared_geometry(model, geometry)
        super().__init__(layers=[])
        self.scorer, self._online, self._queries = resolve_scorer(scorer, budget, self.geometry, model)
        if options.static is True:
            check_static(self.geometry, budget, model_or_config, self.scorer)
        #: Whether the layers are a fixed arena (static decode steps), settled once.
        self.static = options.static is True or (
            options.static == "auto" and static_unsupported(self.geometry, budget, model, self.scorer) is None)
        self.rows = BatchRows()
        compactor = Compactor(self.scorer, sink=options.sink, window=options.recent_window, seed=SEED,
                              auto_window=options.window is None, online=self._online, queries=self._queries)
        self._lease = BufferLease(self, BufferPool.of(model)) if self.static else None
        self.layers = make_layers(self, self.geometry, options, self._lease, self.static)
        self._full_layers = [layer for layer in self.layers if isinstance(layer, BudgetedLayer)]
        #: The plan and prologue of every forward: the full-attention layers' only link to the cache.
        self.coordinator = ForwardCoordinator(options, self._full_layers, self.rows, compactor,
                                              None if model is None else type(model).__name__)
        self._static_driver = StaticForwardDriver(self.coordinator, self._lease, self.layers) if self.static else None
        self._attachment = None
        if model is not None:
            collect = self._online is not None or self._queries is not None
            self._attachment = ModelAttachment(model, self, collect_queries=collect)
            if self._queries is not None:
                self._queries.scales = [getattr(m, "scaling", None) for m in self._attachment.attention_modules]
            if self.static and not self._attachment.graphs:  # generate will compile the decode step
                register_op()

    # ------------------------------------------------------------------ public introspection
    @property
    def tokens_seen(self) -> int:
        """Tokens per row the model has processed (padding included): what ``get_seq_length`` returns."""
        return self.get_seq_length()

    @property
    def tokens_kept(self) -> int:
        """Slots per row, KV head and full-attention layer currently held: the longest row's real tokens (rows
        with fewer sit behind masked holes). Bounded by ``budget + compress_every``."""
        return self._full_layers[0].storage.length if self._full_layers else self.tokens_seen

    @property
    def batch_size(self) -> int | None:
        """Rows of the batch this cache holds (None before its first forward)."""
        return self.rows.batch_size

    @property
    def tokens_kept_per_row(self) -> tuple[int, ...]:
        """Real tokens each batch row holds (padding and holes excluded)."""
        return tuple(self.tokens_kept - hole for hole in self.rows.current_holes())

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """int64 ``[batch, kv_heads, kept]``: the token index (padding included, as in generate's ``input_ids``) held
        by each slot of layer ``layer_idx``, in slot order, ``-1`` where a row has a hole (its left padding, or room
        left by a compaction). Full-attention layers hold the tokens they kept; sliding-window layers their window.
        """
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx must be in [0, {len(self.layers)}); got {layer_idx}.")
        layer = self.layers[layer_idx]
        holes = self.rows.current_holes()
        if isinstance(layer, BudgetedLayer):
            positions = layer.storage.live_positions()
        elif not layer.is_initialized or layer.keys is None:
            return torch.empty(len(holes), 0, 0, dtype=torch.long)
        else:  # a window holds the last tokens; its holes are the padding among them
            batch, heads, kept = layer.keys.shape[:3]
            seen = layer.get_seq_length()
            positions = torch.arange(seen - kept, seen, device=layer.keys.device).expand(batch, heads, kept)
            holes = padding_holes(self.rows.pads_host or (0,) * batch, seen - kept)
        slot = torch.arange(positions.shape[-1], device=positions.device)
        return positions.masked_fill(slot < torch.tensor(holes, device=positions.device).view(-1, 1, 1), -1)

    @property
    def num_compactions(self) -> int:
        return max((layer.storage.num_compactions for layer in self._full_layers), default=0)

    @property
    def pages_in_use(self) -> int:
        """Pages holding live tokens, summed over full-attention layers (``pages_allocated``: all pages)."""
        return sum(layer.storage.pages_in_use for layer in self._full_layers)

    @property
    def pages_allocated(self) -> int:
        return sum(layer.storage.pages_allocated for layer in self._full_layers)

    def _window_keys(self) -> list[torch.Tensor]:
        return [layer.keys for layer in self.layers
                if not isinstance(layer, BudgetedLayer) and layer.is_initialized and layer.keys is not None]

    @property
    def bytes_held(self) -> int:
        """Bytes of device memory the cache's tensors occupy (all layers, slot positions included)."""
        total = sum(layer.storage.bytes_held for layer in self._full_layers)
        return total + sum(keys.numel() * keys.element_size() * 2 for keys in self._window_keys())

    @property
    def full_cache_bytes(self) -> int:
        """Bytes a ``DynamicCache(config=...)`` would hold for the same tokens: every full-attention layer all of
        them, every sliding-window layer its window (0 before any layer holds keys)."""
        stored = [layer.storage for layer in self._full_layers if layer.storage.keys is not None]
        if stored:  # (in the model's dtype, also where the cache keeps int8 codes)
            keys, size = stored[0].keys, torch.empty((), dtype=stored[0].dtype).element_size()
        else:
            keys = next(iter(self._window_keys()), None)
            size = None if keys is None else keys.element_size()
        if keys is None:
            return 0
        per_token, seen = 2 * keys.shape[1] * keys.shape[3] * size * keys.shape[0], self.tokens_seen
        return sum(per_token * (seen if kind == FULL else min(seen, window - 1))
                   for kind, window in zip(self.geometry.layer_types, self.geometry.sliding_windows))

    @property
    def evicted(self) -> bool:
        """Whether any real token was evicted (then ``crop`` is no longer possible)."""
        return any(self.rows.evicted)

    def summary(self) -> CacheSummary:
        """What the cache holds now, in numbers (``print`` it for one line)."""
        return CacheSummary.from_cache(self)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(model_type={self.geometry.model_type!r}, budget={self.options.budget}, "
                f"compress_every={self.options.compress_every}, scorer={type(self.scorer).__name__}, "
                f"static={self.static}, seen={self.tokens_seen}, kept={self.tokens_kept}, "
                f"pages={self.pages_in_use}/{self.pages_allocated}, bytes={self.bytes_held}, "
                f"compactions={self.num_compactions})")

    # ------------------------------------------------------------------ transformers hooks
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> Any:
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"This RopeKVCache holds {len(self.layers)} layers ({self.geometry.model_type}) but a model with more "
                f"layers updates layer {layer_idx}. A cache is bound to its model: build one per model.")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.rows = self.coordinator.rows = BatchRows()
        self.coordinator.reset()
        for part in (self._static_driver, self._queries, self._attachment):
            if part is not None:
                part.reset()
        if self._online is not None:
            if self._lease is not None:
                for tensor in self._online.buffers():
                    self._lease.give_back(tensor)
            self._online.reset()

    def crop(self, n: int) -> None:
        """Roll back as transformers' ``crop(n)`` does (``n < 0`` removes ``-n`` tokens); only until the first
        eviction: after it, any crop that would remove tokens raises."""
        super().crop(n)
        seen, coordinator = self.tokens_seen, self.coordinator
        if coordinator.prompt_tokens is not None and coordinator.prompt_tokens > seen:
            coordinator.prompt_tokens = seen  # the rollback reached into the pinned prompt
        if self._attachment is not None:
            self._attachment.truncate(seen)

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Called by generate before a decoding mode that rolls the cache back (assisted/speculative decoding): from
        then on any forward that would evict or pin more than ``budget`` tokens is refused with the "cannot crop"
        error; a cache that already evicted refuses here."""
        if not all(layer.is_croppable for layer in self._full_layers):
            raise ValueError(CANNOT_CROP)
        super().activate_past_recording(**kwargs)  # (transformers 5.25 passes recurrent_states_to_keep=)
        self.coordinator.rollback_expected = True

    def __deepcopy__(self, memo: dict) -> "RopeKVCache":
        """An independent cache that continues exactly like this one (transformers' prompt-reuse recipe): every
        attribute is deep-copied, except that the layers' back-references point to the copy and the copy gets its
        own model attachment (hooks that act only when the forward's cache is the copy)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for layer in self._full_layers:  # each holds a weakref.proxy to its cache: make it the copy's
            memo[id(layer._cache)] = weakref.proxy(twin)
        for name, value in self.__dict__.items():
            if name != "_attachment":
                setattr(twin, name, copy.deepcopy(value, memo))
        twin._attachment = None if self._attachment is None else self._attachment.copy_for(twin, memo)
        return twin

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_rows(indices)
        self.rows.batch_size = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        rows = len(self.rows.evicted) or (self.rows.batch_size or 0)
        # Repeating rows is selecting them again (the attachment's token history is left as it is).
        self._select_rows(torch.arange(rows).repeat_interleave(repeats), tokens=False)
        self.rows.batch_size = None

    def _select_rows(self, index: torch.Tensor, tokens: bool = True) -> None:
        """Rows were reordered, selected or repeated (``index``: the old row of each new one): follow them in every
        per-row state of the cache (``tokens``: and in the attachment's token history)."""
        self.rows.select(index)
        self.coordinator.plan = None
        for state in (self._queries, self._online, self._attachment if tokens else None):
            if state is not None:
                state.select_batch(index)

    # ------------------------------------------------------------------ called by the model attachment
    def _forward_starts(self, attention_mask: torch.Tensor | None, new: int, batch: int,
                        device: torch.device) -> torch.Tensor | None:
        """Before a forward with this cache: returns the mask the forward is to use (None: none)."""
        self.coordinator.announced = True
        if attention_mask is None or self.rows.appends_real_token(attention_mask.shape[-1], new, batch):
            new_token_mask = None  # a decoding step's token is real (see BatchRows.appends_real_token)
        else:
            # Canonical strides: a slice of the growing mask keeps its stride, which changes every step; a compiled
            # step that read it would be recompiled with dynamic strides and record a CUDA graph per step.
            new_token_mask = attention_mask[:, -new:].bool().clone(memory_format=torch.contiguous_format)
        seen = self.get_seq_length()  # before a static driver's prepare, which counts this forward's tokens
        replaced = None
        if self._static_driver is not None:
            model = self._attachment._model_ref()
            replaced = self._static_driver.prepare(attention_mask, new, batch, device, model, self._online)
        elif attention_mask is not None:
            decoding = self.rows.observe_mask(attention_mask, new)
            plan = self.coordinator.plan_for(new, 0 if self._full_layers else seen)
            replaced = self.rows.mask_for(attention_mask, new, plan, decoding)
        if self._online is not None:
            self._online.begin_forward(new_token_mask, new)
        if self._queries is not None:
            pads = self.rows.pads if self.rows.pads is not None else torch.zeros(batch, dtype=torch.long, device=device)
            self._queries.begin_forward(seen, new, pads, new_token_mask)
        return replaced

    def _forward_ends(self) -> None:
        """After every forward with this cache, raised or not: the next one must be announced again (a compiled step
        skips the layers' check that consumes the announcement), and ``get_seq_length`` counts this one's tokens."""
        self.coordinator.announced = False
        if self._static_driver is not None:
            self._static_driver.seen_before = None

    def _expect_tokens(self, tokens: int | None) -> None:
        """A generate() call holds at most ``tokens`` tokens per row (a static cache sizes its arenas for it)."""
        if self._static_driver is not None and tokens is not None:
            self._static_driver.expected_tokens = int(tokens)

    def _recorded_step_tensors(self) -> list[torch.Tensor]:
        """The tensors besides its inputs that a static decode step reads, as they are now: its leased buffers, the
        online statistics' tables and each sliding-window layer's slot index. ``adapter.graphed_step`` keys its
        CUDA graphs by their addresses (``test_graphed_step.py`` checks that a step reads nothing else)."""
        tensors = [] if self._lease is None else self._lease.tensors()
        if self._online is not None:
            tensors += self._online.step_tensors()
        tensors += [layer._last_slot for layer in self.layers
                    if isinstance(layer, StaticWindowLayer) and layer.is_initialized]
        return tensors

    def _query_consumers(self) -> list[Any]:
        """What the model attachment hands each forward's pre-RoPE queries to."""
        return [consumer for consumer in (self._online, self._queries) if consumer is not None]

    # ------------------------------------------------------------------ static: the compiled step's clock
    def get_query_offset(self, layer_idx: int = 0) -> Any:
        """The first new token's slot in the arena (static; its position in the mask's causal part), else the
        tokens seen. A compiled step gets a device scalar, so it never specialises on a changing int; so does a step
        captured into a CUDA graph, which would otherwise bake this step's int into every replay."""
        driver = self._static_driver
        if driver is None:
            return self.get_seq_length(layer_idx)
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        if isinstance(layer, StaticWindowLayer):
            return layer.query_offset()  # its part of the mask: a constant from one decoding step to the next
        if step_is_recorded():
            return driver.clock_on_first_device()[0]
        return driver.query_offset

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        driver = self._static_driver
        if driver is not None and step_is_recorded():
            return driver.clock_on_first_device()[1]  # a device scalar: see get_query_offset
        if driver is not None and driver.seen_before is not None:
            return driver.seen_before  # a forward is under way: the tokens before it, as a growing cache reports
        attachment = self._attachment
        if attachment is not None and attachment.detached:  # hf_ropekv.detach(model) took its hooks off
            attachment.check_attached()
        return super().get_seq_length(layer_idx)
