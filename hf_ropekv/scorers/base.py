"""The eviction-policy protocol: keys of one layer in, one score per (row, KV head, slot) out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ScoreContext:
    """What a scorer may use besides the keys.

    Attributes:
        layer_idx: the decoder layer the keys belong to.
        position: int64 ``[B]``, absolute position of the next query of each row (real tokens seen; rows
            with left padding are behind the others).
        tokens_seen: tokens the cache has seen per row, padding included (same for every row).
        slot_positions: int64 ``[B, H_kv, S]``, the index (padding included) of the token in each slot.
        candidates: bool ``[B, H_kv, S]``, slots the selection may evict (not padding, not protected);
            normalisation statistics should be taken over these.
    """

    layer_idx: int
    position: torch.Tensor
    tokens_seen: int
    slot_positions: torch.Tensor
    candidates: torch.Tensor


@runtime_checkable
class Scorer(Protocol):
    """An eviction policy. Higher scores are kept.

    ``score`` gets a layer's live keys ``[B, H_kv, S, D]`` (a strided view of the cache storage; do not
    modify it) and returns float32 ``[B, H_kv, S]`` on the keys' device. Scores of different layers are
    averaged when the cache ranks globally, so put them on a comparable scale.
    """

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor: ...


def standardize(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """z-score along the last dim over the candidate slots (population std), so layers and heads mix fairly.

    ``scores`` ``[B, H, S]`` float32; ``candidates`` bool broadcastable to it. Rows with no candidates or
    zero spread come out centred and unscaled instead of NaN.
    """
    weight = candidates.to(scores.dtype).expand_as(scores)
    count = weight.sum(-1, keepdim=True).clamp_min(1.0)
    mean = (scores * weight).sum(-1, keepdim=True) / count
    var = (((scores - mean) ** 2) * weight).sum(-1, keepdim=True) / count
    std = var.sqrt()
    return (scores - mean) / torch.where(std > 0, std, torch.ones_like(std))
