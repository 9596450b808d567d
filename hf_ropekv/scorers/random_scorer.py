"""Random eviction: the floor every real policy has to beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import ScoreContext


@dataclass
class RandomScorer:
    """Uniform random scores from a seeded generator (reproducible run to run)."""

    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        if self._generator is None:
            self._generator = torch.Generator(device="cpu").manual_seed(self.seed)
        shape = keys.shape[:-1]
        return torch.rand(shape, generator=self._generator).to(keys.device)
