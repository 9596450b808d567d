"""Key novelty (KeyDiff, made local): how unlike the keys around it a key is. A query-free score for the keys of a
prompt whose question has not come yet: a code or a name in prose has a key far from the prose around it, where RoPE
geometry, which predicts attention from average queries, ranks it like any other token.

Against the keys around it rather than the head's mean key: post-RoPE keys turn with their position, so the mean of
a whole long prompt is mostly its slowest frequencies, and a document's topic drifts. Question unseen, 4K prompts
compressed 16x (64 tune haystacks, H100): the whole prompt's mean found 38; windows of 33, 65, 129, 257, 513 and
1,025 tokens found 29, 39, 47, 49, 50 and 48 (``docs/quality.md``).
"""

from __future__ import annotations

import torch

from .base import standardize

# Keys in the neighbourhood a key is compared with: itself and 128 on either side, in token order.
NOVELTY_WINDOW = 257


def key_novelty(keys: torch.Tensor, candidates: torch.Tensor, slot_positions: torch.Tensor,
                valid: torch.Tensor | None = None, window: int = NOVELTY_WINDOW) -> torch.Tensor:
    """float32 ``[B, H, S]``: minus each key's cosine similarity to the sum of the valid keys of its row and head
    within ``window // 2`` places of it in token order (itself included), z-scored over the candidates.

    Args:
        keys: ``[B, H, S, D]``, post-RoPE as cached.
        candidates: bool ``[B, H, S]``, the slots to standardise over.
        slot_positions: int64 ``[B, H, S]``, the token index of each slot (slots need not be in token order).
        valid: bool ``[B, H, S]``, slots holding a real token (None: all); others neither count nor are read.
    """
    dim = keys.shape[-1]
    order_key = slot_positions if valid is None else slot_positions.masked_fill(~valid, torch.iinfo(torch.int64).max)
    order = torch.argsort(order_key, dim=-1, stable=True)  # token order, invalid slots last
    k = keys.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, dim)).float()
    if valid is not None:
        k = torch.where(valid.gather(-1, order).unsqueeze(-1), k, 0.0)
    # Window sums from prefix sums: O(S * D) whatever the window.
    prefix = torch.nn.functional.pad(k.cumsum(dim=2), (0, 0, 1, 0))
    index = torch.arange(k.shape[2], device=k.device)
    half = window // 2
    around = prefix[:, :, (index + half + 1).clamp_max(k.shape[2])] - prefix[:, :, (index - half).clamp_min(0)]
    novelty = -torch.nn.functional.cosine_similarity(k, around, dim=-1)
    return standardize(torch.empty_like(novelty).scatter_(-1, order, novelty), candidates)
