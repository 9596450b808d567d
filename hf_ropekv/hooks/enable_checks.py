"""What :func:`hf_ropekv.enable` checks and warns about: its options, once, when it is called; and, at each
``generate()`` call, whether that call may get a RopeKVCache at all.

The options are checked by the same :class:`~hf_ropekv.cache.options.CacheOptions` as ``RopeKVCache(model, ...)``,
and the model by :func:`~hf_ropekv.model.geometry.describe`, without building a cache: a bad option fails at
``enable``, not at the first ``generate()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from .. import _compat
from ..cache.options import OPTION_NAMES, CacheOptions
from ..model.geometry import ModelGeometry, describe
from ..warnings import warn

logger = logging.get_logger(__name__)

#: The method of a transformers model through which every ``generate()`` call gets its cache (enable wraps it).
GENERATION_HOOK = "_prepare_cache_for_generation"

#: ``cache_implementation`` values that mean "transformers' default dynamic cache": enable replaces those.
DYNAMIC_IMPLEMENTATIONS = (None, "dynamic")
#: Generation modes that crop the cache (roll it back), impossible once tokens were evicted.
CROPPING_MODES = ("assisted_generation", "dola_generation", "contrastive_search")
#: Batch rows (batch x beams / returned sequences) from which the per-row budget is worth a warning.
MANY_ROWS = 64
#: Budgets below this are small for a prompt plus a useful answer (the prompt is pinned and counts).
SMALL_BUDGET = 256


class EnableConfig:
    """Checked options of one ``enable`` call, and the geometry of its model."""

    def __init__(self, options: dict[str, Any], geometry: ModelGeometry):
        self.options = options
        self.geometry = geometry


def validated_options(model: nn.Module, budget: Any, stats: Any, options: dict[str, Any]) -> EnableConfig:
    """Check everything ``RopeKVCache(model, ...)`` would check, once, without building a cache."""
    if not isinstance(model, nn.Module) or not callable(getattr(model, GENERATION_HOOK, None)):
        raise TypeError(
            f"hf_ropekv.enable needs a transformers model with generate() (a GenerationMixin); got "
            f"{type(model).__name__}."
        )
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"hf_ropekv.enable got unknown option(s) {unknown}; RopeKVCache accepts {list(OPTION_NAMES)}.")
    CacheOptions(budget=budget, **{name: value for name, value in options.items() if name != "scorer"})
    geometry = describe(model)  # raises ValueError for models the cache cannot hold
    scorer = options.get("scorer")
    if scorer is not None:
        probe = scorer() if is_scorer_factory(scorer) else scorer
        if not callable(getattr(probe, "score", None)):
            raise TypeError(
                "scorer must have a `score(keys, ctx)` method (see hf_ropekv.scorers), or be a zero-argument callable "
                f"returning such a scorer; got {type(scorer).__name__}."
            )
        if stats is not None:
            raise ValueError("Pass `stats` to the FrequencyScorer you build, or omit `scorer`; not both.")
        if options.get("static") is True:  # ("auto" stays eager with such a scorer, as RopeKVCache does)
            # Refused now, not at the first generate() call, where the cache would be built.
            from ..cache.model_checks import static_scorer_error

            error = static_scorer_error(probe)
            if error is not None:
                raise ValueError(error)
    if stats is not None:
        from ..statistics.frequency_stats import FrequencyStats

        stats = FrequencyStats.resolve(stats, geometry, model)  # loaded once; every cache shares the object
    return EnableConfig({"budget": budget, "stats": stats, **options}, geometry)


def warn_risky(model: nn.Module, config: EnableConfig) -> None:
    """Warn, once at ``enable``, about options that work but are likely not what the user wants (a small budget,
    ``compress_every`` above it, a generation config whose calls will not get a RopeKVCache)."""
    options = config.options
    budget = options["budget"]
    name = type(model).__name__
    if budget is None:
        logger.info("hf_ropekv.enable(%s, budget=None): nothing is evicted; outputs equal DynamicCache's.", name)
    else:
        if budget < SMALL_BUDGET:
            warn(
                f"hf_ropekv.enable: budget={budget} is small. The prompt is pinned and counts toward the budget "
                "(a longer prompt raises), and little room is left for the answer: expect degraded outputs. "
                f"Budgets of 1024-4096 tokens are typical."
            )
        compress_every = options.get("compress_every", 128)
        if compress_every > budget:
            warn(
                f"hf_ropekv.enable: compress_every={compress_every} exceeds budget={budget}; the cache grows to "
                f"{budget + compress_every} tokens before each compaction, more than twice the budget."
            )
        if options.get("stats") is None and options.get("scorer") is None:
            logger.info(
                "hf_ropekv.enable: no calibrated statistics; query statistics are gathered online from each "
                "generate() call's prompt and decoding steps. Short prompts give noisy statistics at first: see "
                "hf_ropekv.calibrate."
            )
        mode = cropping_mode(getattr(model, "generation_config", None))
        if mode is not None:
            warn(
                f"hf_ropekv.enable: {name}.generation_config asks for {mode}, which rolls the cache back; a cache "
                "that evicted tokens cannot. Such calls get transformers' DynamicCache instead of RopeKVCache."
            )
    implementation = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if implementation not in (*DYNAMIC_IMPLEMENTATIONS, "hybrid"):
        warn(
            f"hf_ropekv.enable: {name}.generation_config.cache_implementation={implementation!r} is set; while it "
            "is, generate() builds that cache and not RopeKVCache. Set it to None to use RopeKVCache."
        )


def cropping_mode(generation_config: Any) -> str | None:
    """Name of a cache-cropping decoding mode a generation config asks for, if any."""
    if generation_config is None:
        return None
    if getattr(generation_config, "prompt_lookup_num_tokens", None) or getattr(
        generation_config, "assistant_early_exit", None
    ):
        return "assisted decoding"
    if getattr(generation_config, "dola_layers", None) is not None:
        return "DoLa decoding"
    penalty_alpha, top_k = getattr(generation_config, "penalty_alpha", None), getattr(generation_config, "top_k", None)
    if penalty_alpha is not None and penalty_alpha > 0 and top_k is not None and top_k > 1:
        return "contrastive search"
    return None


def keep_transformers_cache(options: dict[str, Any], generation_config: Any, model_kwargs: dict, mode: Any) -> str | None:
    """Why this call must keep the cache transformers prepares, or ``None`` to use a RopeKVCache."""
    if any(model_kwargs.get(name) is not None for name in _compat.CACHE_KWARGS):
        return "the caller passed a cache"
    if getattr(generation_config, "use_cache", True) is False:
        return "use_cache=False"
    implementation = getattr(generation_config, "cache_implementation", None)
    if implementation not in DYNAMIC_IMPLEMENTATIONS:
        warn(
            f"hf_ropekv: generate() was asked for cache_implementation={implementation!r}; that cache is used "
            "instead of RopeKVCache for these calls."
        )
        return f"cache_implementation={implementation!r}"
    if getattr(generation_config, "is_assistant", False):
        return "assistant model (its cache is rolled back)"
    if mode in CROPPING_MODES:
        # Without a budget RopeKVCache would only equal DynamicCache, so nothing is lost by keeping it.
        if options.get("budget") is not None:
            warn(
                f"hf_ropekv: {mode} rolls the cache back, which a cache that evicted tokens cannot do; these calls "
                "use transformers' DynamicCache (no memory bound). Use greedy/sampling/beam search for a bounded cache."
            )
        return mode
    return None


def warn_many_rows(options: dict[str, Any], geometry: ModelGeometry, generation_config: Any, batch_size: Any) -> None:
    """Warn when a call's rows (batch x beams / returned sequences) make the per-row budget a lot of memory."""
    budget = options.get("budget")
    if budget is None or not isinstance(batch_size, int):
        return
    expand = max(getattr(generation_config, "num_beams", 1) or 1, getattr(generation_config, "num_return_sequences", 1) or 1)
    rows = batch_size * expand
    if rows >= MANY_ROWS:
        compress_every = options.get("compress_every", 128)
        per_token = geometry.kv_bytes_per_token(torch.bfloat16)
        estimate = rows * (budget + compress_every) * per_token / 2**30
        warn(
            f"hf_ropekv: {rows} rows (batch {batch_size} x {expand} beams/sequences) each keep up to "
            f"budget + compress_every = {budget + compress_every} tokens: about {estimate:.1f} GiB of KV in 16-bit. "
            "The budget is per row: lower it, or the batch / num_beams, if memory is tight."
        )


def describe_options(options: dict[str, Any]) -> str:
    """The options in one line for the log (statistics and scorers by their type)."""
    shown = {k: (type(v).__name__ if k in ("stats", "scorer") and v is not None else v) for k, v in options.items()}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def is_scorer_factory(scorer: Any) -> bool:
    """A scorer class, or a zero-argument callable that is not itself a scorer."""
    return isinstance(scorer, type) or (callable(scorer) and not hasattr(scorer, "score"))
