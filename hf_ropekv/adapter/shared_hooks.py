"""The forward hooks of one model (:class:`SharedHooks`) and the gate that runs its forwards one at a time
(:class:`ForwardGate`). They exist apart from a cache's attachment (:mod:`.attach`) because they are the model's:
every cache attached to it acts through the same hooks, each forward handed to its own cache's attachment; they
go with the last cache. A copy of the model gets inert hooks instead (``_copied_hooks``).

Threads: one forward at a time per model while a cache is attached to it. Its forwards (and, separately, a static
cache's step preparation) then take a per-model lock, so two threads calling ``generate()`` on one model (a web
server's handler threads) each get exactly their serial result, taking turns forward by forward. The hooks, and the
lock with them, go when the model's last cache goes. For parallel generation, use one model copy per thread.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, Protocol

import torch
from torch import nn

from .. import _compat
from ..model.attention import restore_attention, use_grouped_sdpa
from ..model.query_hooks import query_capture
from ..model.geometry import ModelGeometry
from .generate_methods import _GetCompiledCall, _PrepareInputsForGeneration, _ValidAutoCompileCriteria



class Attachment(Protocol):
    """What the shared hooks hand each forward to: one cache's ``attach.ModelAttachment``."""

    detached: bool
    static: bool

    def owns(self, cache: Any) -> bool: ...
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None: ...
    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None: ...
    def _forward_ends(self) -> None: ...
    def _on_query(self, layer_idx: int, queries: torch.Tensor) -> None: ...
    def _on_step(self, layers: tuple, queries: list, heads_dim: int) -> None: ...


class SharedHooks:
    """The hooks of every cache attached to one model, installed once per model and shared.

    Each hook hands the call to every live :class:`Attachment` of the model (each acts only on its own
    cache's forwards). The hooks go with the last attachment. A static cache also switches an sdpa grouped-query
    model to :func:`~hf_ropekv.model.attention.grouped_sdpa` (same attention, no copy of the key/value heads under
    its mask), for as long as the hooks stay. Nothing here holds the model
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
        self.attachments: list[Attachment] = []
        self.capture: Any = None  # the model's query capture (model.query_hooks.query_capture), while one collects
        self.active: Attachment | None = None  # the attachment of the forward in progress
        self._detach_pending = False  # the last attachment went during a compile: detach at the next forward
        self._attention_before: str | None = None  # the implementation a static cache replaced
        self.gate = ForwardGate()  # one forward at a time (see the module docstring)
        _drop_copied_hooks(model)
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, with_kwargs=True),
            model.register_forward_hook(self._release, always_call=True),
        ]
        weakref.finalize(model, self._detach)  # the hooks go with the model

    def add(self, attachment: Attachment, geometry: ModelGeometry, collect_queries: bool, attention: bool) -> None:
        if collect_queries and self.capture is None:
            self.capture = query_capture(self._model_ref(), geometry, self._on_query, self._on_step).attach()
        self.attachments = [*self.attachments, attachment]  # a new list: a forward in progress iterates the old one
        _PrepareInputsForGeneration.install(self._model_ref())
        if attachment.static:
            _GetCompiledCall.install(self._model_ref())
            _ValidAutoCompileCriteria.install(self._model_ref())
        if attention:  # static or int8 caches (every one: the user may have set it back since the last one)
            before = use_grouped_sdpa(self._model_ref(), geometry)
            self._attention_before = before if before is not None else self._attention_before

    def remove(self, attachment: Attachment) -> None:
        self.attachments = [a for a in self.attachments if a is not attachment]
        if self.active is attachment:
            self.active = None
        if self.attachments:
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
        self.attachments, self.active = [], None
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
            _PrepareInputsForGeneration.uninstall(model)
            _GetCompiledCall.uninstall(model)
            _ValidAutoCompileCriteria.uninstall(model)
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
    hooks.attachments, hooks.capture, hooks.active = [], None, None
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
