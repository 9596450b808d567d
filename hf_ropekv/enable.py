"""Turn RopeKVCache on for every ``generate()`` call of a model, in one line.

    import hf_ropekv
    hf_ropekv.enable(model, budget=2048)              # every generate() without a cache of its own gets a fresh one
    model.generate(**inputs, max_new_tokens=8192)
    print(hf_ropekv.last_summary(model))             # what the most recent generate() kept, in one line
    hf_ropekv.disable(model)                         # back to DynamicCache

    with hf_ropekv.enabled(model, budget=1024):      # temporary; restores what was there before
        trainer.evaluate()

How it works. transformers has no registry for custom ``cache_implementation`` names, so ``enable`` wraps the one
method through which every ``generate()`` call gets its cache, ``_prepare_cache_for_generation`` (same signature on
5.17 through 5.25), as an *instance* attribute: nothing in transformers or in other models changes. It runs
transformers' own preparation first and, only where that made a plain ``DynamicCache``, puts a fresh
``RopeKVCache(model, ...)`` in its place. So a cache passed by the caller wins; ``use_cache=False`` and an explicit
``cache_implementation`` keep their meaning; every call (``pipeline``, ``Trainer`` evaluation, beam search) gets its
own cache; and decoding modes that roll the cache back (assisted decoding, DoLa, contrastive search) keep
transformers' ``DynamicCache``, with a warning when a budget is set. ``enable`` also wraps ``generate`` to summarise
each call's cache when it ends (:func:`last_summary`, and one INFO line on the ``hf_ropekv`` logger). A copy of an
enabled model (``copy.deepcopy``, ``pickle``) stays enabled with the same options.
"""

from __future__ import annotations

import contextlib
import contextvars
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
from .cache.options import OPTION_NAMES, CacheOptions
from .cache.scorer_setup import check_scorer
from .cache.summary import CacheSummary
from .model.geometry import ModelGeometry, describe
from .scorers.frequency import FrequencyScorer
from .warnings import warn

logger = logging.get_logger(__name__)

__all__ = ["enable", "disable", "enabled", "is_enabled", "last_summary"]

ModelT = TypeVar("ModelT", bound=nn.Module)

_STATE_ATTR = "_hf_ropekv_enablement"
#: ``cache_implementation`` values that mean "transformers' default dynamic cache": enable replaces those.
DYNAMIC_IMPLEMENTATIONS = (None, "dynamic")
#: Generation modes that crop the cache (roll it back), impossible once tokens were evicted.
CROPPING_MODES = ("assisted_generation", "dola_generation", "contrastive_search")
#: Batch rows (batch x beams / returned sequences) from which the per-row budget is worth a warning.
MANY_ROWS = 64
#: Budgets below this are small for a prompt plus a useful answer (the prompt is pinned and counts).
SMALL_BUDGET = 256


class _Enablement:
    """What ``enable`` stored on a model: the checked cache options and the model's geometry."""

    def __init__(self, options: dict[str, Any], geometry: ModelGeometry) -> None:
        self.options = options
        self.geometry = geometry
        self.caches_created = 0


#: model -> the summary of its most recent generate()'s cache (or the cache itself while that call runs, weakly).
#: Outside the model's __dict__: survives disable(), is not copied or pickled with it.
_LAST: "weakref.WeakKeyDictionary[nn.Module, CacheSummary | weakref.ref]" = weakref.WeakKeyDictionary()
#: The caches the hook made during the innermost wrapped generate() call of this thread / async task.
_CACHES_MADE: contextvars.ContextVar[list[RopeKVCache] | None] = contextvars.ContextVar(
    "hf_ropekv_caches_made", default=None
)


