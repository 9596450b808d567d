"""Query statistics gathered from the prompt's own queries (``RopeKVCache(model, stats=None)``)."""

from __future__ import annotations

import torch

from .model_info import ModelGeometry
from .stats import FrequencyAccumulator, FrequencyStats


class OnlineStatistics:
    """Accumulates pre-RoPE queries of every multi-token forward (the prompt, later user turns).

    Offline calibration on a large, varied text is better when prompts are short (a few hundred tokens give
    noisy means) or unlike the generated text; online statistics need no setup and match the prompt's domain.
    """

    def __init__(self, geometry: ModelGeometry) -> None:
        self.geometry = geometry
        self.reset()

    def reset(self) -> None:
        self._accumulator = FrequencyAccumulator(self.geometry)
        self._snapshot: FrequencyStats | None = None

    def add(self, layer_idx: int, queries: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Add pre-RoPE queries ``[B, S, H_q, D]`` of one layer; ``mask`` ``[B, S]`` False for padding."""
        self._accumulator.add(layer_idx, queries, mask)
        self._snapshot = None

    def snapshot(self) -> FrequencyStats:
        """Statistics of everything added so far (cached until more queries arrive)."""
        if self._snapshot is None:
            if self._accumulator.tokens == 0:
                raise RuntimeError(
                    "RopeKVCache has no query statistics: no prompt went through the model with the cache "
                    "attached. Pass stats= (hf_ropekv.calibrate) or build the cache from the model."
                )
            self._snapshot = self._accumulator.to_stats(source="online: prompt queries")
        return self._snapshot
