"""Recency: keep the most recent tokens (StreamingLLM when combined with ``sink`` guards)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoreContext


@dataclass
class RecencyScorer:
    """Score = how recent the token is, in [0, 1]; with ``RopeKVCache(..., sink=4)`` this is StreamingLLM."""

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        return ctx.slot_positions.to(torch.float32) / max(ctx.tokens_seen, 1)
