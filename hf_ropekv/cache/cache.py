"""RopeKVCache: a budgeted, paged ``transformers.Cache`` that ``generate()`` accepts unchanged."""

from __future__ import annotations

import copy
import itertools
import weakref
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer
from transformers.utils import logging

from .. import _compat
from ..hooks.attach import ModelAttachment
from .layers import CANNOT_CROP, CROPPABLE_FIX, BudgetedLayer, StaticBudgetedLayer
from ..model.geometry import FULL, SLIDING, ModelGeometry, describe, shared_geometry
from ..eviction.schedule import Plan, plan_forward
from ..scorers.base import ScoreContext, Scorer
from ..eviction.selection import Guards, hashed_uniform, select_keep, slot_masks
from ..storage.buffers import BufferLease, BufferPool
from ..storage.paged import PagedKV, StaticKV, compact_arenas

logger = logging.get_logger(__name__)

SELECTIONS = ("global", "per_layer")


class RopeKVCache(Cache):
    """A KV cache that keeps at most ``budget + compress_every`` tokens per full-attention layer.

    When a batch row would hold more than ``budget + compress_every`` real tokens, the cache scores its kept
    keys, keeps the best ``budget`` per KV head and compacts them in place. Every row counts only its own
    real tokens (padding never counts) and compacts on its own schedule, so a row's output does not depend on
    its padding or its batch-mates (``hf_ropekv.eviction.schedule``). Sliding-window layers stay plain windows. With
    ``budget=None`` nothing is ever evicted and outputs equal ``DynamicCache``'s.

    In steady state the kept length cycles through the same ``compress_every`` or so values, so attention
    backends that plan per K/V length (torch's cuDNN sdpa) reuse their plans after the first cycle; a growing
    ``DynamicCache`` meets a new length every step (benchmarks/README.md has the measurements).

    Args:
        model_or_config: the model (recommended: the cache then sees padding and can gather query statistics)
            or its ``PretrainedConfig``.
        budget: tokens kept per row, KV head and layer after a compaction (prompt included when pinned);
            ``None`` never evicts.
        compress_every: compact once this many tokens beyond the budget have accumulated (amortises scoring).
        page_size: slots per storage page; capacity grows and is reported in whole pages.
        window: most recent tokens never evicted; ``None``: ``min(32, budget // 4)`` (0 without a budget).
        sink: first tokens of each row never evicted (StreamingLLM's attention sinks).
        protect_prompt: pin every token received before the first single-token (decoding) step; the prompt
            counts toward the budget and must fit in it.
        scorer: the eviction policy (see ``hf_ropekv.scorers``); default: RoPE frequency scoring.
        stats: query statistics for the RoPE scorer (``FrequencyStats`` or a path); ``None`` gathers them
            online, per batch row, from every query the model computes with this cache (the prompt, later
            turns and every decoding step; needs the model). A forward's queries count once it has finished.
        stats_half_life: with online statistics, the number of tokens after which a query's weight halves;
            ``None`` weighs all queries alike.

    The defaults (per-layer selection, a recent window of 32, online statistics with a half-life of 128) are
    the best of the variants measured on free-running GSM8K reasoning (README, "Quality"); the paper's
    operating point is ``selection="global", window=0, stats_half_life=None``.
        selection: ``"per_layer"`` lets every layer rank its own keys; ``"global"`` ranks once per (row, KV
            head) with scores averaged over layers (the paper's operating point).
        seed: seed of the tie-breaking noise (and of the random scorer's default).
        static: keep every full-attention layer in a fixed arena of ``budget + compress_every`` slots (whole pages)
            allocated once at a static address, and decide everything before each forward, so the decode step
            has static shapes and reads no host counter: ``is_compileable`` is then True, ``generate()``
            compiles the decode step on CUDA by itself (CUDA graphs), and
            ``model.forward = torch.compile(model.forward, mode="reduce-overhead")`` works too. Compaction runs
            eagerly between two compiled steps. Same tokens kept as ``static=False`` (tested). Needs a budget and
            the model; not for models with sliding-window layers or for scorers that recompute attention
            (SnapKV, H2O, R-KV).
    """

    def __init__(
        self,
        model_or_config: PreTrainedModel | PretrainedConfig,
        budget: int | None = None,
        *,
        compress_every: int = 128,
        page_size: int = 64,
        window: int | None = None,
        sink: int = 0,
        protect_prompt: bool = True,
        scorer: Scorer | None = None,
        stats: Any = None,
        selection: str = "per_layer",
        seed: int = 0,
        stats_half_life: float | None = 128,
        static: bool = False,
    ) -> None:
        # A window the user asked for is a hard guarantee; the default one yields to a long pinned prompt.
        self._auto_window = window is None
        window = default_window(window, budget)
        _check_options(budget, compress_every, page_size, window, sink, selection)
        self.geometry: ModelGeometry = describe(model_or_config)
        if isinstance(model_or_config, nn.Module):
            self.geometry = shared_geometry(model_or_config, self.geometry)
        _check_sliding_windows(self.geometry, budget)
        self.budget = budget
        self.compress_every = compress_every
        self.page_size = page_size
        self.window = window
        self.sink = sink
        self.protect_prompt = protect_prompt
        self.selection = selection
        self.seed = seed
        self.stats_half_life = stats_half_life
        self.static = static
        self._lease: BufferLease | None = None
        if static:
            _check_static(self.geometry, budget, model_or_config)
            self._lease = BufferLease(self, BufferPool.of(model_or_config))

        hint = None if budget is None else budget + compress_every
        layers: list[Any] = []
        for idx, (kind, sliding_window) in enumerate(zip(self.geometry.layer_types, self.geometry.sliding_windows)):
            if kind == FULL and static:
                layers.append(StaticBudgetedLayer(self, idx, StaticKV(hint, page_size, idx, self._lease)))
            elif kind == FULL:
                layers.append(BudgetedLayer(self, idx, PagedKV(page_size, capacity_hint=hint)))
            else:
                layers.append(DynamicSlidingWindowLayer(sliding_window=sliding_window))
        super().__init__(layers=layers)
        self._full_layers = [layer for layer in self.layers if isinstance(layer, BudgetedLayer)]

        model = model_or_config if isinstance(model_or_config, nn.Module) else None
        self.scorer = self._resolve_scorer(scorer, stats, model)
        self._queries = self._query_window(model)
        if static and self._queries is not None:
            raise ValueError(
                f"{type(self.scorer).__name__} recomputes attention from a growing window of recent queries, which a "
                "static (compiled) cache cannot hold. Use static=False with it, or a scorer that needs no queries "
                "(the default RoPE scorer, RecencyScorer, KeyNormScorer, RandomScorer)."
            )
        self._attachment = None
        if model is not None:
            collect = self._online is not None or self._queries is not None
            self._attachment = ModelAttachment(model, self, collect_queries=collect)
            if self._queries is not None:
                modules = self._attachment.attention_modules
                self._queries.scales = [getattr(module, "scaling", None) for module in modules]

        # static: per device, a decode step's slot and tokens seen before it (device scalars a compiled step reads)
        self._static_clock: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._reset_rows()

    def _reset_rows(self) -> None:
        """Forget everything known about the batch rows (a fresh sequence)."""
        self._batch_size: int | None = None
        self._pads: torch.Tensor | None = None  # left padding per row among the tokens seen + new (device)
        self._pads_total = -1  # token count the current `_pads` describes
        self._pads_host: tuple[int, ...] | None = None  # the same, on the host (planning never syncs)
        self._holes: tuple[int, ...] | None = None  # slots before each row's real tokens; None: its padding
        self._holes_pads: tuple[int, ...] = ()  # the rows' left padding (`_pads_host`) when `_holes` was recorded
        self._evicted_rows: list[bool] = []
        self._plan: Plan | None = None  # this forward's compaction plan (memoised by seen, new, slots)
        self._rows_on_device: tuple[tuple[int, ...], torch.Tensor] | None = None  # see _device_rows
        self._decode_steps = 0  # single-token forwards finished: the compaction clock (hf_ropekv.eviction.schedule)
        self._prompt_tokens: int | None = None  # pinned prompt length once decoding started
        self._query_offset = 0  # static: slots in front of the running forward's first new token

    # ------------------------------------------------------------------ public introspection
    @property
    def tokens_seen(self) -> int:
        """Tokens per row the model has processed (padding included): what ``get_seq_length`` returns."""
        return self.get_seq_length()

    @property
    def tokens_kept(self) -> int:
        """Slots per row, KV head and full-attention layer currently held: the longest row's real tokens (rows
        with fewer sit behind masked holes). Bounded by ``budget + compress_every``."""
        return self._full_layers[0].tokens_kept if self._full_layers else self.tokens_seen

    @property
    def tokens_kept_per_row(self) -> tuple[int, ...]:
        """Real tokens each batch row holds (padding and holes excluded)."""
        slots = self.tokens_kept
        return tuple(slots - hole for hole in self._current_holes())

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """int64 ``[batch, kv_heads, kept]``: the token index (padding included, as in generate's ``input_ids``) held
        by each slot of layer ``layer_idx``, in slot order, ``-1`` where a row has a hole (its left padding, or room
        left by a compaction). Full-attention layers hold the tokens they kept; sliding-window layers their window.
        """
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx must be in [0, {len(self.layers)}); got {layer_idx}.")
        layer = self.layers[layer_idx]
        holes = self._current_holes()
        if isinstance(layer, BudgetedLayer):
            positions = layer.storage.live_positions().clone()
        else:
            if not layer.is_initialized or layer.keys is None:
                return torch.empty(len(holes), 0, 0, dtype=torch.long)
            batch, heads, kept = layer.keys.shape[:3]
            seen = layer.get_seq_length()
            positions = torch.arange(seen - kept, seen, device=layer.keys.device).expand(batch, heads, kept).clone()
            # A window's slots are its last tokens; a row's padding among them is a hole too.
            pads = self._pads_host or (0,) * batch
            holes = tuple(max(0, pad - (seen - kept)) for pad in pads)
        slot = torch.arange(positions.shape[-1], device=positions.device)
        is_hole = slot[None, None, :] < torch.tensor(holes, device=positions.device).view(-1, 1, 1)
        return positions.masked_fill(is_hole, -1)

    @property
    def num_compactions(self) -> int:
        return max((layer.storage.num_compactions for layer in self._full_layers), default=0)

    @property
    def pages_in_use(self) -> int:
        """Pages holding live tokens, summed over full-attention layers."""
        return sum(layer.storage.pages_in_use for layer in self._full_layers)

    @property
    def pages_allocated(self) -> int:
        """Pages allocated, summed over full-attention layers."""
        return sum(layer.storage.pages_allocated for layer in self._full_layers)

    @property
    def bytes_held(self) -> int:
        """Bytes of device memory the cache's tensors occupy (all layers, slot positions included)."""
        total = sum(layer.storage.bytes_held for layer in self._full_layers)
        for layer in self.layers:
            if not isinstance(layer, BudgetedLayer) and layer.is_initialized and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    @property
    def full_cache_bytes(self) -> int:
        """Bytes a ``DynamicCache(config=...)`` would hold for the same tokens (for comparison)."""
        if not self._full_layers or self._full_layers[0].storage.keys is None:
            return 0
        keys = self._full_layers[0].storage.keys
        per_token = 2 * keys.shape[1] * keys.shape[3] * keys.element_size() * keys.shape[0]
        seen = self.tokens_seen
        return sum(
            per_token * (seen if kind == FULL else min(seen, window - 1))
            for kind, window in zip(self.geometry.layer_types, self.geometry.sliding_windows)
        )

    @property
    def evicted(self) -> bool:
        """Whether any real token was evicted (then ``crop`` is no longer possible)."""
        return any(self._evicted_rows)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model_type={self.geometry.model_type!r}, budget={self.budget}, "
            f"compress_every={self.compress_every}, scorer={type(self.scorer).__name__}, "
            f"selection={self.selection!r}, seen={self.tokens_seen}, kept={self.tokens_kept}, "
            f"pages={self.pages_in_use}/{self.pages_allocated}, bytes={self.bytes_held}, "
            f"compactions={self.num_compactions})"
        )

    # ------------------------------------------------------------------ the compaction plan
    def _current_holes(self) -> tuple[int, ...]:
        """Slots in front of each row's real tokens now: its left padding until the first compaction."""
        if self._holes is not None:
            # Left padding that arrived since (a long padded prompt sent in chunks) is more holes.
            return tuple(h + p - p0 for h, p, p0 in zip(self._holes, self._pads_host, self._holes_pads))
        if self._pads_host is not None:
            return self._pads_host
        return (0,) * (self._batch_size or 1)

    def _plan_for(self, new: int) -> Plan:
        """This forward's plan; a pure function of the cache's state, so the mask and the layers agree."""
        # Read from the first full-attention layer, which no update of this forward has reached yet (sliding
        # layers in front of it may already have counted the new tokens).
        first = self._full_layers[0] if self._full_layers else None
        seen = first.tokens_seen if first is not None else self.get_seq_length()
        slots = first.storage.length if first is not None else seen
        plan = self._plan
        if plan is None or (plan.seen, plan.new, plan.slots_before) != (seen, new, slots):
            step = self._decode_steps if new == 1 else None
            plan = plan_forward(seen, new, slots, self._current_holes(), self.budget, self.compress_every, step)
            self._plan = plan
        return plan

    def planned_slots(self, new: int) -> int:
        """Slots every full-attention layer holds once this forward's compaction (if any) is done."""
        return self._plan_for(new).slots_after

    # ------------------------------------------------------------------ transformers hooks
    def reset(self) -> None:
        super().reset()
        self._reset_rows()
        if self._queries is not None:
            self._queries.reset()
        self._rollback_expected = False
        if self._online is not None:
            if self._lease is not None:
                for tensor in self._online.buffers():
                    self._lease.give_back(tensor)
            self._online.reset()
        if self._attachment is not None:
            self._attachment.reset()

    def crop(self, n: int) -> None:
        """Roll back as transformers' ``crop(n)`` does (``n < 0`` removes ``-n`` tokens; see ``_compat.crop_target``).

        Only possible until the first eviction: after it, any crop that would remove tokens raises.
        """
        super().crop(n)
        seen = self.tokens_seen
        if self._prompt_tokens is not None and self._prompt_tokens > seen:
            self._prompt_tokens = seen  # the rollback reached into the pinned prompt
        if self._attachment is not None:
            self._attachment.truncate(seen)

    #: Set once generate announced a decoding mode that rolls the cache back (``activate_past_recording``).
    _rollback_expected = False

    def activate_past_recording(self) -> None:
        """Called by generate before a decoding mode that rolls the cache back (assisted/speculative decoding).

        From then on the cache refuses, with the "cannot crop" error, any forward that would evict or pin more
        than ``budget`` tokens; a cache that already evicted refuses here.
        """
        if not all(layer.is_croppable for layer in self._full_layers):
            raise ValueError(CANNOT_CROP)
        super().activate_past_recording()
        self._rollback_expected = True

    def _refuse_eviction_before_rollback(self, seen: int, q: int) -> None:
        """In a rolling-back decoding mode, raise the "cannot crop" error instead of evicting.

        Assisted decoding sends the prompt and then each draft as multi-token forwards; the prompt-pinning check
        would take them all for prompt and fail first with a misleading message.
        """
        if not self._rollback_expected or self.budget is None:
            return
        real = seen + q - min(self._pads_host)
        pins_too_much = self._prompt_tokens is None and self.protect_prompt and real > self.budget
        if pins_too_much or self._plan_for(q).compacts:
            raise ValueError(
                f"RopeKVCache cannot crop once it evicts, and this decoding mode rolls the cache back: this step "
                f"would take it to {real} tokens, past budget={self.budget}. {CROPPABLE_FIX}"
            )

    def __deepcopy__(self, memo: dict) -> "RopeKVCache":
        """An independent cache that continues exactly like this one (transformers' prompt-reuse recipe).

        Every attribute is deep-copied (storage, statistics, padding, scorer, RNG), so state added to the cache
        later is copied too. Two things are rebound instead: the layers' back-references point to the copy, and
        the copy gets its own model attachment (hooks that act only when the forward's cache is the copy).
        """
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for layer in self.layers:  # BudgetedLayer holds a weakref.proxy to its cache: make it the copy's
            back = getattr(layer, "_cache", None)
            if isinstance(back, weakref.ProxyTypes):
                memo[id(back)] = weakref.proxy(twin)
        for name, value in self.__dict__.items():
            if name != "_attachment":
                setattr(twin, name, copy.deepcopy(value, memo))
        twin._attachment = None if self._attachment is None else self._attachment.copy_for(twin, memo)
        return twin

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx)
        if self._attachment is not None:
            self._attachment.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_rows(indices)
        if self._attachment is not None:
            self._attachment.select_batch(indices)
        self._batch_size = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        rows = len(self._evicted_rows) or (self._batch_size or 0)
        self._select_rows(torch.arange(rows).repeat_interleave(repeats))  # repeating rows = selecting them again
        self._batch_size = None

    def _select_rows(self, index: torch.Tensor) -> None:
        """Rows were reordered, selected or repeated: follow them in every per-row state of the cache."""
        if self._pads is not None:
            self._pads = self._pads.index_select(0, index.to(self._pads.device))
        per_row = (self._pads_host, self._holes, self._holes_pads, tuple(self._evicted_rows))
        if any(rows and len(set(rows)) > 1 for rows in per_row):  # rows differ: where each goes matters (syncs)
            order = index.tolist()
            self._pads_host, self._holes, holes_pads, evicted = (
                None if not rows else tuple(rows[i] for i in order) for rows in per_row
            )
            self._holes_pads, self._evicted_rows = holes_pads or (), list(evicted or ())
        elif len(index) != len(self._evicted_rows):  # a selection of uniform rows: only the count changes
            self._pads_host, self._holes, holes_pads, evicted = (
                None if not rows else (rows[0],) * len(index) for rows in per_row
            )
            self._holes_pads, self._evicted_rows = holes_pads or (), list(evicted or ())
        self._plan = None
        if self._queries is not None:
            self._queries.select_batch(index)
        if self._online is not None:
            self._online.select_batch(index)

    # ------------------------------------------------------------------ called by the model attachment
    def _observe_padding(self, attention_mask: torch.Tensor, new: int) -> bool:
        """Record left padding from generate's 2-D attention mask (covers tokens seen + new); returns whether this
        forward is a decoding step appending a real token (``_appends_real_token``), whose padding is the known one.

        The padding is counted again (and its host copy, one synchronisation, refreshed) only when new tokens may
        be padding: in multi-token forwards (a prompt or its chunks). Decoding steps append real tokens, so the
        padding stays as it was.
        """
        self._check_batch(attention_mask.shape[0])
        if self._appends_real_token(attention_mask.shape[-1], new, attention_mask.shape[0]):
            self._pads_total = attention_mask.shape[-1]
            return True
        self._pads = (attention_mask == 0).sum(-1)
        self._pads_total = attention_mask.shape[-1]
        if self._pads_host is None or new > 1 or len(self._pads_host) != attention_mask.shape[0]:
            self._pads_host = tuple(self._pads.tolist())
        return False

    def _appends_real_token(self, total: int, new: int, batch: int) -> bool:
        """Whether this forward is a decoding step right after a forward whose padding the cache recorded.

        A single-token forward appends a real token at the next position: ``generate`` appends a one to its
        mask and one to its positions, and ``_pads_host`` (what planning reads) is only ever taken from
        multi-token forwards. The padding of every row is then the one already recorded and the new token needs
        no mask, which saves each decoding step the ops on generate's full-length mask (or on the positions).
        """
        return (
            new == 1
            and self._pads_total == total - 1
            and self._pads is not None
            and self._pads.shape[0] == batch
            and self._pads_host is not None
            and len(self._pads_host) == batch
        )

    def _forward_starts(
        self, attention_mask: torch.Tensor | None, new: int, batch: int, device: torch.device
    ) -> torch.Tensor | None:
        """Called by the model attachment before a forward with this cache: returns the mask the forward is to use
        (None: none), or ``attention_mask`` itself."""
        if attention_mask is None or self._appends_real_token(attention_mask.shape[-1], new, batch):
            new_token_mask = None  # a decoding step's token is real (see _appends_real_token)
        else:
            # Canonical strides: a slice of the growing mask keeps its stride, which changes every step; a compiled
            # step that read it would be recompiled with dynamic strides and record a CUDA graph per step.
            new_token_mask = attention_mask[:, -new:].bool().clone(memory_format=torch.contiguous_format)
        if self.static:
            replaced = self._prepare_static_forward(attention_mask, new, batch, device)
        else:
            replaced = None if attention_mask is None else self._attention_mask_for(attention_mask, new)
        if self._online is not None:
            self._online.begin_forward(new_token_mask, new)
        if self._queries is not None:
            pads = self._pads if self._pads is not None else torch.zeros(batch, dtype=torch.long, device=device)
            self._queries.begin_forward(self.get_seq_length(), new, pads, new_token_mask)
        return replaced

    def _query_consumers(self) -> list[Any]:
        """What the model attachment hands each forward's pre-RoPE queries to (see ``AttachedCache``)."""
        return [consumer for consumer in (self._online, self._queries) if consumer is not None]

    def _attention_mask_for(self, attention_mask: torch.Tensor, new: int) -> torch.Tensor | None:
        """The 2-D mask this forward must use: generate's own, with each row's holes hidden once rows differ; or
        None, for a decoding step where no row has a padded or evicted slot to hide.

        The full-attention layers read the mask's last ``slots + new`` columns (the geometry
        ``get_mask_sizes`` reports). Until the first compaction every row's holes are its left padding, which
        the mask already hides; after it, the rows' holes come from the plan.
        """
        decoding = self._observe_padding(attention_mask, new)
        plan = self._plan_for(new)
        if decoding and not any(self._pads_host) and not any(plan.holes_after):
            # Every column would read one: the model needs no mask (generate itself drops an all-ones mask on newer
            # transformers). Given one, transformers 5.17 gathers the kept slots' columns of it every decoding step
            # (three kernels that DynamicCache's steps do not run) and synchronises on their all().
            return None
        if self._holes is None and not plan.compacts:
            return attention_mask
        # Left padding hides the first max(0, pad - (seen - slots)) columns of the region: when that is each row's
        # holes (no padding and rows kept alike, e.g. batch 1), generate's mask is already the one to use.
        evicted = plan.seen - plan.slots_after
        if plan.holes_after == tuple(max(0, pad - evicted) for pad in self._pads_host):
            return attention_mask
        holes = self._device_rows(plan.holes_after, attention_mask.device)
        region = torch.arange(plan.slots_after + new, device=attention_mask.device)[None, :] >= holes[:, None]
        mask = attention_mask.clone()
        mask[:, mask.shape[1] - region.shape[1] :] = region.to(mask.dtype)
        return mask

    def _device_rows(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``values`` as a device tensor, copied from the host only when they change (holes change at compactions;
        the mask needs them at every decoding step)."""
        cached = self._rows_on_device
        if cached is None or cached[0] != values or cached[1].device != device:
            cached = (values, torch.tensor(values, device=device))
            self._rows_on_device = cached
        return cached[1]

    # ------------------------------------------------------------------ static: every decision before the forward
    def _prepare_static_forward(
        self, attention_mask: torch.Tensor | None, new: int, batch: int, device: torch.device
    ) -> torch.Tensor:
        """Take every decision of a forward of ``new`` tokens before it runs; return its ``[B, kv_length]`` slot mask.

        The same plan as the growing cache's (``_plan_for``), with the compaction run here, eagerly, between two
        compiled steps. The forward then writes its tokens at each arena's ``write_index`` and attends over
        ``kv_length`` slots, where the mask marks each row's live ones (right-aligned after its holes).
        """
        self._check_batch(batch)
        first = self._full_layers[0]
        seen = first.tokens_seen
        if attention_mask is not None:
            self._observe_padding(attention_mask, new)
        elif self._pads is None or self._pads.shape[0] != batch:
            self._pads = torch.zeros(batch, dtype=torch.long, device=device)
            self._pads_host = (0,) * batch
        self._check_forward(seen, new)
        plan = self._plan_for(new)
        if new == 1:
            self._decode_steps += 1
        if plan.compacts:
            self._record_compaction(plan)
            if self.selection == "per_layer":
                self._compact_each(self._full_layers, plan)
            else:
                self._compact(self._full_layers, plan)
        needed = plan.slots_after + new
        for layer in self._full_layers:
            layer.storage.reserve(needed)
        # What attention reads: the arena the layers hold for this forward (the fixed one, or a temporary one in
        # whole pages for a forward longer than it; a layer allocates at its first forward, to this size).
        page = self.page_size
        kv_length = first.storage.capacity or max(first.storage.static_capacity, -(-needed // page) * page)
        if not first.is_initialized:
            self._initialize_static_layers(batch, kv_length)
        self._query_offset = plan.slots_after
        indices = self._static_write_indices(plan.slots_after, new, seen, device)
        for layer in self._full_layers:
            storage = layer.storage
            storage.advance(new, seen)
            storage.write_index = indices.get(storage.keys.device) if storage.keys is not None else None
            storage.planned_write = (plan.slots_after, new)
            layer.kv_length = kv_length
            layer.tokens_seen = seen + new
        slot = torch.arange(kv_length, device=device)[None, :]
        holes = self._device_rows(plan.holes_after, device)[:, None]
        mask = (slot >= holes) & (slot < plan.slots_after + new)
        return mask if attention_mask is None else mask.to(attention_mask.dtype)

    def _initialize_static_layers(self, batch: int, kv_length: int) -> None:
        """Allocate every layer's arena before the first forward, as generate does for a StaticCache before a
        compiled prefill: allocated inside a CUDA graph, an arena would live in the graph's memory pool and be
        overwritten by the next replay. Left to the first forward when transformers cannot tell the shapes
        (layers on several devices)."""
        model = self._attachment._model_ref() if self._attachment is not None else None
        shape = None if model is None else _compat.static_init_shape(model, len(self.layers))
        if shape is None:
            return
        heads, head_dims = shape
        embeddings = model.get_input_embeddings()
        dtype = embeddings.weight.dtype if embeddings is not None else model.dtype  # what the keys are computed in
        for layer in self._full_layers:
            like = torch.empty(batch, heads[layer.layer_idx], 0, head_dims[layer.layer_idx], dtype=dtype,
                               device=model.device)
            layer.kv_length = kv_length
            layer.initialize(like, like)

    def _static_write_indices(
        self, slots: int, new: int, seen: int, input_device: torch.device
    ) -> dict[torch.device, torch.Tensor]:
        """Where this forward's tokens go, per device, and the clock a compiled forward reads.

        Per device, two device scalars that a compiled step captured by address (refilled here, never replaced):
        the first new token's slot and the tokens seen before it. A decode step writes at the first; a
        multi-token forward gets a fresh ``arange``.
        """
        devices = {layer.storage.keys.device for layer in self._full_layers if layer.storage.keys is not None}
        for device in devices | {input_device}:
            if device not in self._static_clock:
                self._static_clock[device] = tuple(
                    self._lease.take(("clock", i, device), shape, torch.int64,
                                     lambda shape=shape: torch.zeros(shape, dtype=torch.int64, device=device))
                    for i, shape in enumerate(((1,), ()))
                )
            first_slot, seen_before = self._static_clock[device]
            first_slot.fill_(slots)
            seen_before.fill_(seen)
        if new == 1 and self._online is not None and not self._online.on_buffers:
            self._online.move_to_buffers(self._lease.take)  # decoding starts: the sums a compiled step updates
        if new > 1:
            return {device: torch.arange(slots, slots + new, device=device) for device in devices}
        return {device: self._static_clock[device][0] for device in devices}

    def get_query_offset(self, layer_idx: int = 0) -> Any:
        """The first new token's slot in the arena (static; its position in the mask's causal part), else the
        tokens seen. A compiled step gets a device scalar, so it never specialises on a changing int."""
        if not self.static:
            return self.get_seq_length(layer_idx)
        if torch.compiler.is_compiling():
            return self._clock_on_first_device()[0]
        return self._query_offset

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        if self.static and torch.compiler.is_compiling():
            return self._clock_on_first_device()[1]  # a device scalar: see get_query_offset
        attachment = getattr(self, "_attachment", None)
        if attachment is not None and attachment.detached:  # hf_ropekv.detach(model) took its hooks off
            attachment.check_attached()
        return super().get_seq_length(layer_idx)

    def _clock_on_first_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(iter(self._static_clock.values()))

    # ------------------------------------------------------------------ called by BudgetedLayer.update
    def _before_layer_update(self, layer: BudgetedLayer, key_states: torch.Tensor, args: tuple, kwargs: dict) -> None:
        if layer is not self._full_layers[0]:
            # A later layer of the forward (every layer but one, every step): it follows the plan the first layer
            # fixed, so it only checks the batch and compacts when that plan says so (kept to a few lookups).
            if key_states.shape[0] != self._batch_size:
                self._check_batch(key_states.shape[0])
            return  # the first layer compacted every layer, if the plan says so
        seen, q = layer.tokens_seen, key_states.shape[-2]
        self._check_batch(key_states.shape[0])
        self._begin_step(seen, q, key_states, args, kwargs)
        # The first layer fixes the forward's plan; later layers follow it (the state it depends on has moved).
        plan = self._plan_for(q)
        if q == 1:
            self._decode_steps += 1
        if not plan.compacts:
            return
        self._record_compaction(plan)
        # Every layer now, at the first: no tensor returned in this forward aliases any arena yet, and each layer
        # holds exactly what it would hold at its own update (compaction runs before a layer writes, and queries
        # count once their forward has finished), so per-layer selection picks the same tokens. One op set for
        # all layers instead of one per layer: a compaction step is host-bound like any other at batch 1.
        if self.selection == "per_layer":
            self._compact_each(self._full_layers, plan, _EAGER_SELECTION_WORKSPACE)
        else:  # one ranking for all layers
            self._compact(self._full_layers, plan)

    def _compact(self, layers: list[BudgetedLayer], plan: Plan) -> None:
        """Rank ``layers`` together (one selection for all of them) and compact them, one launch per device."""
        compact_arenas([layer.storage for layer in layers], *self._select(layers, plan))

    def _compact_each(self, layers: list[BudgetedLayer], plan: Plan, workspace: int | None = None) -> None:
        """Rank and compact each of ``layers`` on its own (per-layer selection), all layers of a device at once.

        The same selection as :meth:`_compact` of one layer at a time, batched: the masks, noise and top-k of
        every layer go through one set of ops with the layers stacked along the rows, and a scorer with a
        ``score_layers`` method scores them together. A static cache compacts every layer before its forward,
        so it can, and so does a growing one at the first layer of a forward; one op set instead of one per layer is
        what keeps a compaction step's host time small. ``workspace``: slots ranked in one go at most (default
        ``_SELECTION_WORKSPACE``).
        """
        first = layers[0].storage
        per_layer = first.keys.shape[0] * first.keys.shape[1] * plan.slots_before  # slots a layer ranks
        bound = _SELECTION_WORKSPACE if workspace is None else workspace
        chunk = max(1, bound // max(1, per_layer))  # layers ranked in one go: bounded workspace
        for _, same_device in itertools.groupby(layers, key=lambda layer: layer.storage.keys.device):
            same_device = list(same_device)
            for i in range(0, len(same_device), chunk):
                group = same_device[i : i + chunk]
                keep, start = self._select(group, plan, each=True)
                for layer, layer_keep in zip(group, keep):
                    compact_arenas([layer.storage], layer_keep, start)

    def _record_compaction(self, plan: Plan) -> None:
        """Per-row bookkeeping of a compaction (host only)."""
        if self._attachment is None and any(self._pads_host or ()):
            natural = tuple(max(0, pad - (plan.seen - plan.slots_after)) for pad in self._pads_host)
            if plan.holes_after != natural:  # the unmodified mask could not hide these holes
                raise ValueError(
                    "RopeKVCache was built from a config, so it cannot hide the rows' evicted slots in the "
                    "attention mask of a padded batch. Build it from the model instead: RopeKVCache(model, ...)."
                )
        for row in plan.evicting_rows:
            self._evicted_rows[row] = True
        self._holes = plan.holes_after
        self._holes_pads = self._pads_host

    def _check_batch(self, batch: int) -> None:
        if self._batch_size is None:
            self._batch_size = batch
            if len(self._evicted_rows) != batch:
                self._evicted_rows = [False] * batch
        elif batch != self._batch_size:
            raise ValueError(
                f"This RopeKVCache holds a batch of {self._batch_size} rows but got {batch}. A cache belongs to one "
                "batch: create a fresh RopeKVCache for every generate() call (or use hf_ropekv.enable(model, ...))."
            )

    def _begin_step(self, seen: int, q: int, key_states: torch.Tensor, args: tuple, kwargs: dict) -> None:
        self._refresh_padding(seen + q, q, key_states.device, args, kwargs)
        self._check_forward(seen, q)

    def _check_forward(self, seen: int, q: int) -> None:
        """Refusals that depend on the forward's size: eviction before a rollback, a pinned prompt over budget."""
        self._refuse_eviction_before_rollback(seen, q)
        if self._prompt_tokens is None:
            if q == 1 and seen > 0:
                self._prompt_tokens = seen  # first decoding step: the prompt is complete
            elif self.protect_prompt and self.budget is not None:
                real = seen + q - min(self._pads_host)
                if real > self.budget:
                    raise ValueError(
                        f"The prompt has {real} tokens but budget={self.budget}; a pinned prompt must fit in the "
                        f"budget. Raise `budget` to at least {real} plus room for the answer, or pass "
                        "`protect_prompt=False` to let prompt tokens be evicted too."
                    )

    def _refresh_padding(self, total: int, new: int, device: torch.device, args: tuple, kwargs: dict) -> None:
        if self._pads is not None and self._pads_total == total:
            return  # the model attachment saw this forward's attention mask
        if self._appends_real_token(total, new, self._batch_size):
            self._pads_total = total  # a decoding step: the positions go on from the padding already known
            return
        position_ids = _compat.position_ids_from_update(args, kwargs)
        if position_ids is not None:
            last = position_ids[..., -1].reshape(-1).to(device)
            self._pads = (total - 1 - last).clamp_min(0).expand(self._batch_size).clone()
            if self._pads_host is None or new > 1:
                self._pads_host = tuple(self._pads.tolist())
        elif self._pads is None or self._pads.shape[0] != self._batch_size:
            if self._batch_size > 1 and self._attachment is None:
                raise ValueError(
                    "RopeKVCache was built from a config and this transformers version does not tell the cache "
                    "where the left padding of a batch is. Build it from the model instead: "
                    "RopeKVCache(model, ...)."
                )
            self._pads = torch.zeros(self._batch_size, dtype=torch.long, device=device)
            self._pads_host = (0,) * self._batch_size
        self._pads_total = total

    def _select(
        self, layers: list[BudgetedLayer], plan: Plan, each: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score ``layers`` (all holding the same number of slots) and pick each row's survivors.

        Returns ``(keep, start)`` for :func:`~hf_ropekv.storage.paged.compact_arenas`: row ``b`` keeps
        ``plan.kept_after[b]`` real slots, right-aligned from ``start[b]``. By default the layers hold the same
        tokens and are ranked together (their scores averaged): ``keep`` is ``[B, H, K]``. With ``each``, every
        layer is ranked on its own, the layers stacked along the rows: ``keep`` is ``[L, B, H, K]``.
        """
        first = layers[0].storage
        device = first.keys.device
        seen, count = plan.seen, len(layers)
        pads = self._pads.to(device)
        holes = torch.tensor([plan.slots_before - k for k in plan.kept_before], device=device)
        window = self._window_for(plan, device)
        # [L, B, H, S], or [1, B, H, S] when the layers hold the same tokens and are ranked together.
        if each:
            slot_positions = torch.stack([layer.storage.live_positions() for layer in layers])
        else:
            slot_positions = first.live_positions()[None]
        rows = slot_positions.shape[0]  # rankings made side by side
        flat_positions = slot_positions.flatten(0, 1)
        guards = Guards(
            pinned=self._pinned_tokens(seen),
            sink=self.sink,
            window=window.repeat(rows) if isinstance(window, torch.Tensor) else window,
        )
        row_pads = pads.repeat(rows)
        is_hole, protected = slot_masks(flat_positions, holes.repeat(rows), row_pads, seen, guards)
        candidates = (~(is_hole | protected)).view(slot_positions.shape)
        position = seen - pads
        self._prepare_scorer()
        scores = self._score(layers, position, seen, candidates, is_hole.view(slot_positions.shape))
        if not each:  # one ranking for all layers: their mean score (summed in layer order)
            total = scores[0]
            for layer_scores in scores[1:]:
                total = total + layer_scores
            scores = (total / count)[None]
        # Tie-break noise that depends on the token (real index) and head only, never on the batch.
        heads = torch.arange(flat_positions.shape[1], device=device).view(1, -1, 1)
        noise = hashed_uniform(self.seed, flat_positions - row_pads.view(-1, 1, 1), heads)
        # A row whose left padding reaches into this forward's tokens has a negative count (its holes then cover
        # them); it keeps no stored token.
        targets = torch.tensor(plan.kept_after, device=device).clamp_min(0)
        keep, start = select_keep(scores.flatten(0, 1), is_hole, protected, targets.repeat(rows), plan.slots_after,
                                  noise)
        keep = keep.view(rows, *slot_positions.shape[1:3], keep.shape[-1])
        return (keep if each else keep[0]), start[: targets.shape[0]]

    def _score(
        self,
        layers: list[BudgetedLayer],
        position: torch.Tensor,
        seen: int,
        candidates: torch.Tensor,
        is_hole: torch.Tensor,
    ) -> torch.Tensor:
        """float32 ``[L, B, H, S]`` scores of ``layers`` on the first layer's device.

        ``candidates`` and ``is_hole`` are ``[L, B, H, S]``, or ``[1, B, H, S]`` when every layer holds the same
        tokens. A scorer with ``score_layers`` gets every layer in one call.
        """
        device = layers[0].storage.keys.device
        contexts = []
        for i, layer in enumerate(layers):
            storage = layer.storage
            layer_device = storage.keys.device
            j = i if candidates.shape[0] > 1 else 0
            contexts.append(ScoreContext(
                layer_idx=layer.layer_idx,
                position=position.to(layer_device),
                tokens_seen=seen,
                slot_positions=storage.live_positions(),
                candidates=candidates[j].to(layer_device),
                **self._query_fields(layer.layer_idx, is_hole[j], layer_device),
            ))
        keys = [layer.storage.live_keys() for layer in layers]
        score_layers = getattr(self.scorer, "score_layers", None)
        if score_layers is not None and len(keys) > 1 and all(k.device == device for k in keys):
            scores = score_layers(keys, contexts)
        else:
            scores = torch.stack([self.scorer.score(k, ctx).to(device, torch.float32) for k, ctx in zip(keys, contexts)])
        if self._queries is not None:
            for layer in layers:
                self._queries.compacted(layer.layer_idx)
        return scores.float()

    def _window_for(self, plan: Plan, device: torch.device) -> int | torch.Tensor:
        """The recent window each row protects: the one asked for, or the default cut to what the budget
        leaves beside the row's pinned prompt and sink (per row, ``[B]``)."""
        if not self._auto_window or not self.window:
            return self.window
        pinned = self._pinned_tokens(plan.seen)
        pads = self._pads_host or (0,) * len(plan.kept_after)
        room = [max(0, target - max(0, pinned - pad) - self.sink) for target, pad in zip(plan.kept_after, pads)]
        return torch.tensor([min(self.window, r) for r in room], device=device)

    def _query_fields(self, layer_idx: int, is_hole: torch.Tensor, device: torch.device) -> dict[str, Any]:
        """The ``ScoreContext`` fields of an attention-based scorer (empty for the others)."""
        if self._queries is None:
            return {}
        queries, positions, new = self._queries.take(layer_idx)
        return dict(
            queries=queries, query_positions=positions, new_queries=new, valid=~is_hole.to(device),
            attention_scale=self._queries.scales[layer_idx],
        )

    def _pinned_tokens(self, seen: int) -> int:
        if not self.protect_prompt:
            return 0
        return self._prompt_tokens if self._prompt_tokens is not None else seen

    # ------------------------------------------------------------------ scorer resolution
    def _resolve_scorer(self, scorer: Scorer | None, stats: Any, model: nn.Module | None) -> Scorer:
        self._online = None
        if scorer is not None:
            if not callable(getattr(scorer, "score", None)):
                raise TypeError(
                    f"scorer must have a `score(keys, ctx)` method (see hf_ropekv.scorers); got {type(scorer).__name__}."
                )
            if stats is not None:
                raise ValueError("Pass `stats` to the FrequencyScorer you build, or omit `scorer`; not both.")
            return scorer
        from ..scorers.frequency import FrequencyScorer

        if stats is not None:
            from ..statistics.frequency_stats import FrequencyStats

            return FrequencyScorer(FrequencyStats.resolve(stats, self.geometry, model))
        if self.budget is None:
            return FrequencyScorer(None)  # never called: nothing is evicted
        if model is None:
            raise ValueError(
                "The default RoPE scorer needs query statistics: pass the model (RopeKVCache(model, ...)) so they "
                "are gathered from the prompt, or stats=FrequencyStats/path from hf_ropekv.calibrate, or another "
                "scorer (hf_ropekv.scorers)."
            )
        from ..statistics.online import OnlineStatistics

        self._online = OnlineStatistics(self.geometry, half_life=self.stats_half_life)
        return FrequencyScorer(None)

    def _query_window(self, model: nn.Module | None) -> "QueryWindow | None":
        """Recent queries for a scorer that asks for them (``query_window``); they need the model's hooks."""
        window = getattr(self.scorer, "query_window", None)
        if window is None or self.budget is None:
            return None
        if model is None:
            raise ValueError(
                f"{type(self.scorer).__name__} recomputes attention from the model's queries: build the cache from "
                "the model (RopeKVCache(model, ...)), not from its config."
            )
        from ..scorers.query_window import QueryWindow

        return QueryWindow(self.geometry, window)

    def _prepare_scorer(self) -> None:
        if self._online is not None:
            self.scorer.stats = self._online.snapshot()


#: Slots (layers x rows x KV heads x slots) one batched per-layer selection ranks at most, whatever the batch: its
#: temporaries (per-query-head float32 scores and their z-scores, int64 positions and sort indices, masks) then
#: stay under about 1 GiB.
_SELECTION_WORKSPACE = 1 << 23
#: The same bound for a growing (eager) cache, a quarter of it: its compaction used to rank one layer at a time, and
#: a user near the end of a small card's memory should not meet a new gigabyte of temporaries. It still ranks every
#: layer of a batch-1 Qwen3-8B (36 x 8 heads x 2,176 slots) in one go.
_EAGER_SELECTION_WORKSPACE = 1 << 21

#: The default recent window: what measured best on GSM8K (README, "Quality"), capped for small budgets.
DEFAULT_WINDOW = 32


def default_window(window: int | None, budget: int | None) -> int:
    """The recent window a cache uses: ``window`` if given, else ``min(32, budget // 4)`` (0 without a budget)."""
    if window is not None:
        return window
    return 0 if budget is None else min(DEFAULT_WINDOW, budget // 4)


def _check_sliding_windows(geometry: ModelGeometry, budget: int | None) -> None:
    """Sliding layers read the last ``window`` columns of the same mask as the full layers, where rows with
    fewer real tokens than the longest have holes; a budget of at least the window keeps them out of reach."""
    windows = [w for kind, w in zip(geometry.layer_types, geometry.sliding_windows) if kind == SLIDING and w]
    if budget is not None and windows and FULL in geometry.layer_types and budget < max(windows):
        raise ValueError(
            f"budget={budget} is smaller than the sliding window ({max(windows)}) of '{geometry.model_type}''s "
            f"sliding-window layers. Use budget >= {max(windows)}: the full-attention layers then always keep at "
            "least as many tokens as a window holds."
        )


def _check_static(geometry: ModelGeometry, budget: int | None, model_or_config: Any) -> None:
    """What ``static=True`` needs: a budget (the arena's size), the model (its hooks prepare each forward) and
    full-attention layers only."""
    if budget is None:
        raise ValueError("static=True needs a budget: the fixed arena holds budget + compress_every slots per layer.")
    if not isinstance(model_or_config, nn.Module):
        raise ValueError(
            "static=True needs the model, not its config: RopeKVCache(model, budget=..., static=True). The cache "
            "prepares every forward (compaction, slots, mask) from the model's hooks before the compiled step runs."
        )
    if SLIDING in geometry.layer_types:
        raise ValueError(
            f"static=True does not support '{geometry.model_type}': it has sliding-window layers, which the static "
            "cache does not hold yet. Use static=False (the default) for this model."
        )


def _check_options(
    budget: int | None, compress_every: int, page_size: int, window: int, sink: int, selection: str
) -> None:
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValueError(f"budget must be a positive int (tokens to keep) or None (never evict); got {budget!r}.")
    if not isinstance(compress_every, int) or compress_every < 1:
        raise ValueError(f"compress_every must be a positive int; got {compress_every!r}.")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int; got {page_size!r}.")
    if window < 0 or sink < 0:
        raise ValueError(f"window and sink must be >= 0; got window={window}, sink={sink}.")
    if budget is not None and window + sink >= budget:
        raise ValueError(
            f"window ({window}) + sink ({sink}) must be smaller than budget ({budget}), or nothing is left to choose."
        )
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}; got {selection!r}.")
