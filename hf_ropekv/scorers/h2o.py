"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .attention import context_scale, group_mean, require_queries, summed_attention
from .base import ScoreContext, standardize


@dataclass
class _LayerAccumulator:
    """Attention received so far by each token of one layer, by token index."""

    totals: torch.Tensor  # float32 [B, H_kv, T]
    tokens_seen: int


@dataclass
class H2OScorer:
    """H2O heavy hitters: keep the keys with the largest attention accumulated over every query so far.

    Each call adds the attention (mean over each GQA group) of the queries new since the layer's previous
    compaction to a per-layer total indexed by token, and scores the z-scored totals. Pass ``RopeKVCache(...,
    window=...)`` for H2O's recent half. A layer's totals start over on a new sequence (its new queries reach back
    to the first token, ``tokens_seen`` went down, or the shape or device changed); a second call at the same
    ``tokens_seen`` adds nothing. One scorer serves one cache at a time; totals do not follow beam reordering.
    """

    query_window: ClassVar[int] = 1  # the new queries only
    _layers: dict[int, _LayerAccumulator] = field(default_factory=dict, init=False, repr=False)

    def reset(self) -> None:
        self._layers.clear()

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        queries, positions = require_queries(ctx, type(self).__name__)
        new = queries.shape[2] if ctx.new_queries is None else ctx.new_queries
        if not 0 <= new <= queries.shape[2]:
            raise ValueError(f"ctx.new_queries={new} must lie in [0, {queries.shape[2]}] (the queries provided).")
        state = self._state_for(keys, ctx, new)
        if ctx.tokens_seen != state.tokens_seen and new > 0:
            mass = summed_attention(queries[:, :, -new:], keys, positions[:, -new:], ctx.slot_positions, ctx.valid,
                                    context_scale(ctx, keys.shape[-1]))
            self._add(state, group_mean(mass, keys.shape[1]), ctx)
        state.tokens_seen = ctx.tokens_seen
        index = ctx.slot_positions.clamp(0, state.totals.shape[-1] - 1)
        return standardize(state.totals.gather(-1, index), ctx.candidates)

    def _state_for(self, keys: torch.Tensor, ctx: ScoreContext, new: int) -> _LayerAccumulator:
        state = self._layers.get(ctx.layer_idx)
        batch, kv_heads = keys.shape[:2]
        if (state is None or new >= ctx.tokens_seen or ctx.tokens_seen < state.tokens_seen
                or state.totals.shape[:2] != (batch, kv_heads) or state.totals.device != keys.device):
            totals = torch.zeros(batch, kv_heads, max(ctx.tokens_seen, 1), dtype=torch.float32, device=keys.device)
            state = _LayerAccumulator(totals=totals, tokens_seen=-1)
            self._layers[ctx.layer_idx] = state
        return state

    @staticmethod
    def _add(state: _LayerAccumulator, mass: torch.Tensor, ctx: ScoreContext) -> None:
        needed = ctx.tokens_seen  # slot positions are token indices < tokens_seen
        if needed > state.totals.shape[-1]:
            grown = torch.zeros(*state.totals.shape[:2], max(needed, 2 * state.totals.shape[-1]),
                                dtype=torch.float32, device=state.totals.device)
            grown[..., : state.totals.shape[-1]] = state.totals
            state.totals = grown
        keep = ctx.slot_positions >= 0
        if ctx.valid is not None:
            keep = keep & ctx.valid
        state.totals.scatter_add_(-1, ctx.slot_positions.clamp_min(0), mass.masked_fill(~keep, 0.0))
