"""The forward hooks of one model (:class:`SharedHooks`), shared by all its caches' attachments (:mod:`.attach`),
and the gate that runs its forwards one at a time while a cache is attached (:class:`ForwardGate`): two threads
calling ``generate()`` on one model each get their serial result. They go with the model's last cache; a copy of
the model gets inert hooks."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch._guards import TracingContext

from .. import _compat
from ..model.attention import restore_attention, use_ropekv_attention
from ..model.fused_norms import FusedNorms
from ..model.query_hooks import query_capture
from ..model.geometry import ModelGeometry
from .generate_methods import (GENERATE_WRAPPERS, _GetCompiledCall, _PrepareInputsForGeneration,
                               _ValidAutoCompileCriteria)


class Attachment(Protocol):
    """One cache's ``attach.ModelAttachment``."""

    detached: bool
    static: bool

    def owns(self, cache: Any) -> bool: ...
    def fuses_norms(self) -> bool: ...
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None: ...
    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None: ...
    def _forward_ends(self) -> None: ...
    def _on_query(self, layer_idx: int, queries: torch.Tensor) -> None: ...
    def _on_step(self, layers: tuple, queries: list) -> None: ...


class SharedHooks:
    """Installed once per model; each forward goes to its own cache's attachment. While the hooks stay, an sdpa model
    attends with hf_ropekv's attention (``model.attention``). Nothing here holds the model strongly."""

    _BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, SharedHooks]" = weakref.WeakKeyDictionary()
    copied = False  # True for what a copied model brought along

    @classmethod
    def of(cls, model: nn.Module) -> "SharedHooks":
        hooks = cls._BY_MODEL.get(model)
        if hooks is None:
            hooks = cls._BY_MODEL[model] = cls(model)
        return hooks

    _eager_marked = False

    def __init__(self, model: nn.Module) -> None:
        if not SharedHooks._eager_marked:  # hooks never compiled; marked here, as torch.compiler.disable imports dynamo
            for name in ("_pre_forward", "_post_forward", "_release"):
                setattr(SharedHooks, name, torch.compiler.disable(getattr(SharedHooks, name)))
            SharedHooks._eager_marked = True
        self._model_ref = weakref.ref(model)
        self.attachments: list[Attachment] = []
        self.capture: Any = None  # the model's query capture, while a cache collects queries
        self.active: Attachment | None = None  # the attachment of the forward in progress
        self.norms: FusedNorms | None = None  # the model's one-kernel RMSNorms (CUDA models)
        self.norms_open = False  # whether the forward in progress runs them (model.fused_norms)
        self._detach_pending = False  # the last attachment went during a compile: detach at the next forward
        self._attention_before: str | None = None  # the implementation the caches replaced
        self.gate = ForwardGate()
        _drop_copied_hooks(model)
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, with_kwargs=True),
            model.register_forward_hook(self._release, always_call=True),
        ]
        weakref.finalize(model, self._detach)  # the hooks go with the model

    def add(self, attachment: Attachment, geometry: ModelGeometry, collect_queries: bool) -> None:
        if collect_queries and self.capture is None:
            self.capture = query_capture(self._model_ref(), geometry, self._on_query, self._on_step).attach()
        self.attachments = [*self.attachments, attachment]  # a new list: a forward in progress iterates the old one
        _PrepareInputsForGeneration.install(self._model_ref())
        if self.norms is None:
            self.norms = FusedNorms.of(self._model_ref(), self._norms_are_open)
        if attachment.static:
            _GetCompiledCall.install(self._model_ref())
            _ValidAutoCompileCriteria.install(self._model_ref())
        # Every cache, growing ones too: a decode step's attention (sdpa, or the kernel once tokens were evicted) must
        # not depend on whether a static cache is alive beside it. At every attach: the user may have set it back.
        before = use_ropekv_attention(self._model_ref())
        self._attention_before = before if before is not None else self._attention_before

    def remove(self, attachment: Attachment) -> None:
        self.attachments = [a for a in self.attachments if a is not attachment]
        if self.active is attachment:
            self.active = None
        if self.attachments:
            return
        if _dynamo_compiling():
            # A cache freed mid-compile: removing the rotary pass-through now would change a function dynamo guards
            # on. The next eager forward takes the idle hooks out instead.
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
        if self.norms is not None:
            self.norms.detach()
            self.norms = None
        model = self._model_ref()
        if model is not None:
            restore_attention(model, self._attention_before)
            for wrapper in GENERATE_WRAPPERS:
                wrapper.uninstall(model)
        self._attention_before = None

    # The hooks act through the running forward's attachment alone (``active``). Never compiled: preparing a forward
    # is host work on Python state, so even a model compiled as a whole has each forward prepared here, eagerly.
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        if self._detach_pending and not self.attachments:
            self._remove_hooks()
            return None
        self.gate.enter()  # released by _release, which runs even when the forward raises
        cache = _compat.cache_from_forward_kwargs(kwargs)
        # Another cache's forward, or none: every attachment's query hooks stay idle through it.
        self.active = next((a for a in self.attachments if a.owns(cache)), None)
        if self.active is None:
            if self.capture is not None:
                self.capture.begin_forward(False)  # and no recording of an earlier forward that raised goes on
            return None
        replaced = self.active._pre_forward(module, args, kwargs)
        # After the attachment's preparation: a static cache's compaction of this forward counts already.
        self.norms_open = self.norms is not None and self.active.fuses_norms()
        return replaced

    # Never compiled: folding queries makes tensors that outlive the call, which a CUDA graph's pool would overwrite.
    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.active is not None:
            self.active._post_forward(module, args, kwargs, output)

    def _release(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.norms_open = False
        try:
            if self.active is not None:
                self.active._forward_ends()
        finally:
            self.gate.leave()

    def _norms_are_open(self) -> bool:
        return self.norms_open

    def _on_query(self, layer_idx: int, queries: torch.Tensor) -> None:
        if self.active is not None:
            self.active._on_query(layer_idx, queries)

    def _on_step(self, layers: tuple, queries: list) -> None:
        if self.active is not None:
            self.active._on_step(layers, queries)


class ForwardGate:
    """One forward at a time per model, across threads (re-entrant on the holding thread): a forward enters before
    anything reads shared hook state and leaves when it ends; a static step's preparation holds it as a block."""

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
        entered = self.enter()
        try:
            yield
        finally:
            if entered:
                self.leave()


def _copied_hooks() -> SharedHooks:
    """What a copy of a model (deepcopy, pickle) gets for the original's hooks: pass-throughs until replaced."""
    hooks = SharedHooks.__new__(SharedHooks)
    vars(hooks).update(_model_ref=lambda: None, attachments=[], capture=None, active=None, norms=None, norms_open=False,
                       _detach_pending=False,
                       _attention_before=None, _handles=[], gate=ForwardGate(), copied=True)
    return hooks


def _drop_copied_hooks(model: nn.Module) -> None:
    """Remove the hooks a copied model came with from its original."""
    for hooks, extras in (
        (model._forward_pre_hooks, ("_forward_pre_hooks_with_kwargs",)),
        (model._forward_hooks, ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ):
        for hook_id in [i for i, hook in hooks.items() if getattr(getattr(hook, "__self__", None), "copied", False)]:
            del hooks[hook_id]
            for extra in extras:
                getattr(model, extra, {}).pop(hook_id, None)


def _dynamo_compiling() -> bool:
    """Whether dynamo is compiling a frame on this thread right now."""
    return TracingContext.try_get() is not None
