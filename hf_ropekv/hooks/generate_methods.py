"""hf_ropekv's wrappers of transformers' generate methods on one model instance, and the decode-step inputs they
prepare.

generate asks the model for ``prepare_inputs_for_generation``, ``get_compiled_call`` and
``_valid_auto_compile_criteria``, where no forward hook reaches; so a cache's
:class:`~hf_ropekv.hooks.attach.ModelAttachment` wraps them, once per model: to refuse a reused cache, to prepare
a static cache's step eagerly, to run its multi-token forwards outside the compiled call and compile its decode
step with the batch dimension dynamic, and to let a ``static="auto"`` cache settle its mode.
:class:`ModelMethodWrapper` is also the base of :func:`hf_ropekv.enable`'s wrappers.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from .. import _compat
from .attach import ModelAttachment
from .graphed_step import GraphedDecodeStep

logger = logging.get_logger(__name__)

_WRAPPED_MARK = "_hf_ropekv_continuation_check"  # on every generate() method this module wraps
WRAPPED_METHODS = ("prepare_inputs_for_generation", "get_compiled_call", "_valid_auto_compile_criteria")


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
    the decode steps (one token) keep the compiled call, or, for a cache whose steps replay CUDA graphs
    (``cache.cuda_graphs``: the default for ``static="auto"`` on one CUDA device), replay a graph of the eager step
    (``hooks.graphed_step``) and never call the compiled one.

    The decode step's batch dimension is marked dynamic (the step's inputs and every buffer the cache leased,
    ``storage.buffers.BATCH_DIMS``), with batch 1 not specialised (``_compat.batch_one_not_specialised``; on
    transformers 5.17 also in the rotary embedding, ``_compat.rotary_batch_folded``): one compilation serves
    every batch size, so an eval loop whose last batch is smaller does not compile again. With the cache's
    ``dynamic_batch="auto"`` (the default) it is marked once this model has compiled a step of more than one row,
    and not before: a symbolic batch doubles the compile (README, "Warm-up"), which a process that only ever
    decodes one row (a notebook) need not pay.
    """

    name = "get_compiled_call"

    def __init__(self, model: nn.Module, previous: Any = None) -> None:
        super().__init__(model, previous)
        #: The decode steps of caches with ``cache.cuda_graphs``: replayed CUDA graphs instead of the compiled call.
        self.graphed = GraphedDecodeStep(model)
        #: ``dynamic_batch="auto"``: a compiled decode step of this model has had more than one row.
        self.batch_above_one_seen = False
        #: ``dynamic_batch="auto"``: one of batch 1 ran before, compiled with the batch static.
        self._batch_one_compiled = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, original = self._model_and_original()
        compiled = original(*args, **kwargs)
        rotaries = _compat.batch_expanding_rotaries(model)

        def forward(*call_args: Any, **call_kwargs: Any) -> Any:  # generate keeps it for one call only
            if _is_static_multi_token_forward(call_args, call_kwargs):
                return model(*call_args, **call_kwargs)
            cache = _compat.cache_from_forward_kwargs(call_kwargs)
            if getattr(cache, "static", False) and getattr(cache, "cuda_graphs", False):
                return self.graphed(cache, *call_args, **call_kwargs)
            if self._batch_dynamic(call_args, call_kwargs):
                _mark_batch_dynamic(call_args, call_kwargs)
                with _compat.batch_one_not_specialised(), _compat.rotary_batch_folded(rotaries):
                    return compiled(*call_args, **call_kwargs)
            return compiled(*call_args, **call_kwargs)

        return forward

    def _batch_dynamic(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether this decode step compiles with its batch dimension dynamic: a static cache's, by its
        ``dynamic_batch`` (``"auto"``: from this model's first compiled step of more than one row on). False for a
        forward without a static cache (torch then specialises the step to its batch size)."""
        cache = _compat.cache_from_forward_kwargs(kwargs)
        lease = getattr(cache, "_lease", None)
        if lease is None or not getattr(cache, "static", False):
            return False
        setting = cache.options.dynamic_batch
        if setting != "auto":
            return setting
        if not self.batch_above_one_seen:
            rows = cache.batch_size or _step_input(args, kwargs).shape[0]  # known once the prefill ran
            self.batch_above_one_seen = rows > 1
            if rows > 1 and self._batch_one_compiled:  # the second compile this model pays: say why, once
                logger.info(
                    "hf_ropekv: the first compiled decode step of %d rows on this %s compiles once more, with the batch "
                    "dimension dynamic (dynamic_batch='auto' compiled batch 1 with it static); every batch size reuses "
                    "that step from now on. dynamic_batch=True compiles once for all sizes from the start.",
                    rows, type(self._model_ref()).__name__,
                )
            self._batch_one_compiled = rows == 1
        return self.batch_above_one_seen


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


def _mark_batch_dynamic(args: tuple, kwargs: dict[str, Any]) -> None:
    """Mark the batch dimension of a static cache's decode step dynamic: the step's inputs and the cache's leased
    buffers (``BufferLease.batch_dims``)."""
    lease = _compat.cache_from_forward_kwargs(kwargs)._lease
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


def _step_input(args: tuple, kwargs: dict[str, Any]) -> Any:
    """A forward's ``input_ids`` ([B, S]), else its ``inputs_embeds`` ([B, S, D]); None if it has neither."""
    source = kwargs.get("input_ids", args[0] if args else None)
    return kwargs.get("inputs_embeds") if source is None else source


def _is_static_multi_token_forward(args: tuple, kwargs: dict[str, Any]) -> bool:
    attachment = getattr(_compat.cache_from_forward_kwargs(kwargs), "_attachment", None)
    if not (isinstance(attachment, ModelAttachment) and attachment.static):
        return False
    source = _step_input(args, kwargs)
    return isinstance(source, torch.Tensor) and source.ndim >= 2 and source.shape[1] > 1
