"""Pre-RoPE queries from module hooks on ``q_proj`` (or the query norm after it), for the families whose RoPE
receives that output: nothing of the modeling code is patched. Other families (fused QKV, NoPE layers, ...) keep
the rotary-function capture (:mod:`.capture`); :func:`query_capture` picks one."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from .capture import QUERY_NORM_NAMES, CaptureBase, QueryCallback, QueryCapture, find_attention_modules
from .geometry import ModelGeometry

#: ``(layers, queries)``: one decoding step's queries of ``layers``, ``[B, 1, H, D]`` each.
StepCallback = Callable[[tuple, list], None]

#: Model types whose every attention layer hands RoPE ``norm?(q_proj(x))`` viewed per head.
HOOKED_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "cohere", "glm", "glm4", "helium", "olmo2", "starcoder2", "gpt_oss", "granite",
})
#: ... of which those whose query norm sees ``[B, H, S, D]``.
NORM_ON_HEADS_FIRST = frozenset({"gemma3_text"})


def query_capture(model: nn.Module, geometry: ModelGeometry, callback: QueryCallback,
                  step_callback: StepCallback | None = None) -> Any:
    """The query capture for ``model``: module hooks where its family allows, else the rotary-function capture."""
    if geometry.model_type in HOOKED_MODEL_TYPES:
        modules = find_attention_modules(model, geometry)
        if all(isinstance(getattr(m, "q_proj", None), nn.Module) for m in modules):
            return HookedQueryCapture(modules, geometry, callback, step_callback)
    return QueryCapture(model, geometry, callback)


class HookedQueryCapture(CaptureBase):
    """Calls ``callback(layer_idx, q)`` with every layer's pre-RoPE query ``[B, S, H, D]``; a recorded decoding step
    (:meth:`begin_forward`) hands all its layers' queries to ``step_callback`` at once when it finishes."""

    def __init__(self, modules: list[nn.Module], geometry: ModelGeometry, callback: QueryCallback,
                 step_callback: StepCallback | None = None) -> None:
        geometry.require_rotary_layout()
        super().__init__(modules, geometry, callback)
        self.step_callback = step_callback
        self._heads_first = geometry.model_type in NORM_ON_HEADS_FIRST and any(
            isinstance(getattr(m, n, None), nn.Module) for m in modules for n in QUERY_NORM_NAMES)
        self._handles: list[Any] = []
        self._step: list[tuple[int, torch.Tensor]] | None = None

    def attach(self) -> "HookedQueryCapture":
        if not self._handles:
            for layer_idx, attention in enumerate(self.attention_modules):
                target = next((getattr(attention, n) for n in QUERY_NORM_NAMES
                               if isinstance(getattr(attention, n, None), nn.Module)), attention.q_proj)
                self._handles.append(target.register_forward_hook(_QueryHook(self, layer_idx)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._step = [], None

    def begin_forward(self, record: bool) -> None:
        self._step = [] if record and self.step_callback is not None else None

    def finish_forward(self) -> None:
        step, self._step = self._step, None
        if step:
            self.step_callback(tuple(layer for layer, _ in step), [q for _, q in step])

    def see(self, layer_idx: int, output: torch.Tensor) -> None:
        if self._heads_first:
            output = output.transpose(1, 2)
        q = output.view(*output.shape[:2], -1, self.geometry.head_dim)  # [B, S, H * D] or [B, S, H, D]
        if self._step is not None and q.shape[1] == 1 and not torch.compiler.is_compiling():
            self._step.append((layer_idx, q))
        else:
            self.callback(layer_idx, q)


class _QueryHook:
    """One layer's forward hook; a copy of the model (deepcopy, pickle) gets a no-op instead."""

    def __init__(self, capture: HookedQueryCapture, layer_idx: int) -> None:
        self.capture_ref, self.layer_idx = weakref.ref(capture), layer_idx

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        capture = self.capture_ref()
        if capture is not None:
            capture.see(self.layer_idx, output)

    def __reduce__(self) -> tuple:
        return _inert_hook, ()


def _inert_hook(*args: Any) -> Any:
    """A copied model's leftover query hook: does nothing (called with no argument, it makes itself)."""
    return _inert_hook if not args else None
