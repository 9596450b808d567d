"""One cache's tie to its model (:class:`ModelAttachment`), acting through the model's shared hooks
(:mod:`.shared_hooks`) on its own cache's forwards only:

- the forward pre-hook reads generate's 2-D ``attention_mask`` (the only exact source of each row's left padding),
  checks that it covers the tokens seen plus the new ones, and hands the model the mask the cache's layers need;
- query hooks hand each forward's pre-RoPE queries to the cache's consumers, which count them once it finished;
- generate's ``prepare_inputs_for_generation`` refuses a cache reused for an unrelated batch and prepares a static
  cache's step eagerly (:mod:`.generate_methods`).

Nothing holds the model strongly, so ``del model`` frees it; a copy of the model starts without these hooks."""

from __future__ import annotations

import copy
import weakref
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..model.capture import CaptureBase
from ..model.geometry import ModelGeometry
from ..storage.buffers import normal_tensors
from .generate_methods import StepPreparer, with_canonical_strides
from .graphed_step import not_capturable
from .shared_hooks import SharedHooks


UNCHANGED = object()


class AttachedCache(Protocol):
    """What the hooks need from the cache that installed them (``RopeKVCache``)."""

    geometry: ModelGeometry
    coordinator: Any  # ForwardCoordinator: its ``announced`` flag
    static: bool

    def get_seq_length(self) -> int: ...
    def _expect_tokens(self, tokens: int | None) -> None: ...
    def _forward_ends(self) -> None: ...
    def _forward_starts(self, attention_mask: torch.Tensor | None, new: int, batch: int,
                        device: torch.device) -> torch.Tensor | None: ...
    def _query_consumers(self) -> list[Any]: ...  # each with add(layer_idx, queries [B, S, H, D]) and end_forward()


