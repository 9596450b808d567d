"""What a cache's layers hold in memory, and what a ``DynamicCache`` would hold for the same tokens."""

from __future__ import annotations

from typing import Any, Sequence

import torch

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
    stored = [layer.storage for layer in layers if isinstance(layer, BudgetedLayer) and layer.storage.keys is not None]
    if stored:  # (in the model's dtype, also where the cache keeps int8 codes)
        keys, size = stored[0].keys, torch.empty((), dtype=stored[0].dtype).element_size()
    else:
        keys = next((layer.keys for layer in window_layers(layers)), None)
        size = None if keys is None else keys.element_size()
    if keys is None:
        return 0
    per_token = 2 * keys.shape[1] * keys.shape[3] * size * keys.shape[0]
    return sum(
        per_token * (seen if kind == FULL else min(seen, window - 1))
        for kind, window in zip(geometry.layer_types, geometry.sliding_windows)
    )
