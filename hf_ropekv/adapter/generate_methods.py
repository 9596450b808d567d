"""hf_ropekv's wrappers of generate methods on one model instance, where no forward hook reaches: to refuse a
reused cache, to prepare a static cache's step eagerly, and to run its decode steps as replayed CUDA graphs (or
compiled) and its multi-token forwards eagerly. :class:`ModelMethodWrapper` is also the base of ``enable``'s."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .. import _compat
from .graphed_step import GraphedDecodeStep


class StepPreparer:
    """What the wrappers ask of a generate() call's cache attachment (``attach.ModelAttachment`` subclasses it)."""

    static = False  # the cache is static: its steps are prepared here and run as graphs or compiled
    graphs = False  # its decode steps replay CUDA graphs (else generate's compiled forward runs them)

    def check_continuation(self, input_ids: torch.Tensor, attention_mask: Any, position_ids: Any) -> None: ...
    def expect_tokens(self, tokens: int | None) -> None: ...
    def prepare_generation_step(self, prepare: Any, input_ids: Any, args: tuple, kwargs: dict) -> dict: ...


def attachment_of(kwargs: dict[str, Any]) -> StepPreparer | None:
    """The hf_ropekv attachment of the cache in a forward's keyword arguments, if any."""
    attachment = getattr(_compat.cache_from_forward_kwargs(kwargs), "_attachment", None)
    return attachment if isinstance(attachment, StepPreparer) else None


class ModelMethodWrapper:
    """A method of one model instance replaced by an instance attribute. It holds the model weakly (else the model
    would wait for the garbage collector); a copy of the model gets a wrapper of the copy."""

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

    @classmethod
    def install(cls, model: nn.Module) -> None:
        """Wrap ``model``'s method (once: a wrapper already there stays)."""
        current = model.__dict__.get(cls.name)
        if isinstance(current, cls):
            return
        setattr(model, cls.name, cls(model, None if is_class_method(current, model, cls.name) else current))

    @classmethod
    def uninstall(cls, model: nn.Module) -> bool:
        """Give ``model`` back the method the wrapper replaced (the one undo path); False when another wrapper went
        on top since (ours stays inside it, passing calls through)."""
        current = model.__dict__.get(cls.name)
        if isinstance(current, cls):
            if current.previous is None:
                delattr(model, cls.name)
            else:
                setattr(model, cls.name, current.previous)
        elif is_class_method(current, model, cls.name):  # an unpickled copy: pickle rebound it as the class's own
            delattr(model, cls.name)
        return current is None or isinstance(current, cls) or is_class_method(current, model, cls.name)


class _PrepareInputsForGeneration(ModelMethodWrapper):
    name = "prepare_inputs_for_generation"

    def __call__(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _, original = self._model_and_original()
        attachment = attachment_of(kwargs)
        if attachment is not None and input_ids is not None:
            attachment.check_continuation(input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
        if attachment is not None and attachment.static:
            return attachment.prepare_generation_step(original, input_ids, args, kwargs)
        return original(input_ids, *args, **kwargs)


class _GetCompiledCall(ModelMethodWrapper):
    name = "get_compiled_call"

    def __init__(self, model: nn.Module, previous: Any = None) -> None:
        super().__init__(model, previous)
        self.graphed = GraphedDecodeStep(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, original = self._model_and_original()
        compiled: list[Any] = []  # built at the first step that needs it: torch.compile imports inductor (seconds)

        def forward(*call_args: Any, **call_kwargs: Any) -> Any:  # generate keeps it for one call only
            attachment = attachment_of(call_kwargs)
            if attachment is not None and attachment.static:
                source = call_kwargs.get("input_ids", call_args[0] if call_args else None)
                source = call_kwargs.get("inputs_embeds") if source is None else source
                if isinstance(source, torch.Tensor) and source.ndim >= 2 and source.shape[1] > 1:
                    return model(*call_args, **call_kwargs)
                if attachment.graphs:
                    return self.graphed(_compat.cache_from_forward_kwargs(call_kwargs), *call_args, **call_kwargs)
            if not compiled:
                compiled.append(original(*args, **kwargs))
            return compiled[0](*call_args, **call_kwargs)

        return forward


class _ValidAutoCompileCriteria(ModelMethodWrapper):
    """Answered unchanged; before the prefill, a static cache sizes its arena for the call's ``max_length`` here."""

    name = "_valid_auto_compile_criteria"

    def __call__(self, model_kwargs: dict[str, Any], generation_config: Any, *args: Any, **kwargs: Any) -> Any:
        _, original = self._model_and_original()
        attachment = attachment_of(model_kwargs)
        if attachment is not None and attachment.static:
            attachment.expect_tokens(getattr(generation_config, "max_length", None))
        return original(model_kwargs, generation_config, *args, **kwargs)


#: The generate methods a cache's attachment wraps (the static cache's two last).
GENERATE_WRAPPERS = (_PrepareInputsForGeneration, _GetCompiledCall, _ValidAutoCompileCriteria)


def is_class_method(method: Any, model: nn.Module, name: str) -> bool:
    """The class's own method bound to ``model`` (what an unpickled model may hold): nothing to chain to."""
    return (getattr(method, "__self__", None) is model
            and getattr(method, "__func__", None) is getattr(type(model), name, None))


def with_canonical_strides(model_inputs: dict[str, Any]) -> dict[str, Any]:
    """``model_inputs`` with every tensor in canonical contiguous strides (a prefill's last chunk can be one token
    sliced from the prompt, whose strides would recompile the decode step or record another graph)."""
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
