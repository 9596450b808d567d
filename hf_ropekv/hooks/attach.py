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
- With a static cache, ``get_compiled_call`` is wrapped once per model so that generate's compiled forward
  runs only the decode steps compiled: a forward of several tokens (a chunk of a chunked prefill) runs eagerly.

Every hook only acts when the forward's cache is the cache that installed it, and all are removed when that
cache is garbage-collected.

No hidden ties to the model. Nothing hf_ropekv stores on a model holds the model strongly (wrappers and hooks
hold it weakly, frames hold their attention module weakly), so ``del model`` frees it by reference counting
alone, and :func:`hf_ropekv.detach` takes everything off at once. A copy of the model (``copy.deepcopy``,
``pickle``, ``torch.save``) starts without the original's hooks: what was put on its modules only passes calls
through (and takes itself out), and the next ``RopeKVCache`` of the copy installs fresh hooks.

Threads: one forward at a time per model. While a model carries these hooks, its forwards (and, separately, a
static cache's step preparation) take a per-model lock, so two threads calling ``generate()`` on one model (a web server's
handler threads) each get exactly their serial result, taking turns forward by forward. For parallel
generation, use one model copy per thread (``copy.deepcopy(model)``).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _compat
from ..model.attention import restore_attention, use_grouped_sdpa
from ..model.capture import QueryCapture
from ..model.geometry import ModelGeometry


#: ``ModelAttachment._start_forward``: the forward keeps the attention mask it was given.
UNCHANGED = object()


class Announcements(Protocol):
    """Where a cache notes that its model's pre-hook announced the running forward (``ForwardCoordinator``)."""

    announced: bool


class AttachedCache(Protocol):
    """What the hooks need from the cache that installed them (``RopeKVCache``; no import of it here)."""

    geometry: ModelGeometry
    coordinator: Announcements

    def get_seq_length(self) -> int: ...

    def _forward_starts(
        self, attention_mask: torch.Tensor | None, new: int, batch: int, device: torch.device
    ) -> torch.Tensor | None:
        """A forward of ``new`` tokens starts; returns the 2-D mask the model must use instead, or None."""

    def _query_consumers(self) -> list[Any]:
        """What takes each forward's pre-RoPE queries: objects with ``add(layer_idx, queries)`` (``[B, S, H, D]``)
        and ``end_forward()`` (the forward finished without raising)."""

