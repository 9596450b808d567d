"""RopeKVCache: a budgeted, paged ``transformers.Cache`` that ``generate()`` accepts unchanged.

A thin composition: ``options`` (validated once), ``rows`` (per-row bookkeeping), ``coordinator`` (the plan and the
one prologue of every forward, the layers' only link to the cache), ``eviction.compactor`` (scoring, selection,
compaction) and, for ``static=True``, ``static`` (the driver that prepares each forward before it runs).
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.configuration_utils import PretrainedConfig

from ..eviction.compactor import Compactor
from ..hooks.attach import ModelAttachment
from ..model.geometry import ModelGeometry, describe, shared_geometry
from ..scorers.base import Scorer
from ..storage.buffers import BufferLease, BufferPool, step_is_recorded
from .forward import ForwardCoordinator
from . import auto_static, footprint
from .layers import CANNOT_CROP, BudgetedLayer, make_layers
from .masks import mask_for_forward, window_positions, with_holes
from .model_checks import check_sliding_windows, check_static
from .options import DEFAULT_HEAD_SHRINK, CacheOptions
from .rows import BatchRows
from .scorer_setup import query_window, resolve_scorer
from .static import StaticForwardDriver
from .window import StaticWindowLayer

if TYPE_CHECKING:  # importing it at run time loads transformers' model-loading code
    from transformers import PreTrainedModel


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
        page_size: slots per storage page; capacity grows in whole pages up to ``budget + compress_every``.
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
        learn_workload: with online statistics, feed every finished forward's real queries into the model's
            workload statistics (``hf_ropekv.workload_statistics(model)``) and start each row's statistics from
            what earlier caches of the model taught them (README, "Workload statistics"). ``False`` (for now the
            default): neither. Caches with ``stats=`` or another scorer never take part.
        prior_tokens: the weight of the workload prior, in queries (a pseudo-count that never decays); taken
            when the cache is built. 0 ignores it (the cache still feeds the workload).
        stats_prompt_weight: with online statistics, what the prompt's queries (every forward before the first
            decoding step) weigh against the generation's once a decoding step has counted; 0 leaves them out,
            and then the workload learns no prompt either. On GSM8K's tune split a prior learned without prompts
            gained 9 problems of 150, but on the report split it was level (150 against 148 of 300) and 0 lost
            15 problems cold (README, "Quality"): the default stays 1.
        stats_head_shrink: with online statistics, a pseudo-count in queries pulling each query head's means
            toward the average of its layer's heads: ``(sums_h + k * layer_mean) / (count_h + k)``. A few
            queries per head are a noisy estimate, the layer's heads together a steadier one; with the default
            half-life a row counts at most ~185 queries, so 256 keeps more than half the weight on the layer
            average for good. 256 (the default) took GSM8K at G = 48 from 0.86 to 0.96 of the full cache's
            accuracy on held-out problems (README, "Quality"); 0 scores every head on its own (the default until
            2026-12-03). Statistics from ``stats=`` or the workload prior are never shrunk.

        selection: ``"per_layer"`` lets every layer rank its own keys; ``"global"`` ranks once per (row, KV
            head) with scores averaged over layers (the paper's operating point).
        seed: seed of the tie-breaking noise (and of the random scorer's default).
        static: keep every full-attention layer in a fixed arena of ``budget + compress_every`` slots (whole pages)
            allocated once at a static address, and decide everything before each forward, so the decode step
            has static shapes and reads no host counter: ``is_compileable`` is then True, ``generate()``
            compiles the decode step on CUDA by itself (CUDA graphs), and
            ``model.forward = torch.compile(model.forward, mode="reduce-overhead")`` works too. Compaction runs
            eagerly between two compiled steps. Same tokens kept as ``static=False`` (tested). Sliding-window
            layers become transformers' static sliding-window layers (``hf_ropekv.cache.window``). Needs a budget
            and the model; not for scorers that recompute attention (SnapKV, H2O, R-KV: refused). ``False``: a
            growing cache, always eager. ``"auto"`` (the default): eager, unless ``generate()`` would compile on
            CUDA a generation long enough to pay back the static step's warm-up (``auto_static``: 64 new tokens where
            the steps replay CUDA graphs, the default on one GPU; 1,024 where they compile), with a cache that can be
            static; then static. ``cache.static`` says which it is, ``cache.static_reason`` why; the decision is
            logged once at INFO level.
        dynamic_batch: for a static cache, whether the compiled decode step's batch dimension is dynamic. ``True``:
            one compilation serves every batch size (an eval loop whose last batch is smaller does not compile
            again), but a symbolic batch lengthens the warm-up (H200, Qwen3-8B shape, batch 1, three leases: cold
            64.9-100.4 s against 35.9-61.1 s, 1.6-2.6x within a lease; 16.5-19.4 against 8.1-13.5 s in a second
            process, 1.2-2.4x; README "Warm-up and shipping the compile cache"). ``False``: compiled for the first
            batch size the step sees; a later size compiles again (torch then makes the dimension dynamic by itself,
            so at most once more, and batch 1 separately). ``"auto"``
            (the default): static while the model's compiled steps have had one row (a notebook, a batch-1
            server: the short warm-up), dynamic from its first compiled step of more rows on (an eval loop
            compiles once for all its batch sizes). Only a process that compiles batch 1 first and then a larger
            batch compiles twice.
        cuda_graphs: how a static cache's decode steps run where ``generate()`` would call its compiled forward.
            ``True``: without compiling: the cache's first decode step runs eagerly and is captured as a CUDA graph,
            and later steps replay it (``hf_ropekv.hooks.graphed_step``). No compile warm-up (the capture took
            0.12-0.15 s on an H200 against 8-60 s of compile for a Qwen3-8B shape), the tokens of the eager static
            cache, steps about 9 % slower than compiled ones (13.5 against 12.6 ms at batch 1). Off CUDA, for a
            model over several devices or ranks, or where a capture fails, the steps run eagerly (one warning).
            Needs ``static=True`` or ``"auto"``. ``False``: generate compiles them (``torch.compile``).
            ``"auto"`` (the default): graphs for a ``static="auto"`` cache whose model is on one CUDA device and
            one rank, compiled otherwise (an explicit ``static=True`` included). ``cache.cuda_graphs`` says which.

    The defaults (per-layer selection, a recent window of 32, online statistics with a half-life of 128, shrunk
    toward the layer's head average by 256 queries) are the best of the variants measured on free-running GSM8K
    reasoning (README, "Quality"); the paper's operating point is ``selection="global", window=0,
    stats_half_life=None, stats_head_shrink=0``. Options are validated together
    (:class:`~hf_ropekv.cache.options.CacheOptions`) before any is used.
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
        static: bool | str = "auto",
        learn_workload: bool = False,
        prior_tokens: float = 512,
        stats_prompt_weight: float = 1.0,
        stats_head_shrink: float = DEFAULT_HEAD_SHRINK,
        dynamic_batch: bool | str = "auto",
        cuda_graphs: bool | str = "auto",
    ) -> None:
        options = CacheOptions(budget, compress_every, page_size, window, sink, protect_prompt, selection, seed,
                               stats_half_life, static, learn_workload, prior_tokens,
                               stats_prompt_weight, stats_head_shrink, dynamic_batch,
                               cuda_graphs)  # validated before any is used
        self.options = options
        self.geometry: ModelGeometry = describe(model_or_config)
        if isinstance(model_or_config, nn.Module):
            self.geometry = shared_geometry(model_or_config, self.geometry)
        check_sliding_windows(self.geometry, budget)
        if static is True:
            check_static(self.geometry, budget, model_or_config, scorer)

        super().__init__(layers=[])  # the layers are assembled below (_assemble), once the coordinator exists
        model = model_or_config if isinstance(model_or_config, nn.Module) else None
        self.scorer, self._online = resolve_scorer(scorer, stats, options, self.geometry, model)
        self._queries = query_window(self.scorer, options, self.geometry, model)
        self.rows = BatchRows()
        compactor = Compactor(self.scorer, per_layer=selection == "per_layer", sink=sink, window=self.window,
                              auto_window=options.auto_window, seed=seed, online=self._online, queries=self._queries)
        #: The plan and prologue of every forward: what the full-attention layers ask (their only link to the cache).
        self.coordinator = ForwardCoordinator(options, [], self.rows, compactor,
                                              None if model is None else type(model).__name__)
        self._model_ref = None if model is None else weakref.ref(model)
        self._lease: BufferLease | None = None
        self._static_driver: StaticForwardDriver | None = None
        self._attachment = None
        self._static_pending = False  # an "auto" cache that generate() has not asked about yet
        self._static_reason = f"static={static}"
        # whether static decode steps replay CUDA graphs: an "auto" cache's is settled with its mode (auto_static)
        self._cuda_graphs_now = options.cuda_graphs is True
        if static == "auto":
            unsupported = auto_static.unsupported_reason(self, model)
            self._static_pending = unsupported is None
            self._static_reason = auto_static.PENDING if unsupported is None else "auto: " + unsupported
        self._assemble(static is True)
        if static == "auto" and not self._static_pending:
            auto_static.log_decision(self)

    def _assemble(self, static: bool) -> None:
        """Build the layers, and what depends on whether they are static (the buffer lease, the static driver,
        the model attachment), for a cache that holds nothing yet. ``static="auto"`` assembles growing layers
        first and again, static, once ``generate()`` decided to compile (``auto_static.decide``)."""
        # static=True was checked in __init__; an "auto" cache goes static only where auto_static found it can
        options, model = self.options, None if self._model_ref is None else self._model_ref()
        lease = self._lease
        if static and lease is None:
            lease = BufferLease(self, BufferPool.of(model))
        self._lease = lease if static else None
        self.layers = make_layers(self, self.geometry, options, self._lease, static)
        self._full_layers = [layer for layer in self.layers if isinstance(layer, BudgetedLayer)]
        self.coordinator.full_layers = self._full_layers
        self._static_now = static
        self._static_driver = (
            StaticForwardDriver(self.coordinator, self._lease, options.page_size, len(self.layers),
                                [layer for layer in self.layers if isinstance(layer, StaticWindowLayer)])
            if static else None
        )
        previous = self._attachment
        if model is not None:
            collect = self._online is not None or self._queries is not None
            self._attachment = ModelAttachment(model, self, collect_queries=collect)
            if self._queries is not None:
                modules = self._attachment.attention_modules
                self._queries.scales = [getattr(module, "scaling", None) for module in modules]
        if previous is not None:  # after the new one is on: the model's shared hooks never go in between
            previous.remove()

    def _settle(self, static: bool, reason: str) -> None:
        """An ``"auto"`` cache's decision (``auto_static``): taken once, logged once."""
        self._static_pending = False
        self._static_reason = reason
        auto_static.log_decision(self)

    def _auto_compile_criteria(self, criteria: Any, model_kwargs: dict, generation_config: Any) -> bool:
        """generate() asks whether it may compile its forward (``hooks.generate_methods`` wraps the question): an
        ``"auto"`` cache not settled yet decides its mode here (``auto_static.decide``)."""
        if not self._static_pending:
            return criteria(model_kwargs, generation_config)
        model = None if self._model_ref is None else self._model_ref()
        return auto_static.decide(self, model, criteria, model_kwargs, generation_config)

    # ------------------------------------------------------------------ options (read-only)
    budget = property(lambda self: self.options.budget, doc="Tokens kept per row, KV head and layer; None: all.")
    compress_every = property(lambda self: self.options.compress_every)
    page_size = property(lambda self: self.options.page_size)
    window = property(lambda self: self.options.recent_window, doc="Most recent tokens never evicted.")
    sink = property(lambda self: self.options.sink)
    protect_prompt = property(lambda self: self.options.protect_prompt)
    selection = property(lambda self: self.options.selection)
    seed = property(lambda self: self.options.seed)
    stats_half_life = property(lambda self: self.options.stats_half_life)
    @property
    def static(self) -> bool:
        """Whether the cache is static now (a fixed arena, compileable): ``static=True``, or ``"auto"`` once
        ``generate()`` decided to compile (``options.static`` keeps what was asked)."""
        return self._static_now

    @property
    def cuda_graphs(self) -> bool:
        """Whether this cache's static decode steps replay CUDA graphs of the eager step (``hooks.graphed_step``)
        where ``generate()`` would call its compiled forward: ``cuda_graphs=True``, or the default ``"auto"`` once
        ``static="auto"`` made the cache static on one CUDA device (``options.cuda_graphs`` keeps what was asked)."""
        return self._cuda_graphs_now

    @property
    def static_reason(self) -> str:
        """Why the cache is static or not, in a few words (``"static=True"``, or an ``"auto"`` cache's decision)."""
        return self._static_reason

    learn_workload = property(lambda self: self.options.learn_workload)
    prior_tokens = property(lambda self: self.options.prior_tokens)
    stats_prompt_weight = property(lambda self: self.options.stats_prompt_weight)
    stats_head_shrink = property(lambda self: self.options.stats_head_shrink)
    dynamic_batch = property(lambda self: self.options.dynamic_batch)

    @property
    def workload_prior_tokens(self) -> int:
        """Tokens the model's workload statistics held when this cache was built and took them as its prior (0:
        no prior: a fresh model, ``learn_workload=False``, ``prior_tokens=0``, or not online statistics)."""
        prior = None if self._online is None else self._online.prior
        return 0 if prior is None else prior.tokens

    @property
    def workload_prior_frozen(self) -> bool:
        """Whether the workload statistics had stopped learning when this cache took its prior from them."""
        prior = None if self._online is None else self._online.prior
        return prior is not None and prior.frozen

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
    def batch_size(self) -> int | None:
        """Rows of the batch this cache holds (None before its first forward)."""
        return self.rows.batch_size

    @property
    def tokens_kept_per_row(self) -> tuple[int, ...]:
        """Real tokens each batch row holds (padding and holes excluded)."""
        slots = self.tokens_kept
        return tuple(slots - hole for hole in self.rows.current_holes())

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """int64 ``[batch, kv_heads, kept]``: the token index (padding included, as in generate's ``input_ids``) held
        by each slot of layer ``layer_idx``, in slot order, ``-1`` where a row has a hole (its left padding, or room
        left by a compaction). Full-attention layers hold the tokens they kept; sliding-window layers their window.
        """
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx must be in [0, {len(self.layers)}); got {layer_idx}.")
        layer = self.layers[layer_idx]
        holes = self.rows.current_holes()
        if not isinstance(layer, BudgetedLayer):
            return window_positions(layer, self.rows.pads_host, len(holes))
        return with_holes(layer.storage.live_positions().clone(), holes)

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
        return footprint.bytes_held(self.layers)

    @property
    def full_cache_bytes(self) -> int:
        """Bytes a ``DynamicCache(config=...)`` would hold for the same tokens (for comparison)."""
        return footprint.dynamic_cache_bytes(self.layers, self.geometry, self.tokens_seen)

    @property
    def evicted(self) -> bool:
        """Whether any real token was evicted (then ``crop`` is no longer possible)."""
        return any(self.rows.evicted)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model_type={self.geometry.model_type!r}, budget={self.budget}, "
            f"compress_every={self.compress_every}, scorer={type(self.scorer).__name__}, "
            f"selection={self.selection!r}, seen={self.tokens_seen}, kept={self.tokens_kept}, "
            f"pages={self.pages_in_use}/{self.pages_allocated}, bytes={self.bytes_held}, "
            f"compactions={self.num_compactions}{self._workload_repr()})"
        )

    def _workload_repr(self) -> str:
        if not self.workload_prior_tokens:
            return ""
        state = "frozen" if self.workload_prior_frozen else "learning"
        return f", workload_prior={self.workload_prior_tokens} tokens ({state})"

    # ------------------------------------------------------------------ transformers hooks
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> Any:
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"This RopeKVCache holds {len(self.layers)} layers ({self.geometry.model_type}) but a model with more "
                f"layers updates layer {layer_idx}. A cache is bound to its model: build one per model."
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.rows = self.coordinator.rows = BatchRows()
        self.coordinator.reset()
        if self._static_driver is not None:
            self._static_driver.reset()
        if self._queries is not None:
            self._queries.reset()
        self.coordinator.rollback_expected = False
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
        coordinator = self.coordinator
        if coordinator.prompt_tokens is not None and coordinator.prompt_tokens > seen:
            coordinator.prompt_tokens = seen  # the rollback reached into the pinned prompt
        if self._attachment is not None:
            self._attachment.truncate(seen)

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Called by generate before a decoding mode that rolls the cache back (assisted/speculative decoding).

        From then on the cache refuses, with the "cannot crop" error, any forward that would evict or pin more
        than ``budget`` tokens; a cache that already evicted refuses here.
        """
        if not all(layer.is_croppable for layer in self._full_layers):
            raise ValueError(CANNOT_CROP)
        super().activate_past_recording(**kwargs)  # (transformers 5.25 passes recurrent_states_to_keep=)
        self.coordinator.rollback_expected = True

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
        self.rows.batch_size = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        rows = len(self.rows.evicted) or (self.rows.batch_size or 0)
        self._select_rows(torch.arange(rows).repeat_interleave(repeats))  # repeating rows = selecting them again
        self.rows.batch_size = None

    def _select_rows(self, index: torch.Tensor) -> None:
        """Rows were reordered, selected or repeated: follow them in every per-row state of the cache."""
        self.rows.select(index)
        self.coordinator.plan = None
        if self._queries is not None:
            self._queries.select_batch(index)
        if self._online is not None:
            self._online.select_batch(index)

    # ------------------------------------------------------------------ called by the model attachment
    def _forward_starts(
        self, attention_mask: torch.Tensor | None, new: int, batch: int, device: torch.device,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Called by the model attachment before a forward with this cache (``input_ids``: its token ids, when the
        model got ids): returns the mask the forward is to use (None: none), or ``attention_mask`` itself."""
        self.coordinator.announced = True
        if self._static_pending:  # an "auto" cache's first forward, and generate() never offered to compile it
            self._settle(False, "auto: the first forward came before generate() offered to compile it (a "
                                "hand-written loop, or a decoding mode that is not compiled)")
        if attention_mask is None or self.rows.appends_real_token(attention_mask.shape[-1], new, batch):
            new_token_mask = None  # a decoding step's token is real (see BatchRows.appends_real_token)
        else:
            # Canonical strides: a slice of the growing mask keeps its stride, which changes every step; a compiled
            # step that read it would be recompiled with dynamic strides and record a CUDA graph per step.
            new_token_mask = attention_mask[:, -new:].bool().clone(memory_format=torch.contiguous_format)
        if self._static_driver is not None:
            model = self._attachment._model_ref()
            replaced = self._static_driver.prepare(attention_mask, new, batch, device, model, self._online)
        else:
            replaced = None if attention_mask is None else self._mask_for(attention_mask, new)
        if self._online is not None:
            self._online.begin_forward(new_token_mask, new, input_ids)
        if self._queries is not None:
            self._queries.begin_forward(self.get_seq_length(), new, self.rows.pads_on(batch, device), new_token_mask)
        return replaced

    def _mask_for(self, attention_mask: torch.Tensor, new: int) -> torch.Tensor | None:
        """The 2-D mask a growing cache's forward must use (``masks.mask_for_forward``)."""
        decoding = self.rows.observe_mask(attention_mask, new)
        plan = self.coordinator.plan_for(new, 0 if self._full_layers else self.get_seq_length())
        return mask_for_forward(attention_mask, new, plan, self.rows, decoding)

    def _recorded_step_tensors(self) -> list[torch.Tensor]:
        """The tensors besides its inputs that a static decode step reads, as they are now: its leased buffers, the
        online statistics' tables and each sliding-window layer's slot index. A CUDA graph of the step holds their
        addresses, so ``hooks.graphed_step`` keys its graphs by them (a reset or a batch reshuffle that moves one
        records again); ``tests/test_graphed_step.py`` checks that a step reads nothing else."""
        tensors = [] if self._lease is None else self._lease.tensors()
        if self._online is not None:
            tensors += self._online.step_tensors()
        tensors += [layer._last_slot for layer in self.layers
                    if isinstance(layer, StaticWindowLayer) and layer.is_initialized]
        return tensors

    def _query_consumers(self) -> list[Any]:
        """What the model attachment hands each forward's pre-RoPE queries to (see ``AttachedCache``)."""
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
        if self._static_driver is not None and step_is_recorded():
            return self._static_driver.clock_on_first_device()[1]  # a device scalar: see get_query_offset
        attachment = self._attachment
        if attachment is not None and attachment.detached:  # hf_ropekv.detach(model) took its hooks off
            attachment.check_attached()
        return super().get_seq_length(layer_idx)