class ModelAttachment(StepPreparer):
    def __init__(self, model: nn.Module, cache: AttachedCache, collect_queries: bool) -> None:
        self._cache_ref = weakref.ref(cache)
        self._model_ref = weakref.ref(model)  # for copy_for: a copied cache attaches to the same model
        self._collect_queries = collect_queries
        self._collecting = False
        self._tokens: torch.Tensor | None = None  # ids seen so far, [B, capacity]
        self._num_tokens = 0
        self._tokens_known = True  # False once a forward came as inputs_embeds: nothing to compare then
        self.static = bool(cache.static)
        self.graphs = self.static and not_capturable(model, getattr(model, "device", torch.device("cpu"))) is None
        self._prepared: torch.Tensor | None = None  # the input of a static step prepared by generate's wrapper
        self._query_consumers = cache._query_consumers()
        self._hooks = SharedHooks.of(model)
        self._hooks.add(self, cache.geometry, collect_queries)
        self.detached = False  # hf_ropekv.detach(model) took the hooks off: the cache cannot be used any more
        weakref.finalize(cache, self._hooks.remove, self)

    def fuses_norms(self) -> bool:
        """Whether this cache's forward runs the model's RMSNorms in one kernel each: once its numbers left
        ``DynamicCache``'s (it compacted, or stores int8), as its attention's decode kernel does."""
        cache = self._cache_ref()
        return cache is not None and (cache.num_compactions > 0 or cache.options.kv_bits is not None)

    def expect_tokens(self, tokens: int | None) -> None:
        cache = self._cache_ref()
        if cache is not None:
            cache._expect_tokens(tokens)

    @property
    def attention_modules(self) -> list[nn.Module]:
        """The attention module of every decoder layer, where this attachment collects queries (else [])."""
        capture = self._hooks.capture
        return capture.attention_modules if self._collect_queries and capture is not None else []

    def check_attached(self) -> None:
        """Raise if :func:`hf_ropekv.detach` took this cache's hooks off its model."""
        if self.detached:
            raise RuntimeError("This RopeKVCache was attached to a model that hf_ropekv.detach(model) has since "
                               "cleaned: its hooks are gone, so the cache cannot follow the model's forwards. "
                               "Create a new RopeKVCache(model, ...).")

    def copy_for(self, cache: AttachedCache, memo: dict) -> "ModelAttachment":
        """A fresh attachment of ``cache`` (a deep copy of this one's) to the same model, with this one's state."""
        model = self._model_ref()
        if model is None:
            raise RuntimeError("Cannot copy this RopeKVCache: the model it was attached to no longer exists.")
        self.check_attached()
        twin = ModelAttachment(model, cache, collect_queries=self._collect_queries)
        for name, value in self.__dict__.items():
            if not _binds_to_owner(value):
                setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    def owns(self, cache: Any) -> bool:
        return cache is not None and self._cache_ref() is cache

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """A forward with this attachment's cache starts (called by :class:`SharedHooks`)."""
        cache = self._cache_ref()
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        source = input_ids if input_ids is not None else embeds
        if self._prepared is not None and source is self._prepared:
            # Prepared by generate's wrapper, mask included; another thread may have used the capture since.
            self._prepared = None
            if self._hooks.capture is not None:
                self._hooks.capture.begin_forward(False)
            return None
        replaced = self._start_forward(cache, input_ids, embeds, kwargs.get("attention_mask"))
        return None if replaced is UNCHANGED else (args, {**kwargs, "attention_mask": replaced})

    def prepare_generation_step(self, prepare: Any, input_ids: torch.Tensor | None, args: tuple,
                                kwargs: dict[str, Any]) -> dict[str, Any]:
        """generate's ``prepare_inputs_for_generation`` for a static cache: the step's host-side decisions are taken
        here, eagerly (generate may run the forward compiled), and the mask comes from the cache's slot mask."""
        cache = self._cache_ref()
        self.check_attached()
        # Not held until the forward: a prepared forward that never runs must not keep other threads waiting.
        with self._hooks.gate.held():
            embeds = kwargs.get("inputs_embeds") if kwargs.get("is_first_iteration") else None
            source = embeds if embeds is not None else input_ids
            # generate names the new tokens' count when it passes the whole sequence; otherwise all are new.
            new = kwargs.get("next_sequence_length") or source.shape[1]
            new_ids = None if embeds is not None else input_ids[:, -new:]
            new_embeds = None if embeds is None else embeds[:, -new:]
            replaced = self._start_forward(cache, new_ids, new_embeds, kwargs.get("attention_mask"))
            if replaced is not UNCHANGED:
                kwargs = {**kwargs, "attention_mask": replaced}
            model_inputs = with_canonical_strides(prepare(input_ids, *args, **kwargs))
        source = model_inputs.get("input_ids")
        self._prepared = source if source is not None else model_inputs.get("inputs_embeds")
        return model_inputs

    def _start_forward(self, cache: AttachedCache, input_ids: torch.Tensor | None, embeds: torch.Tensor | None,
                       mask: Any) -> Any:
        """Check, log and announce a forward of this cache; returns the mask to use, or ``UNCHANGED``."""
        new = input_ids.shape[1] if input_ids is not None else embeds.shape[1]
        seen = cache.get_seq_length()
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            if mask.shape[-1] != seen + new:
                raise ValueError(f"attention_mask covers {mask.shape[-1]} tokens, but this RopeKVCache has seen {seen} "
                                 f"and {new} arrive now. The cache belongs to another sequence: create a fresh "
                                 "RopeKVCache per batch (or use hf_ropekv.enable(model, ...)).")
        else:
            mask = None
        if input_ids is None:
            self._tokens_known = False
        else:
            self._log_tokens(input_ids)
        source = input_ids if input_ids is not None else embeds
        self._collecting = True
        self._hooks.active = self
        if self._hooks.capture is not None:  # a growing cache's decoding step hands its queries over at once
            self._hooks.capture.begin_forward(new == 1 and self._collect_queries and not self.static)
        replaced = cache._forward_starts(mask, new, source.shape[0], source.device)
        return UNCHANGED if replaced is mask else replaced

    # Called only while this attachment's cache runs the forward, also inside compiled forwards: they reach the
    # query consumers directly, without dereferencing the cache.
    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self._collecting:
            if self._hooks.capture is not None:
                self._hooks.capture.finish_forward()
            for consumer in self._query_consumers:
                consumer.end_forward()
        self._collecting = False

    def _forward_ends(self) -> None:
        """This cache's forward ended (raised or not)."""
        cache = self._cache_ref()
        if cache is not None:
            cache._forward_ends()

    def _on_query(self, layer_idx: int, queries: torch.Tensor) -> None:
        if self._collecting:
            for consumer in self._query_consumers:
                consumer.add(layer_idx, queries)

    def _on_step(self, layers: tuple, queries: list) -> None:
        """A recorded decoding step's queries (``StepCallback``), in one call where a consumer takes them so."""
        if not self._collecting:
            return
        for consumer in self._query_consumers:
            add_step = getattr(consumer, "add_step", None)
            if add_step is not None:
                add_step(layers, queries)
            else:
                for layer_idx, q in zip(layers, queries):
                    consumer.add(layer_idx, q)

    @normal_tensors
    def _log_tokens(self, input_ids: torch.Tensor) -> None:
        batch, new = input_ids.shape[:2]
        end = self._num_tokens + new
        if self._tokens is None or self._tokens.shape[0] != batch or end > self._tokens.shape[1]:
            grown = torch.empty(batch, max(end, 2 * end), dtype=input_ids.dtype, device=input_ids.device)
            if self._tokens is not None and self._tokens.shape[0] == batch:
                grown[:, : self._num_tokens] = self._tokens[:, : self._num_tokens]
            self._tokens = grown
        self._tokens[:, self._num_tokens : end] = input_ids
        self._num_tokens = end

    def check_continuation(self, input_ids: torch.Tensor, attention_mask: Any = None, position_ids: Any = None) -> None:
        """Refuse generate() inputs that do not continue the tokens this cache holds."""
        seen = self._num_tokens
        if not self._tokens_known or seen == 0 or input_ids.shape[1] == seen + 1:  # fresh, or a decoding step
            return
        if self._next_prefill_chunk(input_ids.shape[1], attention_mask, position_ids):
            return
        tokens = self._tokens
        if not (input_ids.shape[1] > seen and tokens is not None and input_ids.shape[0] == tokens.shape[0]
                and bool((input_ids[:, :seen].to(tokens.device) == tokens[:, :seen]).all())):
            raise ValueError(
                f"This RopeKVCache already holds {seen} tokens, and the new inputs do not start with them. To continue "
                "a conversation, pass the ids generate() returned followed by the new turn's ids (tokenizing the "
                "whole text again can split it into other tokens). For an unrelated batch, create a fresh "
                "RopeKVCache (or use hf_ropekv.enable(model, ...), which does it for every generate() call).")

    def _next_prefill_chunk(self, new: int, attention_mask: Any, position_ids: Any) -> bool:
        """Whether ``new`` tokens are the next chunk of generate's chunked prefill: its mask covers the tokens held
        plus the chunk or, without a mask (5.24 drops an all-ones one), its positions start where they end."""
        seen = self._num_tokens
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
            return attention_mask.shape[-1] == seen + new
        if isinstance(position_ids, torch.Tensor) and position_ids.ndim >= 2 and position_ids.shape[-1] == new:
            return bool((position_ids[..., 0] == seen).all())
        return False

    def truncate(self, length: int) -> None:
        """Forget logged tokens past ``length`` (the cache was cropped)."""
        self._num_tokens = min(self._num_tokens, length)

    def select_batch(self, index: torch.Tensor) -> None:
        if self._tokens is not None:
            self._tokens = self._tokens.index_select(0, index.to(self._tokens.device))

    def reset(self) -> None:
        self._tokens, self._num_tokens, self._tokens_known = None, 0, True


def _binds_to_owner(value: Any) -> bool:
    """Whether an attachment attribute ties it to its own cache, model or hooks (rebuilt, never copied)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_binds_to_owner(item) for item in value)
    binding = (weakref.ref, weakref.finalize, *weakref.ProxyTypes, RemovableHandle, CaptureBase, nn.Module, SharedHooks)
    return isinstance(value, binding)

