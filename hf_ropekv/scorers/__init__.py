"""Eviction policies. Each is a small dataclass with one ``score(keys, ctx)`` method."""

from .base import ScoreContext, Scorer, standardize
from .frequency import FrequencyScorer
from .key_norm import KeyNormScorer
from .random_scorer import RandomScorer
from .recency import RecencyScorer

__all__ = [
    "FrequencyScorer",
    "KeyNormScorer",
    "RandomScorer",
    "RecencyScorer",
    "ScoreContext",
    "Scorer",
    "standardize",
]
