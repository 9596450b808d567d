"""What a cache built from a model hooks into that model, and why.

- A forward pre-hook reads generate's 2-D ``attention_mask``: on transformers 5.4-5.23 the cache never sees
  it otherwise, and it is the only exact source of each row's left padding. It also checks that the mask
  covers exactly the tokens the cache has seen plus the new ones.
- The same pre-hook hands the model the mask the cache's layers need: once rows compact on their own
  schedules, each row's holes (slots in front of its real tokens) are hidden in the mask's last columns.
- Query hooks (online statistics only) hand the pre-RoPE queries of every forward to the cache; the
  forward hook makes them count once the forward has finished.
- ``prepare_inputs_for_generation`` is wrapped once per model so that a cache reused for an unrelated batch
  is refused instead of silently continuing another conversation (generate would slice the new inputs by
  the old cache length).

Every hook only acts when the forward's cache is the cache that installed it, and all are removed when that
cache is garbage-collected.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _compat
from .capture import QueryCapture
from .model_info import ModelGeometry


class AttachedCache(Protocol):
    """What the hooks need from the cache that installed them (``RopeKVCache``; no import of it here)."""

    geometry: ModelGeometry

    def get_seq_length(self) -> int: ...

    def _forward_starts(
        self, attention_mask: torch.Tensor | None, new: int, batch: int, device: torch.device
    ) -> torch.Tensor | None:
        """A forward of ``new`` tokens starts; returns the 2-D mask the model must use instead, or None."""

    def _forward_ends(self) -> None:
        """The forward started last finished without raising."""

    def _take_queries(self, layer_idx: int, queries: torch.Tensor) -> None:
        """One layer's pre-RoPE queries ``[B, S, H, D]`` of the running forward."""

_WRAPPED_MARK = "_hf_ropekv_continuation_check"


class ModelAttachment:
    """Hooks of one cache (a :class:`~hf_ropekv.RopeKVCache`) on one model."""

    def __init__(self, model: nn.Module, cache: AttachedCache, collect_queries: bool) -> None:
        self._cache_ref = weakref.ref(cache)
        self._model_ref = weakref.ref(model)  # for copy_for: a copied cache attaches to the same model
        self._collect_queries = collect_queries
        self._collecting = False
        self._new_token_mask: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None  # ids seen so far, [B, capacity]
        self._num_tokens = 0
        self._tokens_known = True  # False once a forward came as inputs_embeds: nothing to compare then
        handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, with_kwargs=True),
        ]
        capture = None
        self.attention_modules: list[nn.Module] = []
        if collect_queries:
            capture = QueryCapture(model, cache.geometry, self._on_query)
            capture.attach()
            self.attention_modules = capture.attention_modules
        weakref.finalize(cache, _release, handles, capture)
        _wrap_prepare_inputs(model)

    def copy_for(self, cache: AttachedCache, memo: dict) -> "ModelAttachment":
        """A fresh attachment of ``cache`` (a deep copy of this one's cache) to the same model, same state.

        Its hooks are new and act only on ``cache``'s forwards. Every attribute that is state (the token log of
        the continuation check, ...) is deep-copied; those that bind an attachment to its cache, model or hooks
        (weak references, hook handles, modules) stay as the fresh attachment built them.
        """
        model = self._model_ref()
        if model is None:
            raise RuntimeError("Cannot copy this RopeKVCache: the model it was attached to no longer exists.")
        twin = ModelAttachment(model, cache, collect_queries=self._collect_queries)
        for name, value in self.__dict__.items():
            if not _binds_to_owner(value):
                setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        cache = self._cache_ref()
        if cache is None or _compat.cache_from_forward_kwargs(kwargs) is not cache:
            # Another cache's forward (a copy, or a new cache after this one's forward raised midway): this
            # cache's query hooks must stay idle through it.
            self._collecting = False
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        new = input_ids.shape[1] if input_ids is not None else embeds.shape[1]
        seen = cache.get_seq_length()
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            if mask.shape[-1] != seen + new:
                raise ValueError(
                    f"attention_mask covers {mask.shape[-1]} tokens, but this RopeKVCache has seen {seen} and {new} "
                    "arrive now. The cache belongs to another sequence: create a fresh RopeKVCache per batch "
                    "(or use hf_ropekv.enable(model, ...))."
                )
        else:
            mask = None
        if input_ids is None:
            self._tokens_known = False
        else:
            self._log_tokens(input_ids)
        source = input_ids if input_ids is not None else embeds
        self._collecting = True
        replaced = cache._forward_starts(mask, new, source.shape[0], source.device)
        if replaced is not None and replaced is not mask:
            return args, {**kwargs, "attention_mask": replaced}
        return None

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        cache = self._cache_ref()
        if self._collecting and cache is not None and _compat.cache_from_forward_kwargs(kwargs) is cache:
            cache._forward_ends()
        self._collecting = False

    def _on_query(self, layer_idx: int, queries: torch.Tensor) -> None:
        cache = self._cache_ref()
        if self._collecting and cache is not None:
            cache._take_queries(layer_idx, queries)

    # ------------------------------------------------------------------ token log (continuation check)
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

    def check_continuation(
        self, input_ids: torch.Tensor, attention_mask: Any = None, position_ids: Any = None
    ) -> None:
        """Refuse generate() inputs that do not continue the tokens this cache holds."""
        seen = self._num_tokens
        if not self._tokens_known or seen == 0 or input_ids.shape[1] == seen + 1:  # fresh cache, or an ordinary decoding step
            return
        if self._next_prefill_chunk(input_ids.shape[1], attention_mask, position_ids):
            return
        same = (
            input_ids.shape[1] > seen
            and self._tokens is not None
            and input_ids.shape[0] == self._tokens.shape[0]
            and bool((input_ids[:, :seen].to(self._tokens.device) == self._tokens[:, :seen]).all())
        )
        if not same:
            raise ValueError(
                f"This RopeKVCache already holds {seen} tokens of another sequence; the new inputs do not continue "
                "them. Reusing a cache across batches corrupts the output: create a fresh RopeKVCache for every "
                "generate() call (or use hf_ropekv.enable(model, ...), which does it for you)."
            )

    def _next_prefill_chunk(self, new: int, attention_mask: Any, position_ids: Any) -> bool:
        """Whether ``new`` tokens are the next chunk of generate's chunked prefill (``prefill_chunk_size``).

        Each chunk comes alone, without the tokens before it. Its mask, when there is one, covers the tokens held
        plus exactly the chunk; transformers 5.24 drops an all-ones mask, and then the chunk's position ids start
        where the tokens held end. A reused cache gets a whole new sequence instead, whose mask and positions
        start from its own first token.
        """
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
    binding = (weakref.ref, weakref.finalize, *weakref.ProxyTypes, RemovableHandle, QueryCapture, nn.Module)
    return isinstance(value, binding)


def _release(handles: list, capture: QueryCapture | None) -> None:
    for handle in handles:
        handle.remove()
    if capture is not None:
        capture.detach()


def _wrap_prepare_inputs(model: nn.Module) -> None:
    original = model.prepare_inputs_for_generation
    if getattr(original, _WRAPPED_MARK, False):
        return

    def prepare_inputs_for_generation(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cache = _compat.cache_from_forward_kwargs(kwargs)
        attachment = getattr(cache, "_attachment", None)
        if isinstance(attachment, ModelAttachment) and input_ids is not None:
            attachment.check_continuation(input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
        return original(input_ids, *args, **kwargs)

    setattr(prepare_inputs_for_generation, _WRAPPED_MARK, True)
    model.prepare_inputs_for_generation = prepare_inputs_for_generation
