"""Recency: keep the most recent tokens (StreamingLLM when combined with ``sink`` guards)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoreContext


@dataclass
class RecencyScorer:
    """Score = how recent the token is, scaled to [0, 1] so it averages across layers like any z-score.

    With ``RopeKVCache(..., sink=4)`` this is StreamingLLM: attention sinks plus a recent window.
    """

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        return ctx.slot_positions.to(torch.float32) / max(ctx.tokens_seen, 1)
