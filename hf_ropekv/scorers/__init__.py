"""Eviction policies. Each is a small dataclass with one ``score(keys, ctx)`` method."""

from .attention import attention_from_queries
from .base import ScoreContext, Scorer, standardize
from .frequency import FrequencyScorer
from .h2o import H2OScorer
from .key_norm import KeyNormScorer
from .random_scorer import RandomScorer
from .recency import RecencyScorer
from .rkv import RKVScorer
from .snapkv import SnapKVScorer

__all__ = ["FrequencyScorer", "H2OScorer", "KeyNormScorer", "RKVScorer", "RandomScorer", "RecencyScorer",
           "ScoreContext", "Scorer", "SnapKVScorer", "attention_from_queries", "standardize"]