def enable(model: ModelT, budget: int | None = None, **options: Any) -> ModelT:
    """Give every ``model.generate()`` call that passes no cache of its own a fresh :class:`RopeKVCache`.

    Args:
        model: a decoder-only RoPE ``PreTrainedModel`` with ``generate`` (any dtype, device or ``device_map``).
        budget: tokens kept per row, KV head and layer; ``None`` never evicts.
        **options: exactly :class:`RopeKVCache`'s options (``scorer``, ``compress_every``, ``window``, ``sink``,
            ``protect_prompt``, ``static``, ``kv_bits``). A scorer is copied into every cache; the statistics file
            of a ``FrequencyScorer(stats=path)`` is loaded and checked once, here.

    Returns:
        ``model`` itself. Calling ``enable`` again replaces the options.

    Raises:
        TypeError: ``model`` cannot ``generate``, or an option is unknown.
        ValueError: an option is invalid, the model is not supported, or statistics do not fit the model.
    """
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
    """Undo :func:`enable`: ``generate()`` makes transformers' own caches again. A no-op when not enabled.

    Caches already handed out keep working, and :func:`last_summary` still describes the last call."""
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
    """Context-manager form of :func:`enable`: on exit (exception or not) the model is as it was on entry; an inner
    block with other options restores the outer block's options when it ends."""
    target = _generating_model(model)
    previous = target.__dict__.get(_STATE_ATTR)
    enable(model, budget, **options)
    try:
        yield model
    finally:
        if previous is None:
            disable(target)
        elif _STATE_ATTR in target.__dict__:
            target.__dict__[_STATE_ATTR].options = previous.options
        else:  # disabled inside the block: enabled again with the outer options
            enable(target, **previous.options)


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` is in effect on ``model``."""
    target = _generating_model(model)
    return _STATE_ATTR in target.__dict__ and isinstance(target.__dict__.get(_PrepareCacheHook.name), _PrepareCacheHook)


def last_summary(model: nn.Module) -> CacheSummary:
    """What the cache of ``model``'s most recent ``generate()`` call (one that :func:`enable` gave a cache) kept,
    taken when that call returned; while it still runs (a streamer, a stopping criterion), the cache now.

    Raises:
        LookupError: ``enable`` was never called on ``model``, or no ``generate()`` call used a cache from it yet.
    """
    target = _generating_model(model)
    record = _LAST.get(target)
    if isinstance(record, weakref.ref):
        cache = record()
        if cache is not None:
            return cache.summary()
        record = None
    if record is not None:
        return record
    name = type(target).__name__
    if is_enabled(target):
        raise LookupError(f"No generate() call of {name} has used a cache from hf_ropekv.enable() yet (calls that pass "
                          "their own cache, use_cache=False, or assisted/DoLa/contrastive decoding get none).")
    raise LookupError(f"hf_ropekv.enable() was never called on this {name}. Call hf_ropekv.enable(model, budget=...) "
                      "before generate(), or pass your own RopeKVCache and print(cache.summary()).")


# --------------------------------------------------------------------------- checks, once per enable()
def _checked(model: nn.Module, budget: Any, options: dict[str, Any]) -> _Enablement:
    """Everything ``RopeKVCache(model, ...)`` would check, without building a cache: a bad option fails here."""
    if not isinstance(model, nn.Module) or not callable(getattr(model, _PrepareCacheHook.name, None)):
        raise TypeError(f"hf_ropekv.enable needs a transformers model with generate() (a GenerationMixin); got "
                        f"{type(model).__name__}.")
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"hf_ropekv.enable got unknown option(s) {unknown}; the options are {list(OPTION_NAMES)}.")
    CacheOptions(budget=budget, **{name: value for name, value in options.items() if name != "scorer"})
    geometry = describe(model)  # raises ValueError for models the cache cannot hold
    scorer = options.get("scorer")
    check_scorer(scorer)
    if isinstance(scorer, FrequencyScorer) and scorer.stats is not None:  # loaded once; every cache shares them
        from .statistics.frequency_stats import FrequencyStats

        options = {**options, "scorer": FrequencyScorer(FrequencyStats.resolve(scorer.stats, geometry, model),
                                                         scorer.half_life, scorer.head_shrink, scorer.offsets)}
    if options.get("static") is True:
        from .cache.model_checks import check_static

        check_static(geometry, budget, model, scorer)
    return _Enablement({"budget": budget, **options}, geometry)


def _warn_risky(model: nn.Module, options: dict[str, Any]) -> None:
    """Warn once about options that work but are likely not what the user wants."""
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
    if generation_config is None:
        return None
    if getattr(generation_config, "prompt_lookup_num_tokens", None) or getattr(
            generation_config, "assistant_early_exit", None):
        return "assisted decoding"
    if getattr(generation_config, "dola_layers", None) is not None:
        return "DoLa decoding"
    penalty_alpha, top_k = getattr(generation_config, "penalty_alpha", None), getattr(generation_config, "top_k", None)
    if penalty_alpha is not None and penalty_alpha > 0 and top_k is not None and top_k > 1:
        return "contrastive search"
    return None


# --------------------------------------------------------------------------- the wrappers
class _PrepareCacheHook(ModelMethodWrapper):
    """``_prepare_cache_for_generation``: a fresh RopeKVCache where transformers made a DynamicCache."""

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
    """``generate``: when the call ends, keep (and log) the summary of the caches the hook made in it."""

    name = "generate"

    def __init__(self, model: nn.Module, previous: Any = None) -> None:
        super().__init__(model, previous)
        method = getattr(type(model), self.name)  # what it stands for, as a bound method shows it
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
                 "use transformers' DynamicCache (no memory bound). Use greedy/sampling/beam search for a bounded cache.")
        return mode
    return None


def _warn_many_rows(state: _Enablement, generation_config: Any, batch_size: Any) -> None:
    """Warn when a call's rows (batch x beams / returned sequences) make the per-row budget a lot of memory."""
    budget = state.options.get("budget")
    if budget is None or not isinstance(batch_size, int):
        return
    expand = max(getattr(generation_config, "num_beams", 1) or 1,
                 getattr(generation_config, "num_return_sequences", 1) or 1)
    rows = batch_size * expand
    if rows >= MANY_ROWS:
        slots = budget + state.options.get("compress_every", CacheOptions.compress_every)
        estimate = rows * slots * state.geometry.kv_bytes_per_token(torch.bfloat16) / 2**30
        warn(f"hf_ropekv: {rows} rows (batch {batch_size} x {expand} beams/sequences) each keep up to "
             f"budget + compress_every = {slots} tokens: about {estimate:.1f} GiB of KV in 16-bit. The budget is per "
             "row: lower it, or the batch / num_beams, if memory is tight.")


def _prepare_cache_call(original: Callable[..., Any], args: tuple, kwargs: dict) -> tuple | None:
    """``(generation_config, model_kwargs, generation_mode, batch_size)`` of a ``_prepare_cache_for_generation``
    call, bound by name (a reordering in a later version is harmless); None, with a warning, when unrecognisable."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    generation_config, model_kwargs = bound.get("generation_config"), bound.get("model_kwargs")
    if generation_config is None or not isinstance(model_kwargs, dict):
        warn("hf_ropekv.enable: this transformers version calls `_prepare_cache_for_generation` in an unknown way; "
             "generate() uses transformers' own cache. Pass past_key_values=RopeKVCache(model, ...) explicitly.")
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
