"""RopeKVCache: a budgeted, paged ``transformers.Cache`` that ``generate()`` accepts unchanged."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer
from transformers.utils import logging

from . import _compat
from .layers import CANNOT_CROP, CROPPABLE_FIX, BudgetedLayer
from .model_info import FULL, ModelGeometry, describe
from .scorers.base import ScoreContext, Scorer
from .selection import Guards, select_keep, slot_masks
from .storage import PagedKV, compact_arenas

logger = logging.get_logger(__name__)

SELECTIONS = ("global", "per_layer")


class RopeKVCache(Cache):
    """A KV cache that keeps at most ``budget + compress_every`` tokens per full-attention layer.

    When a full-attention layer would hold more than ``budget + compress_every`` tokens, the cache scores
    the kept keys, keeps the best ``budget`` per (row, KV head) and compacts them in place. Sliding-window
    layers stay plain windows. With ``budget=None`` nothing is ever evicted and outputs equal
    ``DynamicCache``'s.

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
        window: most recent tokens never evicted.
        sink: first tokens of each row never evicted (StreamingLLM's attention sinks).
        protect_prompt: pin every token received before the first single-token (decoding) step; the prompt
            counts toward the budget and must fit in it.
        scorer: the eviction policy (see ``hf_ropekv.scorers``); default: RoPE frequency scoring.
        stats: query statistics for the RoPE scorer (``FrequencyStats`` or a path); ``None`` gathers them
            online from the queries of every multi-token forward (the prompt, later user turns; needs the
            model). A forward's queries count from the next forward on.
        selection: ``"global"`` ranks once per (row, KV head) with scores averaged over layers (the paper's
            operating point); ``"per_layer"`` lets every layer rank its own keys.
        seed: seed of the tie-breaking noise (and of the random scorer's default).
    """

    def __init__(
        self,
        model_or_config: PreTrainedModel | PretrainedConfig,
        budget: int | None = None,
        *,
        compress_every: int = 128,
        page_size: int = 64,
        window: int = 0,
        sink: int = 0,
        protect_prompt: bool = True,
        scorer: Scorer | None = None,
        stats: Any = None,
        selection: str = "global",
        seed: int = 0,
    ) -> None:
        _check_options(budget, compress_every, page_size, window, sink, selection)
        self.geometry: ModelGeometry = describe(model_or_config)
        self.budget = budget
        self.compress_every = compress_every
        self.page_size = page_size
        self.window = window
        self.sink = sink
        self.protect_prompt = protect_prompt
        self.selection = selection
        self.seed = seed

        hint = None if budget is None else budget + compress_every
        layers: list[Any] = []
        for idx, (kind, sliding_window) in enumerate(zip(self.geometry.layer_types, self.geometry.sliding_windows)):
            if kind == FULL:
                layers.append(BudgetedLayer(self, idx, PagedKV(page_size, capacity_hint=hint)))
            else:
                layers.append(DynamicSlidingWindowLayer(sliding_window=sliding_window))
        super().__init__(layers=layers)
        self._full_layers = [layer for layer in self.layers if isinstance(layer, BudgetedLayer)]

        model = model_or_config if isinstance(model_or_config, nn.Module) else None
        self.scorer = self._resolve_scorer(scorer, stats, model)
        self._attachment = None
        if model is not None:
            from .attach import ModelAttachment  # local: attach imports this module

            self._attachment = ModelAttachment(model, self, collect_queries=self._online is not None)

        self._batch_size: int | None = None
        self._pads: torch.Tensor | None = None  # left padding per row among the tokens seen + new
        self._pads_total = -1  # token count the current `_pads` describes
        self._prompt_tokens: int | None = None  # pinned prompt length once decoding started
        self._generator: torch.Generator | None = None

    # ------------------------------------------------------------------ public introspection
    @property
    def tokens_seen(self) -> int:
        """Tokens per row the model has processed (padding included): what ``get_seq_length`` returns."""
        return self.get_seq_length()

    @property
    def tokens_kept(self) -> int:
        """Tokens per row, KV head and full-attention layer currently held."""
        return self._full_layers[0].tokens_kept if self._full_layers else self.tokens_seen

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
        """Whether any token was evicted (then ``crop`` is no longer possible)."""
        return any(layer.tokens_seen != layer.tokens_kept for layer in self._full_layers)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model_type={self.geometry.model_type!r}, budget={self.budget}, "
            f"compress_every={self.compress_every}, scorer={type(self.scorer).__name__}, "
            f"selection={self.selection!r}, seen={self.tokens_seen}, kept={self.tokens_kept}, "
            f"pages={self.pages_in_use}/{self.pages_allocated}, bytes={self.bytes_held}, "
            f"compactions={self.num_compactions})"
        )

    # ------------------------------------------------------------------ the compaction plan
    def planned_kept(self, kept: int, query_length: int) -> int:
        """Tokens a full-attention layer holding ``kept`` keeps before appending ``query_length`` new ones.

        A pure function of the cache state: the mask (built before any layer runs) and the layers' updates
        both call it, so they always agree.
        """
        if self.budget is None or kept + query_length <= self.budget + self.compress_every:
            return kept
        target = self.budget - max(0, query_length - self.compress_every)
        return max(0, min(kept, target))

    # ------------------------------------------------------------------ transformers hooks
    def reset(self) -> None:
        super().reset()
        self._batch_size = None
        self._pads, self._pads_total = None, -1
        self._prompt_tokens = None
        self._rollback_expected = False
        if self._online is not None:
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
        if self.evicted:
            raise ValueError(CANNOT_CROP)
        super().activate_past_recording()
        self._rollback_expected = True

    def _refuse_eviction_before_rollback(self, seen: int, kept: int, q: int) -> None:
        """In a rolling-back decoding mode, raise the "cannot crop" error instead of evicting.

        Assisted decoding sends the prompt and then each draft as multi-token forwards; the prompt-pinning check
        would take them all for prompt and fail first with a misleading message.
        """
        if not self._rollback_expected or self.budget is None:
            return
        real = seen + q - int(self._pads.min())
        pins_too_much = self._prompt_tokens is None and self.protect_prompt and real > self.budget
        if pins_too_much or self.planned_kept(kept, q) < kept:
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
        if self._pads is not None:
            self._pads = self._pads.index_select(0, beam_idx.to(self._pads.device))
        if self._attachment is not None:
            self._attachment.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._batch_size = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._batch_size = None

    # ------------------------------------------------------------------ called by the model attachment
    def _observe_padding(self, attention_mask: torch.Tensor) -> None:
        """Record left padding from generate's 2-D attention mask (covers tokens seen + new)."""
        self._pads = (attention_mask == 0).sum(-1)
        self._pads_total = attention_mask.shape[-1]

    # ------------------------------------------------------------------ called by BudgetedLayer.update
    def _before_layer_update(self, layer: BudgetedLayer, key_states: torch.Tensor, args: tuple, kwargs: dict) -> None:
        seen, kept, q = layer.tokens_seen, layer.storage.length, key_states.shape[-2]
        self._check_batch(key_states.shape[0])
        if layer is self._full_layers[0]:
            self._begin_step(seen, q, key_states, args, kwargs)
        target = self.planned_kept(kept, q)
        if target >= kept:
            return
        if self.selection == "per_layer":
            layer.storage.compact(self._select([layer], seen, target))
        else:
            # One ranking for all layers: compact them all now, in one launch per device. Safe here: this is
            # the first layer of the forward, so no tensor returned in this forward aliases any arena yet.
            keep = self._select(self._full_layers, seen, target)
            compact_arenas([full.storage for full in self._full_layers], keep)

    def _check_batch(self, batch: int) -> None:
        if self._batch_size is None:
            self._batch_size = batch
        elif batch != self._batch_size:
            raise ValueError(
                f"This RopeKVCache holds a batch of {self._batch_size} rows but got {batch}. A cache belongs to one "
                "batch: create a fresh RopeKVCache for every generate() call (or use hf_ropekv.enable(model, ...))."
            )

    def _begin_step(self, seen: int, q: int, key_states: torch.Tensor, args: tuple, kwargs: dict) -> None:
        self._refresh_padding(seen + q, key_states.device, args, kwargs)
        self._refuse_eviction_before_rollback(seen, self._full_layers[0].storage.length, q)
        if self._prompt_tokens is None:
            if q == 1 and seen > 0:
                self._prompt_tokens = seen  # first decoding step: the prompt is complete
            elif self.protect_prompt and self.budget is not None:
                real = seen + q - int(self._pads.min())
                if real > self.budget:
                    raise ValueError(
                        f"The prompt has {real} tokens but budget={self.budget}; a pinned prompt must fit in the "
                        f"budget. Raise `budget` to at least {real} plus room for the answer, or pass "
                        "`protect_prompt=False` to let prompt tokens be evicted too."
                    )

    def _refresh_padding(self, total: int, device: torch.device, args: tuple, kwargs: dict) -> None:
        if self._pads is not None and self._pads_total == total:
            return  # the model attachment saw this forward's attention mask
        position_ids = _compat.position_ids_from_update(args, kwargs)
        if position_ids is not None:
            last = position_ids[..., -1].reshape(-1).to(device)
            self._pads = (total - 1 - last).clamp_min(0).expand(self._batch_size).clone()
        elif self._pads is None or self._pads.shape[0] != self._batch_size:
            if self._batch_size > 1 and self._attachment is None:
                raise ValueError(
                    "RopeKVCache was built from a config and this transformers version does not tell the cache "
                    "where the left padding of a batch is. Build it from the model instead: "
                    "RopeKVCache(model, ...)."
                )
            self._pads = torch.zeros(self._batch_size, dtype=torch.long, device=device)
        self._pads_total = total

    def _select(self, layers: list[BudgetedLayer], seen: int, target: int) -> torch.Tensor:
        """Score ``layers`` (all holding the same tokens), average their scores, keep the best ``target``."""
        first = layers[0].storage
        device = first.keys.device
        pads = self._pads.to(device)
        guards = Guards(pinned=self._pinned_tokens(seen), sink=self.sink, window=self.window)
        is_pad, protected = slot_masks(first.live_positions(), pads, seen, guards)
        candidates = ~(is_pad | protected)
        position = seen - pads
        self._prepare_scorer()
        total = None
        for layer in layers:
            storage = layer.storage
            layer_device = storage.keys.device
            ctx = ScoreContext(
                layer_idx=layer.layer_idx,
                position=position.to(layer_device),
                tokens_seen=seen,
                slot_positions=storage.live_positions(),
                # In global mode every layer kept the same slots, so one mask serves all of them.
                candidates=candidates.to(layer_device),
            )
            scores = self.scorer.score(storage.live_keys(), ctx).to(device, torch.float32)
            total = scores if total is None else total + scores
        total = total / len(layers)
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return select_keep(total, is_pad, protected, target, self._generator)

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
        from .scorers.frequency import FrequencyScorer

        if stats is not None:
            from .stats import FrequencyStats

            return FrequencyScorer(FrequencyStats.resolve(stats, self.geometry, model))
        if self.budget is None:
            return FrequencyScorer(None)  # never called: nothing is evicted
        if model is None:
            raise ValueError(
                "The default RoPE scorer needs query statistics: pass the model (RopeKVCache(model, ...)) so they "
                "are gathered from the prompt, or stats=FrequencyStats/path from hf_ropekv.calibrate, or another "
                "scorer (hf_ropekv.scorers)."
            )
        from .online import OnlineStatistics

        self._online = OnlineStatistics(self.geometry)
        return FrequencyScorer(None)

    def _prepare_scorer(self) -> None:
        if self._online is not None:
            self.scorer.stats = self._online.snapshot()


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
