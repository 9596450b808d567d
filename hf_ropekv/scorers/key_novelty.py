"""Key novelty (KeyDiff): how unlike the other keys of its head a key is. A query-free score for the keys of a
prompt whose question has not come yet: a code or a name in prose has a key far from the prose's mean key, where RoPE
geometry, which predicts attention from average queries, ranks it like any other token.
"""

from __future__ import annotations

import torch

from .base import standardize


def key_novelty(keys: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, H, S]``: minus each key's cosine similarity to the mean of its row and head's candidate keys,
    z-scored over the candidates. ``keys``: ``[B, H, S, D]``, post-RoPE as cached; ``candidates``: bool ``[B, H, S]``.
    """
    keys = keys.float()
    weight = candidates.unsqueeze(-1).to(keys.dtype)
    mean = (keys * weight).sum(-2, keepdim=True) / weight.sum(-2, keepdim=True).clamp_min(1.0)
    return standardize(-torch.nn.functional.cosine_similarity(keys, mean, dim=-1), candidates)