_WRAPPED_MARK = "_hf_ropekv_continuation_check"  # on every generate() method this module wraps
WRAPPED_METHODS = ("prepare_inputs_for_generation", "get_compiled_call", "_valid_auto_compile_criteria")


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
        # A static cache's forwards are prepared before generate's compiled call (prepare_inputs_for_generation);
        # the input tensor of the forward so prepared, for the pre-hook to recognise it.
        self.static = bool(getattr(cache, "static", False))
        self._prepared: torch.Tensor | None = None
        # What takes each forward's queries (online statistics, a scorer's query window): they hold no reference
        # to the cache.
        self._query_consumers = cache._query_consumers()
        self._hooks = SharedHooks.of(model)
        self._hooks.add(self, cache.geometry, collect_queries, keep=self.static)
        self.detached = False  # hf_ropekv.detach(model) took the hooks off: the cache cannot be used any more
        weakref.finalize(cache, self._hooks.remove, self)
        _PrepareInputsForGeneration.install(model)
        if self.static:
            _GetCompiledCall.install(model)
        if getattr(getattr(cache, "options", None), "static", None) == "auto":
            _ValidAutoCompileCriteria.install(model)

    def remove(self) -> None:
        """Take this attachment off its model's hooks (its cache was assembled again: ``RopeKVCache._assemble``)."""
        self._hooks.remove(self)

    @property
    def attention_modules(self) -> list[nn.Module]:
        """The attention module of every decoder layer whose queries this attachment collects (else none)."""
        capture = self._hooks.capture
        return capture.attention_modules if self._collect_queries and capture is not None else []

    def check_attached(self) -> None:
        """Raise if :func:`hf_ropekv.detach` took this cache's hooks off its model."""
        if self.detached:
            raise RuntimeError(
                "This RopeKVCache was attached to a model that hf_ropekv.detach(model) has since cleaned: its hooks are "
                "gone, so the cache cannot follow the model's forwards. Create a new RopeKVCache(model, ...)."
            )

    def copy_for(self, cache: AttachedCache, memo: dict) -> "ModelAttachment":
        """A fresh attachment of ``cache`` (a deep copy of this one's cache) to the same model, same state.

        Its hooks are new and act only on ``cache``'s forwards. Every attribute that is state (the token log of
        the continuation check, ...) is deep-copied; those that bind an attachment to its cache, model or hooks
        (weak references, hook handles, modules) stay as the fresh attachment built them.
        """
        model = self._model_ref()
        if model is None:
            raise RuntimeError("Cannot copy this RopeKVCache: the model it was attached to no longer exists.")
        self.check_attached()
        twin = ModelAttachment(model, cache, collect_queries=self._collect_queries)
        for name, value in self.__dict__.items():
            if not _binds_to_owner(value):
                setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    # ------------------------------------------------------------------ hooks
    def owns(self, cache: Any) -> bool:
        return cache is not None and self._cache_ref() is cache

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """A forward with this attachment's cache starts (called by :class:`SharedHooks`)."""
        cache = self._cache_ref()
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        source = input_ids if input_ids is not None else embeds
        if self._prepared is not None and source is self._prepared:
            # Prepared with generate's inputs; the model already has the mask it needs. Another thread's forward
            # may have run since (the gate is not held between the two): set the shared capture back for this one.
            self._prepared = None
            if self._hooks.capture is not None:
                self._hooks.capture.begin_forward(False)
            return None
        replaced = self._start_forward(cache, input_ids, embeds, kwargs.get("attention_mask"))
        if replaced is not UNCHANGED:
            return args, {**kwargs, "attention_mask": replaced}
        return None

    def prepare_generation_step(
        self, prepare: Any, input_ids: torch.Tensor | None, args: tuple, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """generate's ``prepare_inputs_for_generation`` for a static cache: prepare the coming forward now.

        generate may call the forward compiled as a whole (hooks included), where nothing may depend on host
        state; so the cache takes this step's decisions here, eagerly, and the 4-D mask transformers builds for
        a compileable cache comes from the cache's slot mask.
        """
        cache = self._cache_ref()
        self.check_attached()
        # A short critical section of its own, not held until the forward: a prepared forward that never runs
        # (generate raised in between, or a caller dropped the inputs) must not keep other threads waiting.
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
            model_inputs = _with_canonical_strides(prepare(input_ids, *args, **kwargs))
        source = model_inputs.get("input_ids")
        self._prepared = source if source is not None else model_inputs.get("inputs_embeds")
        return model_inputs

    def _start_forward(
        self, cache: AttachedCache, input_ids: torch.Tensor | None, embeds: torch.Tensor | None, mask: Any
    ) -> Any:
        """A forward of this cache starts: check it, log its tokens, tell the cache; returns the mask to use (a
        tensor, or None: no mask), or ``UNCHANGED``: the forward keeps the one it was given."""
        new = input_ids.shape[1] if input_ids is not None else embeds.shape[1]
        seen = cache.get_seq_length()
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
        self._hooks.active = self
        if self._hooks.capture is not None:  # a decoding step of a growing cache takes the capture's fast path
            self._hooks.capture.begin_forward(new == 1 and self._collect_queries and not self.static)
        replaced = cache._forward_starts(mask, new, source.shape[0], source.device, input_ids)
        return UNCHANGED if replaced is mask else replaced

    # Called only while this attachment's cache runs the forward (SharedHooks.active), also inside compiled
    # forwards: so they reach the query consumers directly, without dereferencing the cache.
    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self._collecting:
            if self._hooks.capture is not None:
                self._hooks.capture.finish_forward()  # a recorded decoding step hands its queries over now
            for consumer in self._query_consumers:
                consumer.end_forward()
        self._collecting = False

    def _forward_ends(self) -> None:
        """This cache's forward ended (raised or not): the next forward must be announced again. A compiled step
        skips the layers' eager check that consumes the announce, so it is consumed here too."""
        cache = self._cache_ref()
        if cache is not None:
            cache.coordinator.announced = False

    def _on_query(self, layer_idx: int, queries: torch.Tensor) -> None:
        if self._collecting:
            for consumer in self._query_consumers:
                consumer.add(layer_idx, queries)

    def _on_step(self, layers: tuple, queries: list, heads_dim: int) -> None:
        """A recorded decoding step's queries (``capture.StepCallback``): in one call where a consumer takes them so."""
        if not self._collecting:
            return
        for consumer in self._query_consumers:
            add_step = getattr(consumer, "add_step", None)
            if add_step is not None:
                add_step(layers, queries, heads_dim)
            else:
                for layer_idx, q in zip(layers, queries):
                    consumer.add(layer_idx, q.transpose(1, 2) if heads_dim == 1 else q)

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
    binding = (weakref.ref, weakref.finalize, *weakref.ProxyTypes, RemovableHandle, QueryCapture, nn.Module, SharedHooks)
    return isinstance(value, binding)


class SharedHooks:
    """The hooks of every cache attached to one model, installed once per model and shared.

    Each hook hands the call to every live :class:`ModelAttachment` of the model (each acts only on its own
    cache's forwards). Sharing keeps the hooks' identities the same from one cache to the next: a compiled
    forward traces the hooks and guards on them, so per-cache hooks would recompile it for every new cache.
    The hooks go with the last attachment, unless a static cache was attached: then they stay, idle, for the
    model's lifetime, so the next static cache (a new ``generate()`` call) reuses the compiled step. A static
    cache also switches an sdpa grouped-query model to :func:`~hf_ropekv.model.attention.grouped_sdpa` (same attention,
    no copy of the key/value heads under its mask), for as long as the hooks stay. Nothing here holds the model
    strongly: when it goes, the hooks go with it and the rotary functions are given back.
    """

    _BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, SharedHooks]" = weakref.WeakKeyDictionary()
    copied = False  # True for what a copied model brought along (see _copied_hooks)

    @classmethod
    def of(cls, model: nn.Module) -> "SharedHooks":
        hooks = cls._BY_MODEL.get(model)
        if hooks is None:
            hooks = cls._BY_MODEL[model] = cls(model)
        return hooks

    #: Hooks that must never be compiled (see each one's comment). ``torch.compiler.disable`` imports dynamo, which
    #: costs about 1.5 s of CPU, so the marks go on at the first model hf_ropekv attaches to, not at import.
    _EAGER_ONLY = ("_pre_forward", "_post_forward", "_release")
    _eager_marked = False

    @classmethod
    def _mark_eager_only(cls) -> None:
        if not cls._eager_marked:
            for name in cls._EAGER_ONLY:
                setattr(cls, name, torch.compiler.disable(getattr(cls, name)))
            cls._eager_marked = True

    def __init__(self, model: nn.Module) -> None:
        self._mark_eager_only()
        self._model_ref = weakref.ref(model)
        self.attachments: list[ModelAttachment] = []
        self.capture: QueryCapture | None = None
        self.active: ModelAttachment | None = None  # the attachment of the forward in progress
        self.keep = False
        self._detach_pending = False  # the last attachment went during a compile: detach at the next forward
        self._attention_before: str | None = None  # the implementation a static cache replaced
        self.gate = ForwardGate()  # one forward at a time (see the module docstring)
        _drop_copied_hooks(model)
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, with_kwargs=True),
            model.register_forward_hook(self._release, always_call=True),
        ]
        weakref.finalize(model, self._detach)  # kept hooks (static caches) go with the model

    def add(self, attachment: "ModelAttachment", geometry: ModelGeometry, collect_queries: bool, keep: bool) -> None:
        if collect_queries and self.capture is None:
            self.capture = QueryCapture(self._model_ref(), geometry, self._on_query, self._on_step).attach()
        self.attachments = [*self.attachments, attachment]  # a new list: a forward in progress iterates the old one
        if keep:  # every static cache: the user may have set the implementation back since the last one
            before = use_grouped_sdpa(self._model_ref(), geometry)
            self._attention_before = before if before is not None else self._attention_before
        self.keep = self.keep or keep

    def remove(self, attachment: "ModelAttachment") -> None:
        self.attachments = [a for a in self.attachments if a is not attachment]
        if self.active is attachment:
            self.active = None
        if self.attachments or self.keep:
            return
        if _dynamo_compiling():
            # A cache freed by the garbage collector in the middle of a compile (its finalizer runs here): taking
            # the rotary pass-through out now would change a function dynamo is guarding on. The next forward
            # that is not being compiled takes the idle hooks out instead.
            self._detach_pending = True
            return
        self._remove_hooks()

    def __reduce__(self) -> tuple:
        # The model's hooks are this object's bound methods: a copy of the model gets inert ones instead.
        return _copied_hooks, ()

    def detach_model(self) -> None:
        """Take every hook off now, static caches' included; the caches attached so far refuse further use."""
        for attachment in self.attachments:
            attachment.detached = True
        self.attachments, self.active, self.keep = [], None, False
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        self._detach_pending = False
        self._detach()
        model = self._model_ref()
        if model is not None and SharedHooks._BY_MODEL.get(model) is self:
            del SharedHooks._BY_MODEL[model]

    def _detach(self) -> None:
        """Remove every hook and give the rotary function back (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.capture is not None:
            self.capture.detach()
        model = self._model_ref()
        if model is not None:
            restore_attention(model, self._attention_before)
        self._attention_before = None

    # The hooks act through the attachment of the running forward's cache alone (``active``): a compiled forward
    # then reads one attachment, whatever number of caches the model has, and is not recompiled when it changes.
    # Never compiled (like _post_forward): preparing a forward is host work on Python state (plans, compaction,
    # the slot of the new tokens), which a compiled frame could not redo each step. So a model compiled as a whole
    # (torch.compile(model), generate's own compilation) still has each forward prepared here, eagerly; a forward
    # that generate's prepare_inputs_for_generation already prepared is recognised and left alone.
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        if self._detach_pending and not self.attachments:
            self._remove_hooks()
            return None
        self.gate.enter()  # released by _release, which runs even when the forward raises
        cache = _compat.cache_from_forward_kwargs(kwargs)
        # Another cache's forward, or none: every attachment's query hooks stay idle through it.
        self.active = next((a for a in self.attachments if a.owns(cache)), None)
        if self.active is None and self.capture is not None:
            self.capture.begin_forward(False)  # and no recording of an earlier forward that raised goes on
        return None if self.active is None else self.active._pre_forward(module, args, kwargs)

    # Never compiled either: folding a forward's queries into the running statistics creates and grows tensors
    # that outlive the call, and a tensor made inside a compiled call would, under CUDA graphs, live in the graph's
    # pool and be overwritten by the next replay. Run eagerly, it reads the forward's outputs right after the
    # forward. (A static decode step folds in place during the forward.)
    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.active is not None:
            self.active._post_forward(module, args, kwargs, output)

    def _release(self, module: nn.Module, args: tuple, output: Any) -> None:
        try:
            if self.active is not None:
                self.active._forward_ends()
        finally:
            self.gate.leave()

    def _on_query(self, layer_idx: int, queries: torch.Tensor) -> None:
        if self.active is not None:
            self.active._on_query(layer_idx, queries)

    def _on_step(self, layers: tuple, queries: list, heads_dim: int) -> None:
        if self.active is not None:
            self.active._on_step(layers, queries, heads_dim)



class ForwardGate:
    """One forward at a time per model, across threads: a forward enters before anything reads shared hook state
    and leaves when it ends (its always-called forward hook). Entering again on the thread that holds it is a
    no-op. A static cache's step preparation holds it on its own, as a block (``with gate.held():``), which
    leaves only if it entered: the gate is never held between a preparation and its forward."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def enter(self) -> bool:
        """Hold the gate on this thread; returns whether this call acquired it (False: the thread held it)."""
        me = threading.get_ident()
        if self._owner == me:
            return False
        self._lock.acquire()
        self._owner = me
        return True

    def leave(self) -> None:
        if self._owner == threading.get_ident():
            self._owner = None
            self._lock.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the gate for a block; leave at its end only if this block entered it."""
        entered = self.enter()
        try:
            yield
        finally:
            if entered:
                self.leave()


def _copied_hooks() -> SharedHooks:
    """What a copy of a model (``copy.deepcopy``, pickle) gets for the original's :class:`SharedHooks`: hooks with
    no attachment and no capture, which pass every forward through until the copy's next hooks replace them."""
    hooks = SharedHooks.__new__(SharedHooks)
    hooks._model_ref = lambda: None
    hooks.attachments, hooks.capture, hooks.active, hooks.keep = [], None, None, False
    hooks._detach_pending, hooks._attention_before, hooks._handles = False, None, []
    hooks.gate, hooks.copied = ForwardGate(), True
    return hooks


