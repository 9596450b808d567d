"""Turn RopeKVCache on for every ``generate()`` call of a model:

    hf_ropekv.enable(model, budget=2048)          # every generate() without a cache of its own gets a fresh one
    print(hf_ropekv.last_summary(model))          # what the most recent generate() kept
    hf_ropekv.disable(model)                      # or: with hf_ropekv.enabled(model, budget=1024): ...

``enable`` wraps the model instance's ``_prepare_cache_for_generation``: after transformers' own preparation, a plain
``DynamicCache`` is replaced by a fresh ``RopeKVCache``. A cache passed by the caller, ``use_cache=False``, another
``cache_implementation`` and the modes that roll the cache back (assisted, DoLa, contrastive) keep transformers'
cache. ``generate`` is wrapped too, to keep each call's summary. A copy of an enabled model stays enabled."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from . import _compat
from .adapter.generate_methods import ModelMethodWrapper
from .cache.cache import RopeKVCache
from .cache.model_checks import check_static, checked_options
from .cache.options import CacheOptions
from .cache.scorer_setup import check_scorer
from .cache.summary import CacheSummary
from .model.geometry import ModelGeometry
from .scorers.frequency import FrequencyScorer
from .statistics.frequency_stats import FrequencyStats
from .warnings import warn

logger = logging.get_logger(__name__)

__all__ = ["enable", "disable", "enabled", "is_enabled", "last_summary"]

ModelT = TypeVar("ModelT", bound=nn.Module)

_STATE_ATTR = "_hf_ropekv_enablement"
DYNAMIC_IMPLEMENTATIONS = (None, "dynamic")  # cache_implementation values enable replaces
CROPPING_MODES = ("assisted_generation", "dola_generation", "contrastive_search")  # they roll the cache back
MANY_ROWS = 64  # batch rows from which the per-row budget is worth a warning
SMALL_BUDGET = 256  # budgets below this leave little room beside the pinned prompt


@dataclasses.dataclass(eq=False)
class _Enablement:
    options: dict[str, Any]
    geometry: ModelGeometry
    caches_created: int = 0


#: model -> the summary of its most recent generate()'s cache (a weak reference to it while the call runs).
_LAST: "weakref.WeakKeyDictionary[nn.Module, CacheSummary | weakref.ref]" = weakref.WeakKeyDictionary()
#: The caches made during the innermost wrapped generate() call of this thread / async task.
_CACHES_MADE: contextvars.ContextVar[list[RopeKVCache] | None] = contextvars.ContextVar(
    "hf_ropekv_caches_made", default=None)


def enable(model: ModelT, budget: int | None = None, **options: Any) -> ModelT:
    """Give every ``model.generate()`` call that passes no cache of its own a fresh :class:`RopeKVCache`.

    ``budget`` and ``**options`` are exactly :class:`RopeKVCache`'s; a scorer is copied into every cache, and a
    ``FrequencyScorer(stats=path)`` file is loaded and checked once, here. Returns ``model``; calling ``enable``
    again replaces the options. Raises ``TypeError`` (no ``generate``, an unknown option) or ``ValueError`` (an
    invalid option, an unsupported model, statistics that do not fit) before any generation."""
    target = _generating_model(model)
    state = _checked(target, budget, options)
    _warn_risky(target, state.options)
    if isinstance(target.__dict__.get(_PrepareCacheHook.name), _PrepareCacheHook):
        target.__dict__[_STATE_ATTR].options = state.options
        logger.info("hf_ropekv.enable: options of %s replaced.", type(target).__name__)
        return model
    object.__setattr__(target, _STATE_ATTR, state)  # (nn.Module.__setattr__ would try to register it)
    _PrepareCacheHook.install(target)
    _GenerateWrapper.install(target)
    logger.info("hf_ropekv enabled on %s: %s", type(target).__name__, state.options)
    return model


def disable(model: ModelT) -> ModelT:
    """Undo :func:`enable` (a no-op when not enabled); caches handed out keep working."""
    target = _generating_model(model)
    state = target.__dict__.get(_STATE_ATTR)
    if state is None:
        return model
    for wrapper in (_PrepareCacheHook, _GenerateWrapper):
        if not wrapper.uninstall(target):
            warn(f"hf_ropekv.disable: `{wrapper.name}` was wrapped again after hf_ropekv.enable(); the hf_ropekv "
                 "wrapper stays inside that wrapper as a pass-through.")
    delattr(target, _STATE_ATTR)
    logger.info("hf_ropekv disabled on %s (%d caches were created).", type(target).__name__, state.caches_created)
    return model


@contextlib.contextmanager
def enabled(model: ModelT, budget: int | None = None, **options: Any) -> Iterator[ModelT]:
    """:func:`enable` for a block: on exit the model is as it was on entry (outer options included)."""
    target = _generating_model(model)
    state = target.__dict__.get(_STATE_ATTR)
    previous = None if state is None else dict(state.options)  # a copy: enable() replaces the options in place
    enable(model, budget, **options)
    try:
        yield model
    finally:
        if previous is None:
            disable(target)
        elif _STATE_ATTR in target.__dict__:
            target.__dict__[_STATE_ATTR].options = previous
        else:  # disabled inside the block: enabled again with the outer options
            enable(target, **previous)


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` is in effect on ``model``."""
    target = _generating_model(model)
    return _STATE_ATTR in target.__dict__ and isinstance(target.__dict__.get(_PrepareCacheHook.name), _PrepareCacheHook)


