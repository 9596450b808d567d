"""Query statistics gathered from the prompt's own queries (``RopeKVCache(model, stats=None)``)."""

from __future__ import annotations

import torch

from .model_info import ModelGeometry
from .stats import FrequencyAccumulator, FrequencyStats


class OnlineStatistics:
    """Accumulates pre-RoPE queries of every multi-token forward (the prompt, later user turns).

    A forward's queries count once that forward has finished. A compaction runs inside a forward, at its
    first layer's cache update, when only that layer's queries of the forward exist; counting finished
    forwards only gives every layer statistics over the same tokens (those of the earlier forwards).

    Offline calibration on a large, varied text is better when prompts are short (a few hundred tokens give
    noisy means) or unlike the generated text; online statistics need no setup and match the prompt's domain.
    """

    def __init__(self, geometry: ModelGeometry) -> None:
        self.geometry = geometry
        self.reset()

    def reset(self) -> None:
        self._accumulator = FrequencyAccumulator(self.geometry)
        self._pending: FrequencyAccumulator | None = None  # the running forward's queries
        self._snapshot: FrequencyStats | None = None

    def begin_forward(self) -> None:
        """Start a forward: drop queries of a forward that never finished (it raised)."""
        self._pending = None

    def add(self, layer_idx: int, queries: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Add pre-RoPE queries ``[B, S, H_q, D]`` of one layer; ``mask`` ``[B, S]`` False for padding."""
        if self._pending is None:
            self._pending = FrequencyAccumulator(self.geometry)
        self._pending.add(layer_idx, queries, mask)

    def end_forward(self) -> None:
        """The forward finished: its queries now count."""
        if self._pending is not None:
            self._accumulator.merge(self._pending)
            self._pending = None
            self._snapshot = None

    def snapshot(self) -> FrequencyStats:
        """Statistics of every finished forward's queries (cached until another forward finishes)."""
        if self._snapshot is None:
            if self._accumulator.tokens == 0:
                raise RuntimeError(
                    "RopeKVCache has no query statistics: no prompt went through the model with the cache "
                    "attached. Pass stats= (hf_ropekv.calibrate) or build the cache from the model."
                )
            self._snapshot = self._accumulator.to_stats(source="online: prompt queries")
        return self._snapshot
