"""hf_ropekv: keep long HuggingFace generations inside a fixed KV-cache budget.

    from hf_ropekv import RopeKVCache
    cache = RopeKVCache(model, budget=2048)
    out = model.generate(**inputs, cache=cache, max_new_tokens=4096)  # transformers 5.17-5.23: past_key_values=cache
"""

from .cache.cache import RopeKVCache
from .statistics.calibration import calibrate
from .hooks.enable import disable, enable, enabled, is_enabled, last_cache, last_summary
from .hooks.detach import detach
from .scorers import (
    FrequencyScorer,
    H2OScorer,
    KeyNormScorer,
    RandomScorer,
    RecencyScorer,
    RKVScorer,
    ScoreContext,
    Scorer,
    SnapKVScorer,
)
from .scorers.rope_scoring import score_keys
from .storage.buffers import release_static_buffers
from .statistics.frequency_stats import FrequencyStats
from .statistics.workload import WorkloadStatistics, workload_statistics
from .cache.summary import CacheSummary
from .compile_cache import (
    CompileArtifactsInfo,
    CompileArtifactsMismatchError,
    load_compile_artifacts,
    read_compile_artifacts,
    save_compile_artifacts,
)
from .warnings import HfRopeKVWarning

#: The one place the version is written: setup.cfg reads it (``version = attr: hf_ropekv.__version__``).
__version__ = "0.1.0.dev0"

__all__ = [
    "calibrate",
    "detach",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "last_cache",
    "last_summary",
    "load_compile_artifacts",
    "read_compile_artifacts",
    "release_static_buffers",
    "save_compile_artifacts",
    "CacheSummary",
    "CompileArtifactsInfo",
    "CompileArtifactsMismatchError",
    "FrequencyScorer",
    "FrequencyStats",
    "H2OScorer",
    "HfRopeKVWarning",
    "KeyNormScorer",
    "RandomScorer",
    "RecencyScorer",
    "RKVScorer",
    "RopeKVCache",
    "ScoreContext",
    "Scorer",
    "SnapKVScorer",
    "__version__",
    "score_keys",
    "workload_statistics",
    "WorkloadStatistics",
]
