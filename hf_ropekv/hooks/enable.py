"""Turn RopeKVCache on for every ``generate()`` call of a model, in one line.

    import hf_ropekv
    hf_ropekv.enable(model, budget=2048, stats="model.ropekv.safetensors")
    model.generate(**inputs, max_new_tokens=8192)    # a fresh RopeKVCache for this call
    hf_ropekv.disable(model)                         # back to DynamicCache

    with hf_ropekv.enabled(model, budget=1024):      # temporary; restores what was there before
        trainer.evaluate()

    print(hf_ropekv.last_summary(model))             # what the most recent generate() kept, in one line
    cache = hf_ropekv.last_cache(model)              # its RopeKVCache, while something else keeps it alive

How it works. transformers has no registry for custom ``cache_implementation`` names, so ``enable`` wraps the
one method through which every ``generate()`` call gets its cache: ``GenerationMixin._prepare_cache_for_generation``
(same signature on 5.17 and 5.24; 5.17 keeps the cache under ``model_kwargs["past_key_values"]``, 5.24 under
``model_kwargs["cache"]``). The wrapper is an *instance* attribute of the model: nothing in transformers or in
other models changes, and ``disable`` deletes it again. It runs transformers' own preparation first, and only when
transformers just made a plain ``DynamicCache`` for this call does it put a fresh ``RopeKVCache(model, ...)`` in
its place. Therefore:

- a cache passed by the user (``past_key_values=`` / ``cache=``) always wins;
- ``use_cache=False``, and an explicit ``cache_implementation`` other than ``"dynamic"`` (``"static"``,
  ``"offloaded"``, ``"quantized"``), keep their transformers meaning (with a warning);
- every call gets its own cache (a cache belongs to one batch), whoever calls ``generate``: ``pipeline``,
  ``Trainer``/``Seq2SeqTrainer`` evaluation, a ``compute_metrics`` loop; beam search and batches included, and
  however ``model.generation_config`` is changed or replaced;
- decoding modes that must roll the cache back (assisted/speculative decoding, DoLa, contrastive search) get
  transformers' ``DynamicCache`` (with a warning when a budget is set): a compacted cache cannot be cropped.

Inspection. ``enable`` also wraps the instance's ``generate`` (again an instance attribute, removed by ``disable``)
to learn when a call ends: then it takes a :class:`CacheSummary` of each cache it made during that call, keeps it
for :func:`last_summary` and logs it at INFO level on the ``hf_ropekv`` logger, one line per ``generate()``. The
cache itself is held weakly (:func:`last_cache`): remembering it must not keep its KV memory alive between calls.
These records outlive ``disable`` (so ``with enabled(...):`` blocks can be inspected afterwards) and are not copied
with the model.

Copies. The wrappers hold the model weakly (``del model`` frees it without the garbage collector), and a copy of an
enabled model (``copy.deepcopy``, ``pickle``, ``torch.save``) **stays enabled with the same options**: its
wrappers are the copy's own and never call into the original. ``hf_ropekv.detach(model)`` removes them with
everything else hf_ropekv put on the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import types
import weakref
from typing import Any, Callable, Iterator, TypeVar

from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from .. import _compat
from ..warnings import warn
from .generate_methods import _WRAPPED_MARK, ModelMethodWrapper, WRAPPED_METHODS as ATTACH_WRAPPED_METHODS
from ..cache.cache import RopeKVCache
from ..model.geometry import ModelGeometry
from ..cache.summary import CacheSummary
from .enable_checks import (
    GENERATION_HOOK,
    EnableConfig,
    describe_options,
    is_scorer_factory,
    keep_transformers_cache,
    validated_options,
    warn_many_rows,
    warn_risky,
)

logger = logging.get_logger(__name__)

__all__ = ["enable", "disable", "enabled", "is_enabled", "last_cache", "last_summary"]

ModelT = TypeVar("ModelT", bound=nn.Module)

_STATE_ATTR = "_hf_ropekv_enablement"
_HOOK_ATTR = GENERATION_HOOK
_GENERATE_ATTR = "generate"
#: The instance attributes ``enable`` replaces by its wrappers, and ``disable`` restores.
_WRAPPED_ATTRS = (_HOOK_ATTR, _GENERATE_ATTR)



class _Enablement:
    """What ``enable`` stored on a model: the cache options and what it replaced."""

    def __init__(
        self, options: dict[str, Any], geometry: ModelGeometry, previous: dict[str, Any], attach_had: set[str]
    ):
        self.options = options
        self.geometry = geometry
        self.previous = previous  # per wrapped attribute: the instance attribute that was there before, or None
        self.attach_had = attach_had  # which of the methods hf_ropekv.hooks.attach wraps were instance attributes before
        self.caches_created = 0

    def new_cache(self, model: nn.Module) -> RopeKVCache:
        options = dict(self.options)
        scorer = options.get("scorer")
        if is_scorer_factory(scorer):
            options["scorer"] = scorer()  # one scorer per cache
        self.caches_created += 1
        return RopeKVCache(model, **options)


class _LastGeneration:
    """The cache enable made for a model's most recent generate() call, and its summary once that call ended."""

    def __init__(self, cache: RopeKVCache):
        self.cache_ref = weakref.ref(cache)  # weak: see last_cache
        self.summary: CacheSummary | None = None  # None while its generate() runs


