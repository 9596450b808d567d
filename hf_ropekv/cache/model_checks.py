"""What a cache's options need from the model it holds (its layer kinds), checked when the cache is built."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..model.geometry import FULL, SLIDING, ModelGeometry
from ..warnings import warn


def check_sliding_windows(geometry: ModelGeometry, budget: int | None) -> None:
    """Sliding layers read the last ``window`` columns of the same mask as the full layers, where rows with
    fewer real tokens than the longest have holes; a budget of at least the window keeps them out of reach.
    A budget on a model with sliding-window layers only bounds nothing: they are bounded already."""
    windows = [w for kind, w in zip(geometry.layer_types, geometry.sliding_windows) if kind == SLIDING and w]
    if budget is not None and windows and FULL not in geometry.layer_types:
        warn(
            f"budget={budget} evicts nothing on '{geometry.model_type}': all its layers are sliding-window layers, "
            f"already bounded by their window ({max(windows)} tokens), which RopeKVCache leaves as they are. "
            "Use a DynamicCache, or budget=None to silence this."
        )
    if budget is not None and windows and FULL in geometry.layer_types and budget < max(windows):
        raise ValueError(
            f"budget={budget} is smaller than the sliding window ({max(windows)}) of '{geometry.model_type}''s "
            f"sliding-window layers. Use budget >= {max(windows)}: the full-attention layers then always keep at "
            "least as many tokens as a window holds."
        )


def check_static(geometry: ModelGeometry, budget: int | None, model_or_config: Any) -> None:
    """What ``static=True`` needs: a budget (the arena's size), the model (its hooks prepare each forward) and
    full-attention layers only."""
    if budget is None:
        raise ValueError("static=True needs a budget: the fixed arena holds budget + compress_every slots per layer.")
    if not isinstance(model_or_config, nn.Module):
        raise ValueError(
            "static=True needs the model, not its config: RopeKVCache(model, budget=..., static=True). The cache "
            "prepares every forward (compaction, slots, mask) from the model's hooks before the compiled step runs."
        )
    if SLIDING in geometry.layer_types:
        raise ValueError(
            f"static=True does not support '{geometry.model_type}': it has sliding-window layers, which the static "
            "cache does not hold yet. Use static=False (the default) for this model."
        )