def _drop_copied_hooks(model: nn.Module) -> None:
    """Remove the hooks a copied model came with from its original (see :func:`_copied_hooks`)."""
    for hooks, extras in (
        (model._forward_pre_hooks, ("_forward_pre_hooks_with_kwargs",)),
        (model._forward_hooks, ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ):
        for hook_id in [i for i, hook in hooks.items() if getattr(getattr(hook, "__self__", None), "copied", False)]:
            del hooks[hook_id]
            for extra in extras:
                getattr(model, extra, {}).pop(hook_id, None)


def _dynamo_compiling() -> bool:
    """Whether dynamo is compiling a frame on this thread right now (a finalizer may run in the middle of it)."""
    try:
        from torch._guards import TracingContext
    except ImportError:  # a torch without dynamo's tracing context: nothing is compiled
        return False
    return TracingContext.try_get() is not None


class ModelMethodWrapper:
    """A method of one model instance replaced by hf_ropekv, stored as an instance attribute (here, and by
    :func:`hf_ropekv.enable`).

    It holds the model weakly (a wrapper on the model that held it would keep it alive until the garbage
    collector ran), and a copy of the model (``copy.deepcopy``, ``pickle``) gets a wrapper of the copy.
    """

    name = ""

    def __init__(self, model: nn.Module, previous: Any = None) -> None:
        self._model_ref = weakref.ref(model)
        self.previous = previous  # an instance attribute it replaced, else None: the class's method

    def __reduce__(self) -> tuple:
        return type(self), (self._model_ref(), self.previous)

    def _model_and_original(self) -> tuple[nn.Module, Any]:
        """The model and the method this wrapper replaced, bound to it."""
        model = self._model_ref()
        if model is None:
            raise ReferenceError(f"The model of this hf_ropekv {self.name} wrapper no longer exists.")
        if self.previous is not None:
            return model, self.previous
        return model, getattr(type(model), self.name).__get__(model)


class _ModelMethod(ModelMethodWrapper):
    """A method of one model instance that this module wraps: marked, and installed once per model."""

    _hf_ropekv_continuation_check = True  # _WRAPPED_MARK

    @classmethod
    def install(cls, model: nn.Module) -> None:
        current = model.__dict__.get(cls.name)
        if getattr(current, _WRAPPED_MARK, False):
            return
        previous = None if _is_class_method(current, model, cls.name) else current
        setattr(model, cls.name, cls(model, previous))


class _PrepareInputsForGeneration(_ModelMethod):
    """``prepare_inputs_for_generation`` that refuses a reused cache and prepares a static cache's step."""

    name = "prepare_inputs_for_generation"

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _, original = self._model_and_original()
        cache = _compat.cache_from_forward_kwargs(kwargs)
        attachment = getattr(cache, "_attachment", None)
        if isinstance(attachment, ModelAttachment) and input_ids is not None:
            attachment.check_continuation(input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
        if isinstance(attachment, ModelAttachment) and attachment.static:
            return attachment.prepare_generation_step(original, input_ids, args, kwargs)
        return original(input_ids, *args, **kwargs)


class _GetCompiledCall(_ModelMethod):
    """``get_compiled_call`` whose forward runs a static cache's multi-token forwards eagerly.

    generate sends every chunk of a chunked prefill (``prefill_chunk_size``) through its compiled forward; only
    its unchunked prefill runs eagerly. A static cache's chunks attend over a temporary arena larger than the
    fixed one, so compiled they cost two more graphs and, under CUDA graphs, a recording per chunk: on an H200
    (Qwen3-8B shape, batch 16, a 32K prompt in chunks of 2,048) the compile warm-up took 133 s against 42-53 s
    for the decode step alone. A forward of many tokens is bound by the GPU, so running it eagerly costs little;
    the decode steps (one token) keep the compiled call.

    The decode step's batch dimension is marked dynamic (the step's inputs and every buffer the cache leased,
    ``storage.buffers.BATCH_DIMS``), with batch 1 not specialised (``_compat.batch_one_not_specialised``; on
    transformers 5.17 also in the rotary embedding, ``_compat.rotary_batch_folded``): one compilation serves
    every batch size, so an eval loop whose last batch is smaller does not compile again.
    """

    name = "get_compiled_call"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, original = self._model_and_original()
        compiled = original(*args, **kwargs)
        rotaries = _compat.batch_expanding_rotaries(model)

        def forward(*call_args: Any, **call_kwargs: Any) -> Any:  # generate keeps it for one call only
            if _is_static_multi_token_forward(call_args, call_kwargs):
                return model(*call_args, **call_kwargs)
            if _mark_batch_dynamic(call_args, call_kwargs):
                with _compat.batch_one_not_specialised(), _compat.rotary_batch_folded(rotaries):
                    return compiled(*call_args, **call_kwargs)
            return compiled(*call_args, **call_kwargs)

        return forward


class _ValidAutoCompileCriteria(_ModelMethod):
    """generate's ``_valid_auto_compile_criteria`` (same signature on transformers 5.17 through 5.24), asked before
    the first forward of a decoding loop: a ``static="auto"`` cache of this model settles its mode there
    (``hf_ropekv.cache.auto_static``); any other cache gets transformers' answer unchanged."""

    name = "_valid_auto_compile_criteria"

    def __call__(self, model_kwargs: dict[str, Any], generation_config: Any, *args: Any, **kwargs: Any) -> Any:
        model, original = self._model_and_original()
        cache = _compat.cache_from_forward_kwargs(model_kwargs)
        attachment = getattr(cache, "_attachment", None)
        if isinstance(attachment, ModelAttachment) and attachment.owns(cache) and attachment._model_ref() is model:
            ask = lambda kwargs_, config_: original(kwargs_, config_, *args, **kwargs)  # noqa: E731
            return cache._auto_compile_criteria(ask, model_kwargs, generation_config)
        return original(model_kwargs, generation_config, *args, **kwargs)


def _is_class_method(method: Any, model: nn.Module, name: str) -> bool:
    """The class's own method bound to ``model`` (what an unpickled model may hold): nothing to chain to."""
    return getattr(method, "__self__", None) is model and getattr(method, "__func__", None) is getattr(type(model), name, None)


def _with_canonical_strides(model_inputs: dict[str, Any]) -> dict[str, Any]:
    """``model_inputs`` with every tensor in contiguous strides. A compiled step guards on strides: the last
    chunk of a chunked prefill can be one token, sliced from the prompt's ids and positions (a stride of the
    prompt's length), and would recompile the decode step, whose inputs generate makes contiguous."""
    for name, value in model_inputs.items():
        if isinstance(value, torch.Tensor) and value.stride() != _contiguous_strides(value.shape):
            model_inputs[name] = value.clone(memory_format=torch.contiguous_format)
    return model_inputs


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


#: Keyword inputs of a decode step and their batch dimension, counted from the end (``position_ids`` may carry a
#: leading axis: [3, B, S] for multimodal RoPE); a 4-D mask is [B, 1, q, kv], a 2-D one [B, kv].
STEP_INPUT_BATCH_DIMS = {"input_ids": -2, "inputs_embeds": -3, "position_ids": -2}


def _mark_batch_dynamic(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Mark the batch dimension of a static cache's decode step dynamic: the step's inputs and the cache's leased
    buffers (``BufferLease.batch_dims``). Returns False (nothing marked) for a forward without a static cache, or
    with one built with ``dynamic_batch=False`` (torch then specialises the step to its batch size)."""
    cache = _compat.cache_from_forward_kwargs(kwargs)
    lease = getattr(cache, "_lease", None)
    if lease is None or not getattr(cache, "static", False) or not cache.options.dynamic_batch:
        return False
    for tensor, dim in lease.batch_dims():
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    inputs = dict(kwargs)
    if args and isinstance(args[0], torch.Tensor):
        inputs.setdefault("input_ids", args[0])
    # The query length (1: multi-token forwards run eagerly) is marked static: a model compiled before with prompts
    # of several lengths (another cache's chunked prefill) has it dynamic in dynamo's frame state, and under
    # backed_size_oblivious a dynamic 1 does not broadcast (sdpa failed to trace: "size of tensor a (2*s70) must
    # match ... s90: hint = 1").
    for name, dim in STEP_INPUT_BATCH_DIMS.items():
        tensor = inputs.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.ndim >= -dim:
            torch._dynamo.maybe_mark_dynamic(tensor, tensor.ndim + dim)
            torch._dynamo.mark_static(tensor, tensor.ndim + dim + 1)
    masks = inputs.get("attention_mask")
    for mask in masks.values() if isinstance(masks, dict) else (masks,):  # a dict per layer type on some models
        if isinstance(mask, torch.Tensor) and mask.ndim >= 2:
            torch._dynamo.maybe_mark_dynamic(mask, 0)
            if mask.ndim == 4:  # [B, 1, q, kv]
                torch._dynamo.mark_static(mask, 2)
    positions = inputs.get("cache_position")
    if isinstance(positions, torch.Tensor) and positions.ndim == 1:
        torch._dynamo.mark_static(positions, 0)
    return True


def _is_static_multi_token_forward(args: tuple, kwargs: dict[str, Any]) -> bool:
    attachment = getattr(_compat.cache_from_forward_kwargs(kwargs), "_attachment", None)
    if not (isinstance(attachment, ModelAttachment) and attachment.static):
        return False
    source = kwargs.get("input_ids", args[0] if args else None)
    if source is None:
        source = kwargs.get("inputs_embeds")
    return isinstance(source, torch.Tensor) and source.ndim >= 2 and source.shape[1] > 1