#: model -> its _LastGeneration. Outside the model's __dict__: survives disable(), is not copied or pickled with it.
_LAST: "weakref.WeakKeyDictionary[nn.Module, _LastGeneration]" = weakref.WeakKeyDictionary()
#: The caches the hook made during the innermost wrapped generate() call of this thread / async task.
_CACHES_MADE: contextvars.ContextVar[list[RopeKVCache] | None] = contextvars.ContextVar(
    "hf_ropekv_caches_made", default=None
)


# --------------------------------------------------------------------------- public API


def enable(model: ModelT, budget: int | None = None, *, stats: Any = None, **options: Any) -> ModelT:
    """Give every ``model.generate()`` call that passes no cache of its own a fresh :class:`RopeKVCache`.

    Args:
        model: a decoder-only RoPE ``PreTrainedModel`` with ``generate`` (any dtype, device or ``device_map``).
        budget: tokens kept per row, KV head and layer (see :class:`RopeKVCache`); ``None`` never evicts.
        stats: query statistics for the default RoPE scorer: a ``FrequencyStats`` or the path of a file from
            ``hf_ropekv.calibrate``. Loaded and checked against the model once, here. ``None`` gathers them
            online, from each call's prompt and decoding steps.
        **options: any other keyword of :class:`RopeKVCache`: ``compress_every``, ``page_size``, ``window``,
            ``sink``, ``protect_prompt``, ``scorer``, ``selection``, ``seed``, ``learn_workload``,
            ``prior_tokens``, ``stats_half_life``, ``stats_prompt_weight``, ``stats_head_shrink``, ``static``,
            ``dynamic_batch``, ``cuda_graphs``
            (with ``learn_workload=True`` the calls of an enabled model learn its workload statistics: see
            ``hf_ropekv.workload_statistics``). ``scorer`` may be a scorer
            (shared by all calls) or a zero-argument callable returning one (called once per cache).

    Returns:
        ``model`` itself, for chaining. Calling ``enable`` again replaces the options.

    Raises:
        TypeError: ``model`` cannot ``generate``, or an option is unknown.
        ValueError: an option is invalid, the model is not supported, or ``stats`` do not fit the model.
    """
    target = _generating_model(model)
    config = validated_options(target, budget, stats, options)
    warn_risky(target, config)
    _install(target, config)
    return model


def disable(model: ModelT) -> ModelT:
    """Undo :func:`enable`: ``generate()`` makes transformers' own caches again. A no-op when not enabled.

    The model's attributes are restored exactly (the wrappers are deleted, or the attributes that were there
    before are put back). Caches already handed out keep working, and :func:`last_summary` / :func:`last_cache`
    still describe the last call.
    """
    wrapper, model = model, _generating_model(model)
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        return wrapper
    for attr in _WRAPPED_ATTRS:
        _restore(model, attr, state.previous.get(attr))
    for attr in ATTACH_WRAPPED_METHODS:  # wrapped by hf_ropekv.hooks.attach when a cache is built
        wrapped = model.__dict__.get(attr)
        if attr not in state.attach_had and wrapped is not None and _is_attach_wrapper(wrapped):
            delattr(model, attr)
    delattr(model, _STATE_ATTR)
    logger.info("hf_ropekv disabled on %s (%d caches were created).", type(model).__name__, state.caches_created)
    return wrapper


