"""Which scorer a cache uses, and what it gathers for it (online statistics, a window of recent queries)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..model.geometry import ModelGeometry
from ..model.special_tokens import generation_token_ids
from ..scorers.base import Scorer
from .options import CacheOptions


def resolve_scorer(scorer: Scorer | None, stats: Any, options: CacheOptions, geometry: ModelGeometry,
                   model: nn.Module | None) -> tuple[Scorer, Any]:
    """The scorer a cache uses and the online statistics it gathers for it (None when it gathers none).

    Only online statistics (the default: no scorer, no ``stats``, a budget and the model) take part in the
    model's workload statistics: unless ``learn_workload=False`` they start from the workload's means (when it
    has learned any) and feed it. A cache with explicit ``stats`` or another scorer neither reads nor feeds it.
    """
    if scorer is not None:
        if not callable(getattr(scorer, "score", None)):
            raise TypeError(
                f"scorer must have a `score(keys, ctx)` method (see hf_ropekv.scorers); got {type(scorer).__name__}."
            )
        if stats is not None:
            raise ValueError("Pass `stats` to the FrequencyScorer you build, or omit `scorer`; not both.")
        return scorer, None
    from ..scorers.frequency import FrequencyScorer

    if stats is not None:
        from ..statistics.frequency_stats import FrequencyStats

        return FrequencyScorer(FrequencyStats.resolve(stats, geometry, model)), None
    if options.budget is None:
        return FrequencyScorer(None), None  # never called: nothing is evicted
    if model is None:
        raise ValueError(
            "The default RoPE scorer needs query statistics: pass the model (RopeKVCache(model, ...)) so they "
            "are gathered from the prompt, or stats=FrequencyStats/path from hf_ropekv.calibrate, or another "
            "scorer (hf_ropekv.scorers)."
        )
    from ..statistics.online import OnlineStatistics

    # the estimator's options, the same whether or not the cache learns the workload
    estimator = dict(half_life=options.stats_half_life, prompt_weight=options.stats_prompt_weight,
                     shrink_heads=options.stats_head_shrink)
    if not options.learn_workload:
        return FrequencyScorer(None), OnlineStatistics(geometry, **estimator)
    from ..statistics.workload import _for_model

    workload = _for_model(model, geometry)
    prior = workload.prior() if options.prior_tokens > 0 else None  # taken now: fixed while this cache runs
    online = OnlineStatistics(geometry, learn=workload, prior=prior, prior_tokens=options.prior_tokens,
                              filler_ids=generation_filler_ids(model), **estimator)
    return FrequencyScorer(None), online


def generation_filler_ids(model: nn.Module) -> list[int]:
    """The ids ``generate()`` feeds a batch's finished rows with (the generation config's pad id, or its first
    end-of-sequence id when it has none) and the end-of-sequence ids a finished row is fed first."""
    return generation_token_ids(model, ("pad_token_id", "eos_token_id"))


def query_window(scorer: Scorer, options: CacheOptions, geometry: ModelGeometry, model: nn.Module | None) -> Any:
    """Recent queries for a scorer that asks for them (``query_window``; they need the model's hooks), or None."""
    window = getattr(scorer, "query_window", None)
    if window is None or options.budget is None:
        return None
    if model is None:
        raise ValueError(
            f"{type(scorer).__name__} recomputes attention from the model's queries: build the cache from "
            "the model (RopeKVCache(model, ...)), not from its config."
        )
    # static=True with such a scorer was refused before (model_checks.check_static); "auto" stays eager with it
    from ..scorers.query_window import QueryWindow

    return QueryWindow(geometry, window)
