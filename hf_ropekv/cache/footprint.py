"""What a cache's layers hold in memory, and what a ``DynamicCache`` would hold for the same tokens."""

from __future__ import annotations

from typing import Any, Sequence

from ..model.geometry import FULL, ModelGeometry
from .layers import BudgetedLayer


def window_layers(layers: Sequence[Any]) -> list[Any]:
    """The sliding-window layers (transformers' own) that hold tokens."""
    return [layer for layer in layers
            if not isinstance(layer, BudgetedLayer) and layer.is_initialized and layer.keys is not None]


def bytes_held(layers: Sequence[Any]) -> int:
    """Bytes of device memory the layers' tensors occupy (slot positions included)."""
    total = sum(layer.storage.bytes_held for layer in layers if isinstance(layer, BudgetedLayer))
    return total + sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in window_layers(layers))


def dynamic_cache_bytes(layers: Sequence[Any], geometry: ModelGeometry, seen: int) -> int:
    """Bytes a ``DynamicCache(config=...)`` would hold after ``seen`` tokens: every full-attention layer all of
    them, every sliding-window layer its window (0 before any layer holds keys)."""
    stored = [layer.storage.keys for layer in layers if isinstance(layer, BudgetedLayer) and layer.storage.keys is not None]
    keys = stored[0] if stored else next((layer.keys for layer in window_layers(layers)), None)
    if keys is None:
        return 0
    per_token = 2 * keys.shape[1] * keys.shape[3] * keys.element_size() * keys.shape[0]
    return sum(
        per_token * (seen if kind == FULL else min(seen, window - 1))
        for kind, window in zip(geometry.layer_types, geometry.sliding_windows)
    )