def last_summary(model: nn.Module) -> CacheSummary:
    """What the cache :func:`enable` gave ``model``'s most recent ``generate()`` call kept (while that call runs,
    the cache now); ``LookupError`` when there was none."""
    target = _generating_model(model)
    record = _LAST.get(target)
    if isinstance(record, weakref.ref):  # the running call's cache
        record = None if (cache := record()) is None else cache.summary()
    if record is not None:
        return record
    name = type(target).__name__
    if is_enabled(target):
        raise LookupError(f"No generate() call of {name} has used a cache from hf_ropekv.enable() yet (calls that pass "
                          "their own cache, use_cache=False, or assisted/DoLa/contrastive decoding get none).")
    raise LookupError(f"hf_ropekv.enable() was never called on this {name}. Call hf_ropekv.enable(model, budget=...) "
                      "before generate(), or pass your own RopeKVCache and print(cache.summary()).")


def _checked(model: nn.Module, budget: Any, options: dict[str, Any]) -> _Enablement:
    """Everything ``RopeKVCache(model, ...)`` would check, without building a cache."""
    if not isinstance(model, nn.Module) or not callable(getattr(model, _PrepareCacheHook.name, None)):
        raise TypeError(f"hf_ropekv.enable needs a transformers model with generate() (a GenerationMixin); got "
                        f"{type(model).__name__}.")
    _, geometry = checked_options(model, budget, options, "hf_ropekv.enable")
    scorer = options.get("scorer")
    check_scorer(scorer)
    if isinstance(scorer, FrequencyScorer) and scorer.stats is not None:  # loaded once; every cache shares them
        stats = FrequencyStats.resolve(scorer.stats, geometry, model)
        options = {**options, "scorer": dataclasses.replace(scorer, stats=stats)}
    if options.get("static") is True:
        check_static(geometry, budget, model, scorer)
    return _Enablement({"budget": budget, **options}, geometry)


def _warn_risky(model: nn.Module, options: dict[str, Any]) -> None:
    """Warn about options that work but are likely not what the user wants."""
    budget, name = options["budget"], type(model).__name__
    if budget is not None and budget < SMALL_BUDGET:
        warn(f"hf_ropekv.enable: budget={budget} is small. The prompt is pinned and counts toward the budget (a "
             "longer prompt raises), and little room is left for the answer: expect degraded outputs. Budgets of "
             "1024-4096 tokens are typical.")
    mode = _cropping_mode(getattr(model, "generation_config", None))
    if budget is not None and mode is not None:
        warn(f"hf_ropekv.enable: {name}.generation_config asks for {mode}, which rolls the cache back; a cache that "
             "evicted tokens cannot. Such calls get transformers' DynamicCache instead of RopeKVCache.")
    implementation = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if implementation not in (*DYNAMIC_IMPLEMENTATIONS, "hybrid"):
        warn(f"hf_ropekv.enable: {name}.generation_config.cache_implementation={implementation!r} is set; while it "
             "is, generate() builds that cache and not RopeKVCache. Set it to None to use RopeKVCache.")


def _cropping_mode(generation_config: Any) -> str | None:
    """Name of a cache-cropping decoding mode a generation config asks for, if any."""
    if any(getattr(generation_config, name, None) for name in ("prompt_lookup_num_tokens", "assistant_early_exit")):
        return "assisted decoding"
    if getattr(generation_config, "dola_layers", None) is not None:
        return "DoLa decoding"
    penalty_alpha, top_k = getattr(generation_config, "penalty_alpha", None), getattr(generation_config, "top_k", None)
    if penalty_alpha is not None and penalty_alpha > 0 and top_k is not None and top_k > 1:
        return "contrastive search"
    return None


