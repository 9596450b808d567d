"""Random eviction: the floor every real policy has to beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoreContext, hashed_uniform


@dataclass
class RandomScorer:
    """Uniform random scores: a hash of (seed, layer, KV head, the token's real index), so a row gets the same
    scores alone, with more padding, or beside other rows."""

    seed: int = 0

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        pads = (ctx.tokens_seen - ctx.position).to(ctx.slot_positions.device)  # left padding per row
        real_index = ctx.slot_positions - pads.view(-1, 1, 1)
        heads = torch.arange(keys.shape[1], device=real_index.device).view(1, -1, 1)
        return hashed_uniform(self.seed, ctx.layer_idx, heads, real_index).to(keys.device)
