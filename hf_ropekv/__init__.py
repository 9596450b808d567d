"""hf_ropekv: keep long HuggingFace generations inside a fixed KV-cache budget.

    from hf_ropekv import RopeKVCache
    cache = RopeKVCache(model, budget=2048)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4096)  # transformers >= 5.24: cache=cache

Other policies live in :mod:`hf_ropekv.scorers`; the kernels in :mod:`hf_ropekv.kernels`.
"""

from .cache.cache import RopeKVCache
from .cache.summary import CacheSummary
from .detach import detach
from .enable import disable, enable, enabled, last_summary
from .scorers.base import ScoreContext, Scorer
from .scorers.frequency import FrequencyScorer
from .statistics.calibration import calibrate
from .statistics.frequency_stats import FrequencyStats
from .warnings import HfRopeKVWarning

#: The one place the version is written: setup.cfg reads it (``version = attr: hf_ropekv.__version__``).
__version__ = "0.1.0.dev0"

__all__ = [
    "CacheSummary",
    "FrequencyScorer",
    "FrequencyStats",
    "HfRopeKVWarning",
    "RopeKVCache",
    "ScoreContext",
    "Scorer",
    "__version__",
    "calibrate",
    "detach",
    "disable",
    "enable",
    "enabled",
    "last_summary",
]
