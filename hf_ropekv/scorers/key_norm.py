"""Key norm: keep keys with a small L2 norm (they tend to draw attention; Devoto et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ScoreContext, standardize


@dataclass
class KeyNormScorer:
    """Score = minus the key's L2 norm, z-scored per (row, KV head) over the candidates (Devoto et al., 2024,
    "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression")."""

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        norms = torch.linalg.vector_norm(keys.to(torch.float32), dim=-1)
        return standardize(-norms, ctx.candidates)
