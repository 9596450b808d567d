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

    Attention-based scorers (``hf_ropekv.scorers.attention``) also need the layer's queries. The cache fills
    the fields below only for a scorer with a ``query_window: int`` attribute (the number of most recent
    queries it needs at least); for the others they stay ``None``.

    Query attributes:
        queries: ``[B, H_q, N, D]`` (float32 or the model dtype), post-RoPE queries of this layer, oldest
            first: every query since this layer's previous compaction (at the first one: since the start,
            prompt included), plus earlier ones if needed to reach the scorer's ``query_window``.
        query_positions: int64 ``[B, N]``, the token index of each query (padding included, the indexing of
            ``slot_positions``); -1 where there is no query (padding tokens, unused buffer entries). A query
            at position ``p`` attends only to slots with ``slot_positions <= p``.
        new_queries: how many of the last ``N`` queries are new since this layer's previous compaction.
        valid: bool ``[B, H_kv, S]``, slots that hold a real token (False for padding and unused slots:
            attention never goes there); ``None`` means every slot is valid.
        attention_scale: the factor the model multiplies ``q·k`` by before the softmax; ``None`` means
            ``D ** -0.5``.
    """

    layer_idx: int
    position: torch.Tensor
    tokens_seen: int
    slot_positions: torch.Tensor
    candidates: torch.Tensor
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    new_queries: int | None = None
    valid: torch.Tensor | None = None
    attention_scale: float | None = None


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


def hashed_uniform(*parts: torch.Tensor | int) -> torch.Tensor:
    """Uniform numbers in [0, 1) that depend only on the integer ``parts`` (broadcast), float32.

    A row's random draws must not depend on its batch-mates or its padding, so they are a hash of what
    identifies the token (real index, head, layer, seed) instead of a stream position.
    """
    x = torch.zeros((), dtype=torch.int64)
    for i, part in enumerate(parts):
        part = torch.as_tensor(part, dtype=torch.int64)
        x = x.to(part.device) * 1_000_003 + part + 0x9E3779B9 * (i + 1)
    x = x & 0xFFFFFFFF
    for _ in range(2):  # integer finaliser (xorshift-multiply): neighbouring inputs decorrelate
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return (x & 0xFFFFFF).to(torch.float32) / float(1 << 24)
