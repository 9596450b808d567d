"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import check_window, pool_along_tokens, window_attention
from .base import ScoreContext, standardize


@dataclass
class SnapKVScorer:
    """SnapKV: keep the keys the last ``window`` queries (the observation window) attend to.

    A slot's score is the attention it receives from the window (mean over each GQA group, as kvpress does),
    pooled over ``kernel_size`` neighbouring tokens (``pooling``: ``"avgpool"`` or ``"maxpool"``), z-scored over the
    candidates. Run at every compaction; pass ``RopeKVCache(..., window=...)`` to protect the window's own tokens
    as the paper does.
    """

    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"

    def __post_init__(self) -> None:
        check_window(self.window, self.kernel_size, self.pooling)

    @property
    def query_window(self) -> int:
        return self.window

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        votes, _ = window_attention(keys, ctx, self.window, type(self).__name__)
        pooled = pool_along_tokens(votes, ctx.slot_positions, ctx.valid, self.kernel_size, self.pooling)
        return standardize(pooled, ctx.candidates)