@contextlib.contextmanager
def enabled(model: ModelT, budget: int | None = None, *, stats: Any = None, **options: Any) -> Iterator[ModelT]:
    """Context-manager form of :func:`enable`: on exit (exception or not) the model is as it was on entry.

    Nesting is safe: an inner block with other options restores the outer block's options when it ends.

        with hf_ropekv.enabled(model, budget=1024) as m:
            m.generate(...)
    """
    target = _generating_model(model)
    previous = target.__dict__.get(_STATE_ATTR)
    previous_options = None if previous is None else dict(previous.options)
    enable(model, budget, stats=stats, **options)
    try:
        yield model
    finally:
        if previous_options is None:
            disable(target)
        else:
            state = target.__dict__.get(_STATE_ATTR)
            if state is None:  # disabled inside the block: enable again with the outer options
                _install(target, EnableConfig(previous_options, previous.geometry))
            else:
                state.options = previous_options


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` is in effect on ``model``."""
    model = _generating_model(model)
    return _STATE_ATTR in model.__dict__ and _is_our_wrapper(model.__dict__.get(_HOOK_ATTR), model)


def last_summary(model: nn.Module) -> CacheSummary:
    """What the cache of ``model``'s most recent ``generate()`` call kept, taken when that call returned.

    "Most recent call" means the latest one that :func:`enable` gave a :class:`RopeKVCache` (calls with a cache of
    their own, ``use_cache=False`` or a cache-cropping decoding mode get none). The summary is kept after
    :func:`disable`; while that call still runs (a streamer, a stopping criterion), it describes the cache now.

    Raises:
        LookupError: ``enable`` was never called on ``model``, or no ``generate()`` call used a cache from it yet.
    """
    record = _last_generation(model)
    if record.summary is not None:
        return record.summary
    cache = record.cache_ref()
    if cache is None:  # its generate() never finished, and nothing holds the cache any longer
        raise LookupError(f"The RopeKVCache of the last generate() of {type(model).__name__} was freed before it ended.")
    return CacheSummary.from_cache(cache)


def last_cache(model: nn.Module) -> RopeKVCache:
    """The :class:`RopeKVCache` that :func:`enable` gave ``model``'s most recent ``generate()`` call.

    hf_ropekv holds it *weakly*: remembering a cache must not keep its KV memory alive between calls. So it is
    there as long as something else holds it: during its ``generate()`` call (from a streamer, a logits processor
    or a stopping criterion), or afterwards through ``generate(..., return_dict_in_generate=True)``'s output (its
    ``past_key_values``, or ``cache`` from transformers 5.24). Once nothing does, Python may free it at any time;
    :func:`last_summary` keeps its numbers for good.

    Raises:
        LookupError: ``enable`` was never called on ``model``, no ``generate()`` call used a cache from it yet, or
            the cache was freed (the message says how to keep it).
    """
    record = _last_generation(model)
    cache = record.cache_ref()
    if cache is None:
        raise LookupError(
            f"The RopeKVCache of the last generate() of {type(model).__name__} was freed: hf_ropekv holds it weakly "
            "so that it does not keep KV memory alive. hf_ropekv.last_summary(model) still has its numbers; to keep "
            "the cache itself, call generate(..., return_dict_in_generate=True) and hold on to the output."
        )
    return cache


# --------------------------------------------------------------------------- the hook


def _install(model: nn.Module, config: EnableConfig) -> None:
    state = model.__dict__.get(_STATE_ATTR)
    if state is not None and _is_our_wrapper(model.__dict__.get(_HOOK_ATTR), model):
        state.options = config.options
        logger.info("hf_ropekv.enable: options of %s replaced.", type(model).__name__)
        return
    previous = {}
    for attr in _WRAPPED_ATTRS:
        found = model.__dict__.get(attr)
        # An unpickled copy's leftover (see _restore) is the class's own method: nothing to chain to.
        previous[attr] = None if _is_class_method_copy(found, model, attr) else found
    state = _Enablement(
        config.options,
        config.geometry,
        previous=previous,
        attach_had={attr for attr in ATTACH_WRAPPED_METHODS if attr in model.__dict__},
    )
    # nn.Module.__setattr__ stores plain callables in the instance __dict__, where attribute lookup finds them
    # before the class's method.
    object.__setattr__(model, _STATE_ATTR, state)
    setattr(model, _HOOK_ATTR, _PrepareCacheHook(model, previous[_HOOK_ATTR]))
    setattr(model, _GENERATE_ATTR, _GenerateWrapper(model, previous[_GENERATE_ATTR]))
    logger.info("hf_ropekv enabled on %s: %s", type(model).__name__, describe_options(config.options))


class _EnableWrapper(ModelMethodWrapper):
    """A method of one model instance replaced by :func:`enable` (an instance attribute).

    It holds the model weakly: a wrapper stored on the model that held it would keep the model alive until the
    garbage collector ran. A copy of the model (``copy.deepcopy``, ``pickle``, ``torch.save``) gets wrappers of
    the copy, and the enable state is copied with it: **a copy stays enabled with the same options**.
    """


class _PrepareCacheHook(_EnableWrapper):
    """The replacement of ``_prepare_cache_for_generation``: a fresh RopeKVCache where transformers made a
    DynamicCache."""

    name = _HOOK_ATTR

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, original = self._model_and_original()
        state = model.__dict__.get(_STATE_ATTR)
        if state is None:
            return original(*args, **kwargs)
        call = _prepare_cache_call(original, args, kwargs)
        if call is None:
            return original(*args, **kwargs)
        generation_config, model_kwargs, mode, batch_size = call
        reason = keep_transformers_cache(state.options, generation_config, model_kwargs, mode)
        result = original(*args, **kwargs)
        if reason is not None:
            logger.debug("hf_ropekv: generate() keeps transformers' cache (%s).", reason)
            return result
        for name in _compat.CACHE_KWARGS:
            if type(model_kwargs.get(name)) is DynamicCache:
                cache = model_kwargs[name] = state.new_cache(model)
                _note_new_cache(model, cache)
                warn_many_rows(state.options, state.geometry, generation_config, batch_size)
                break
        return result


class _GenerateWrapper(_EnableWrapper):
    """The replacement of ``generate``: when the call ends, summarise (and log) the caches the hook made in it."""

    name = _GENERATE_ATTR

    def __init__(self, model: nn.Module, previous: Any = None) -> None:
        super().__init__(model, previous)
        # Name, docstring and signature of the method it stands for (without ``self``, as a bound method shows).
        method = getattr(type(model), _GENERATE_ATTR)
        self.__name__, self.__qualname__, self.__doc__ = method.__name__, method.__qualname__, method.__doc__
        signature = inspect.signature(method)
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, original = self._model_and_original()
        if model.__dict__.get(_STATE_ATTR) is None:
            return original(*args, **kwargs)
        made: list[RopeKVCache] = []
        token = _CACHES_MADE.set(made)  # a nested generate() (another model's) sets its own list
        try:
            output = original(*args, **kwargs)
        finally:
            _CACHES_MADE.reset(token)
        for cache in made:
            logger.info("hf_ropekv, %s.generate(): %s", type(model).__name__, _note_finished_cache(model, cache))
        return output


def _note_new_cache(model: nn.Module, cache: RopeKVCache) -> None:
    """The hook gave ``cache`` to a generate() call of ``model``: it is now that model's last cache."""
    _LAST[model] = _LastGeneration(cache)
    made = _CACHES_MADE.get()
    if made is not None:
        made.append(cache)


def _note_finished_cache(model: nn.Module, cache: RopeKVCache) -> CacheSummary:
    """The generate() call that used ``cache`` ended: keep its summary while it is still ``model``'s last cache."""
    summary = CacheSummary.from_cache(cache)
    record = _LAST.get(model)
    if record is not None and record.cache_ref() is cache:
        record.summary = summary
    return summary


def _last_generation(model: nn.Module) -> _LastGeneration:
    target = _generating_model(model)
    record = _LAST.get(target)
    if record is not None:
        return record
    name = type(target).__name__
    if is_enabled(target):
        raise LookupError(
            f"No generate() call of {name} has used a cache from hf_ropekv.enable() yet (calls that pass their own "
            "cache, use_cache=False, or assisted/DoLa/contrastive decoding get none)."
        )
    raise LookupError(
        f"hf_ropekv.enable() was never called on this {name}, so hf_ropekv made no cache for it to inspect. Call "
        "hf_ropekv.enable(model, budget=...) before generate(), or pass your own RopeKVCache to generate() and read "
        "its properties (or hf_ropekv.CacheSummary.from_cache(cache))."
    )


def _prepare_cache_call(original: Callable[..., Any], args: tuple, kwargs: dict) -> tuple | None:
    """``(generation_config, model_kwargs, generation_mode, batch_size)`` of a ``_prepare_cache_for_generation`` call.

    [_compat candidate] transformers 5.17 and 5.24 both call it as ``(generation_config, model_kwargs,
    generation_mode, batch_size, max_cache_length)``; the arguments are bound by name so that a reordering in a
    later version is harmless, and an unrecognisable call leaves generation untouched (with a warning).
    """
    try:
        bound = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    generation_config, model_kwargs = bound.get("generation_config"), bound.get("model_kwargs")
    if generation_config is None or not isinstance(model_kwargs, dict):
        warn(
            "hf_ropekv.enable: this transformers version calls `_prepare_cache_for_generation` in an unknown way; "
            "generate() uses transformers' own cache. Pass cache=RopeKVCache(model, ...) explicitly "
            "(past_key_values= before transformers 5.24)."
        )
        return None
    mode = bound.get("generation_mode")
    return generation_config, model_kwargs, getattr(mode, "value", mode), bound.get("batch_size")


def _generating_model(model: Any) -> Any:
    """The model whose ``generate`` does the work: wrappers such as PEFT's ``PeftModel`` delegate ``generate`` to
    ``get_base_model()``, so the hook must sit on that model, not on the wrapper."""
    from transformers import GenerationMixin

    if isinstance(model, GenerationMixin) or not isinstance(model, nn.Module):
        return model
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        base = get_base()
        if isinstance(base, nn.Module) and base is not model:
            return base
    return model


def _restore(model: nn.Module, attr: str, previous: Any) -> None:
    """Undo one of enable's wrappers: ``attr`` of ``model`` becomes ``previous`` (deleted if ``None``)."""
    current = model.__dict__.get(attr)
    if current is None:
        return
    if _is_our_wrapper(current, model):
        if previous is None:
            delattr(model, attr)
        else:
            setattr(model, attr, previous)
    elif _is_class_method_copy(current, model, attr):
        # An unpickled copy: pickle rebuilt our bound wrapper as the class's own method. Nothing to undo but that.
        delattr(model, attr)
    else:
        # Someone wrapped the method after us: our wrapper stays in their chain but, with the state gone, only
        # passes through.
        warn(
            f"hf_ropekv.disable: `{attr}` was wrapped again after hf_ropekv.enable(); the hf_ropekv wrapper stays "
            "inside that wrapper as a pass-through."
        )


def _is_our_wrapper(method: Any, model: nn.Module) -> bool:
    return isinstance(method, _EnableWrapper) and method._model_ref() is model


def _is_class_method_copy(method: Any, model: nn.Module, attr: str) -> bool:
    """The class's own method ``attr`` bound to ``model`` and stored on the instance: what pickle makes of our
    wrappers (it re-binds a method by name, before the instance state is restored)."""
    return (
        isinstance(method, types.MethodType)
        and method.__self__ is model
        and method.__func__ is getattr(type(model), attr, None)
    )


def _is_attach_wrapper(function: Any) -> bool:
    return bool(getattr(function, _WRAPPED_MARK, False))
