"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import check_pooling, pool_along_tokens, window_attention
from .base import ScoreContext, standardize


@dataclass
class SnapKVScorer:
    """SnapKV: keep the keys the most recent queries (the "observation window") attend to.

    Score of a slot = the attention it receives from the last ``window`` queries, summed over the window
    (softmax per query over the valid, causal slots, recomputed from the captured post-RoPE queries), then
    averaged over the query heads of each GQA group (as kvpress does) and pooled over ``kernel_size``
    neighbouring tokens so the kept tokens come with their context. z-scored over the candidates.

    The paper keeps the window's own tokens unconditionally; here they are scored like the rest (they
    receive their own attention, so they tend to rank high): pass ``RopeKVCache(..., window=...)`` to
    protect them as the paper does. SnapKV compresses the prompt once; in this harness it is re-run at each
    compaction with the queries of the most recent tokens as the observation window.

    Args:
        window: observation-window length, in queries (the paper's experiments use 32).
        kernel_size: odd pooling width (5: the reference implementation's default).
        pooling: ``"avgpool"`` (the reference default) or ``"maxpool"``.
    """

    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive int (queries); got {self.window!r}.")
        check_pooling(self.kernel_size, self.pooling)

    @property
    def query_window(self) -> int:
        """Queries the cache must provide: the observation window."""
        return self.window

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        votes, _ = window_attention(keys, ctx, self.window, type(self).__name__)
        pooled = pool_along_tokens(votes, ctx.slot_positions, ctx.valid, self.kernel_size, self.pooling)
        return standardize(pooled, ctx.candidates)
