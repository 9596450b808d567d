"""R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import check_window, pool_along_tokens, window_attention
from .base import ScoreContext, standardize


@dataclass
class RKVScorer:
    """R-KV: keep keys that are attended to and not redundant. Per (row, KV head), over the valid slots, the
    score ``λ·I − (1 − λ)·R`` is z-scored over the candidates, where

    - importance ``I``: attention of the last ``window`` queries, averaged over the window and each GQA group,
      max-pooled over ``kernel_size`` neighbouring tokens;
    - redundancy ``R`` (:func:`key_redundancy`): softmax over slots of the keys' mean cosine similarity to the
      others, each token's most recent later copy (similarity above ``threshold``) exempted.

    Pass ``RopeKVCache(..., window=8)`` to protect the observation window as the paper does. ``mix_lambda`` is λ
    (paper: 0.1).
    """

    window: int = 8
    mix_lambda: float = 0.1
    kernel_size: int = 7
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must lie in [0, 1]; got {self.mix_lambda!r}.")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1]; got {self.threshold!r}.")
        check_window(self.window, self.kernel_size, "maxpool")

    @property
    def query_window(self) -> int:
        return self.window

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        votes, positions = window_attention(keys, ctx, self.window, type(self).__name__)
        attending = (positions >= 0).sum(dim=1).clamp_min(1).to(torch.float32)[:, None, None]
        importance = votes / attending
        importance = pool_along_tokens(importance, ctx.slot_positions, ctx.valid, self.kernel_size, "maxpool")
        redundancy = key_redundancy(keys, ctx.slot_positions, ctx.valid, self.threshold)
        joint = self.mix_lambda * importance - (1.0 - self.mix_lambda) * redundancy
        return standardize(joint, ctx.candidates)


def key_redundancy(keys: torch.Tensor, slot_positions: torch.Tensor, valid: torch.Tensor | None,
                   threshold: float) -> torch.Tensor:
    """R-KV's redundancy ``R`` of each slot (see ``RKVScorer``), float32 ``[B, H_kv, S]``; invalid slots get 0."""
    batch, kv_heads, slots, _ = keys.shape
    if valid is None:
        valid = torch.ones(batch, kv_heads, slots, dtype=torch.bool, device=keys.device)
    unit = torch.nn.functional.normalize(keys.to(torch.float32), dim=-1, eps=1e-8)
    sim = unit @ unit.transpose(-1, -2)  # [B, H, S_i, S_j]
    pair_ok = valid[..., :, None] & valid[..., None, :]
    pair_ok &= ~torch.eye(slots, dtype=torch.bool, device=keys.device)
    sim = sim.masked_fill(~pair_ok, 0.0)
    # For each row i: the most recent later j with s_ij > threshold is exempted.
    later = slot_positions[..., None, :] > slot_positions[..., :, None]
    copies = (sim > threshold) & later
    recency = torch.where(copies, slot_positions[..., None, :], torch.full_like(sim, -1, dtype=torch.int64))
    latest_value, latest = recency.max(dim=-1)  # [B, H, S_i]
    exempt = torch.zeros_like(copies).scatter_(-1, latest[..., None], (latest_value >= 0)[..., None])
    sim = sim.masked_fill(exempt, 0.0)
    rows = valid.sum(dim=-1, keepdim=True).clamp_min(1).to(torch.float32)
    mean_sim = sim.sum(dim=-2) / rows  # over i, per column j
    redundancy = torch.softmax(mean_sim.masked_fill(~valid, float("-inf")), dim=-1)
    return torch.where(valid, redundancy, torch.zeros((), device=keys.device))
