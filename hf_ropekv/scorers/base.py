"""The eviction-policy protocol: keys of one layer in, one score per (row, KV head, slot) out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ScoreContext:
    """What a scorer may use besides the keys.

    Attributes:
        layer_idx: the decoder layer of the keys.
        position: int64 ``[B]``, position of each row's next query (real tokens seen).
        tokens_seen: tokens the cache has seen per row, padding included.
        slot_positions: int64 ``[B, H_kv, S]``, the token index (padding included) held by each slot.
        candidates: bool ``[B, H_kv, S]``, slots the selection may evict; normalise over these.
        queries: for a scorer with a ``query_window: int`` attribute only (else None): post-RoPE queries
            ``[B, H_q, N, D]`` of this layer, oldest first, since its previous compaction (at least
            ``query_window`` of them).
        query_positions: int64 ``[B, N]``, each query's token index; -1 where there is no query.
        new_queries: how many of the last ``N`` queries are new since the previous compaction.
        valid: bool ``[B, H_kv, S]``, slots holding a real token (None: all).
        attention_scale: the model's logit scale (None: ``D ** -0.5``).
        decoding: the forward that compacts is a decoding step (one token): the input before it is complete and
            being answered, rather than followed by more input.
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
    decoding: bool = False


@runtime_checkable
class Scorer(Protocol):
    """An eviction policy: ``score`` gets a layer's live keys ``[B, H_kv, S, D]`` (a view of the cache storage: do
    not modify it) and returns float32 ``[B, H_kv, S]`` on the keys' device. Higher scores are kept."""

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor: ...


def standardize(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """z-score of float32 ``scores [B, H, S]`` along the last dim over the ``candidates`` (bool, broadcastable;
    population std); rows with no candidates or no spread come out centred and unscaled, not NaN."""
    weight = candidates.to(scores.dtype).expand_as(scores)
    count = weight.sum(-1, keepdim=True).clamp_min(1.0)
    mean = (scores * weight).sum(-1, keepdim=True) / count
    std = ((((scores - mean) ** 2) * weight).sum(-1, keepdim=True) / count).sqrt()
    return (scores - mean) / torch.where(std > 0, std, torch.ones_like(std))


def hashed_uniform(*parts: torch.Tensor | int) -> torch.Tensor:
    """float32 uniform numbers in [0, 1) that depend only on the integer ``parts`` (broadcast): a hash of what
    identifies a token, so a row's draws depend on neither its batch-mates nor its padding."""
    x = torch.zeros((), dtype=torch.int64)
    for i, part in enumerate(parts):
        part = torch.as_tensor(part, dtype=torch.int64)
        x = x.to(part.device) * 1_000_003 + part + 0x9E3779B9 * (i + 1)
    x = x & 0xFFFFFFFF
    for _ in range(2):  # integer finaliser (xorshift-multiply): neighbouring inputs decorrelate
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return (x & 0xFFFFFF).to(torch.float32) / float(1 << 24)