class _PrepareCacheHook(ModelMethodWrapper):
    name = "_prepare_cache_for_generation"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, original = self._model_and_original()
        state = model.__dict__.get(_STATE_ATTR)
        call = None if state is None else _prepare_cache_call(original, args, kwargs)
        if call is None:
            return original(*args, **kwargs)
        generation_config, model_kwargs, mode, batch_size = call
        reason = _keep_transformers_cache(state.options, generation_config, model_kwargs, mode)
        result = original(*args, **kwargs)
        if reason is not None:
            logger.debug("hf_ropekv: generate() keeps transformers' cache (%s).", reason)
            return result
        for name in _compat.CACHE_KWARGS:
            if type(model_kwargs.get(name)) is DynamicCache:
                cache = model_kwargs[name] = RopeKVCache(model, **state.options)
                state.caches_created += 1
                _LAST[model] = weakref.ref(cache)
                made = _CACHES_MADE.get()
                if made is not None:
                    made.append(cache)
                _warn_many_rows(state, generation_config, batch_size)
                break
        return result


class _GenerateWrapper(ModelMethodWrapper):
    name = "generate"

    def __init__(self, model: nn.Module, previous: Any = None) -> None:
        super().__init__(model, previous)
        method = getattr(type(model), self.name)  # look like the bound method it stands for
        self.__name__, self.__qualname__, self.__doc__ = method.__name__, method.__qualname__, method.__doc__
        self.__signature__ = inspect.signature(method.__get__(model))

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
            summary = cache.summary()
            record = _LAST.get(model)
            if isinstance(record, weakref.ref) and record() is cache:
                _LAST[model] = summary
            logger.info("hf_ropekv, %s.generate(): %s", type(model).__name__, summary)
        return output


def _keep_transformers_cache(options: dict[str, Any], generation_config: Any, model_kwargs: dict,
                             mode: Any) -> str | None:
    """Why this call must keep the cache transformers prepares, or ``None`` to use a RopeKVCache."""
    if any(model_kwargs.get(name) is not None for name in _compat.CACHE_KWARGS):
        return "the caller passed a cache"
    if getattr(generation_config, "use_cache", True) is False:
        return "use_cache=False"
    implementation = getattr(generation_config, "cache_implementation", None)
    if implementation not in DYNAMIC_IMPLEMENTATIONS:
        warn(f"hf_ropekv: generate() was asked for cache_implementation={implementation!r}; that cache is used "
             "instead of RopeKVCache for these calls.")
        return f"cache_implementation={implementation!r}"
    if getattr(generation_config, "is_assistant", False):
        return "assistant model (its cache is rolled back)"
    if mode in CROPPING_MODES:
        if options.get("budget") is not None:  # without a budget RopeKVCache would only equal DynamicCache
            warn(f"hf_ropekv: {mode} rolls the cache back, which a cache that evicted tokens cannot do; these calls "
                 "use transformers' DynamicCache (no memory bound). Use greedy/sampling/beam search for a bounded "
                 "cache.")
        return mode
    return None


def _warn_many_rows(state: _Enablement, generation_config: Any, batch_size: Any) -> None:
    """Warn when a call's rows (batch x beams / returned sequences) make the per-row budget a lot of memory."""
    budget = state.options.get("budget")
    if budget is None or not isinstance(batch_size, int):
        return
    expand = max(getattr(generation_config, name, 1) or 1 for name in ("num_beams", "num_return_sequences"))
    rows = batch_size * expand
    if rows >= MANY_ROWS:
        slots = budget + state.options.get("compress_every", CacheOptions.compress_every)
        estimate = rows * slots * state.geometry.kv_bytes_per_token(torch.bfloat16) / 2**30
        warn(f"hf_ropekv: {rows} rows (batch {batch_size} x {expand} beams/sequences) each keep up to "
             f"budget + compress_every = {slots} tokens: about {estimate:.1f} GiB of KV in 16-bit. The budget is per "
             "row: lower it, or the batch / num_beams, if memory is tight.")


def _prepare_cache_call(original: Callable[..., Any], args: tuple, kwargs: dict) -> tuple | None:
    """``(generation_config, model_kwargs, generation_mode, batch_size)`` of a ``_prepare_cache_for_generation``
    call, bound by name; None, with a warning, when unrecognisable."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    generation_config, model_kwargs = bound.get("generation_config"), bound.get("model_kwargs")
    if generation_config is None or not isinstance(model_kwargs, dict):
        warn("hf_ropekv.enable: this transformers version calls `_prepare_cache_for_generation` in an unknown way; "
             "generate() uses transformers' own cache. Pass RopeKVCache(model, ...) to generate() explicitly "
             "(`cache=` from transformers 5.24 on, `past_key_values=` before).")
        return None
    mode = bound.get("generation_mode")
    return generation_config, model_kwargs, getattr(mode, "value", mode), bound.get("batch_size")


def _generating_model(model: Any) -> Any:
    """The model whose ``generate`` does the work (PEFT's ``PeftModel`` delegates to ``get_base_model()``)."""
    from transformers import GenerationMixin

    if isinstance(model, GenerationMixin) or not isinstance(model, nn.Module):
        return model
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        base = get_base()
        if isinstance(base, nn.Module) and base is not model:
            return base
    return model
