"""Which scorer a cache uses, and what it gathers for it (online statistics, a window of recent queries)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..model.geometry import ModelGeometry
from ..scorers.base import Scorer
from ..scorers.frequency import FrequencyScorer
from ..scorers.prompt_window import PromptWindow
from ..scorers.query_window import QueryWindow
from ..statistics.frequency_stats import FrequencyStats
from ..statistics.online import OnlineStatistics


def check_scorer(scorer: Any) -> None:
    """Refuse what is not a scorer, with the fix (used by ``RopeKVCache`` and ``hf_ropekv.enable``)."""
    if isinstance(scorer, type):
        raise TypeError(f"scorer must be a scorer object, not the class {scorer.__name__}: pass {scorer.__name__}().")
    if scorer is not None and not callable(getattr(scorer, "score", None)):
        raise TypeError(
            f"scorer must have a `score(keys, ctx)` method (see hf_ropekv.scorers); got {type(scorer).__name__}.")


def resolve_scorer(scorer: Scorer | None, budget: int | None, geometry: ModelGeometry,
                   model: nn.Module | None) -> tuple[Scorer, Any, Any]:
    """The cache's own copy of ``scorer`` (default ``FrequencyScorer()``; a dataclass is copied, so one scorer may
    configure many caches) and what the cache gathers for it: online statistics (None: calibrated statistics,
    another scorer, or no budget) and recent queries (a scorer's ``query_window``, the default scorer's prompt
    window, or None). Nothing is gathered without a budget: the scorer is then never called."""
    check_scorer(scorer)
    scorer = FrequencyScorer() if scorer is None else scorer
    if dataclasses.is_dataclass(scorer):
        scorer = dataclasses.replace(scorer)
    frequency, online = isinstance(scorer, FrequencyScorer), None
    if frequency and scorer.stats is not None:
        scorer.stats = FrequencyStats.resolve(scorer.stats, geometry, model)
    elif frequency and budget is not None:
        if model is None:
            raise ValueError("The default RoPE scorer needs query statistics: pass the model (RopeKVCache(model, ...)) "
                             "so they are gathered online, or scorer=FrequencyScorer(stats=path) with a file from "
                             "hf_ropekv.calibrate, or another scorer (hf_ropekv.scorers).")
        online = OnlineStatistics(geometry, half_life=scorer.half_life, head_shrink=scorer.head_shrink)
    if frequency and scorer.prompt_window and budget is not None and model is not None:
        # Twice the window: when a decoding step compacts, the vote weighs the last queries against those before.
        return scorer, online, PromptWindow(geometry, 2 * scorer.prompt_window)
    window = getattr(scorer, "query_window", None)
    if window is None or budget is None:
        return scorer, online, None
    if model is None:
        raise ValueError(f"{type(scorer).__name__} recomputes attention from the model's queries: build the cache from "
                         "the model (RopeKVCache(model, ...)), not from its config.")
    return scorer, online, QueryWindow(geometry, window)
