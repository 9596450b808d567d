"""R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import check_pooling, pool_along_tokens, window_attention
from .base import ScoreContext, standardize


@dataclass
class RKVScorer:
    """R-KV: keep keys that are important (attended to) and not redundant (unlike the other kept keys).

    Per (row, KV head), over the valid slots:

    - importance ``I``: attention of the last ``window`` queries (the paper's observation window, α = 8),
      averaged over the window and over the query heads of each GQA group, max-pooled over ``kernel_size``
      neighbouring tokens; a distribution over the slots (each query's softmax sums to 1).
    - redundancy ``R``: cosine similarity ``s_ij`` of the keys, diagonal zeroed. So that one copy of a
      repeated pattern survives, for each token ``i`` the pair with its most recent later token ``j`` that
      is similar (``s_ij > threshold``) is exempted (``s_ij := 0``): the latest copy is not penalised for
      its predecessors, the earlier copies are. ``R_j = softmax_j(mean_i s_ij)``.
    - score ``Z = λ·I − (1 − λ)·R`` (the paper's joint selection), then z-scored over the candidates.

    The paper also keeps the observation window's tokens unconditionally: pass ``RopeKVCache(...,
    window=8)`` to match. Differences from the reference code, on purpose: heads of a GQA group are averaged
    after the softmax (the code max-pools logits before it), and the exemption only goes to a *later*
    similar token (the code also exempts the earlier partner when there is only one, so an identical pair
    is never penalised).

    Args:
        window: observation window α, in queries (paper: 8).
        mix_lambda: λ, weight of importance against redundancy (paper: 0.1; the reference code uses 0.07).
        kernel_size: odd max-pooling width of the importance (reference code: 7).
        threshold: cosine similarity above which two keys count as copies (reference code: 0.5).
    """

    window: int = 8
    mix_lambda: float = 0.1
    kernel_size: int = 7
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive int (queries); got {self.window!r}.")
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must lie in [0, 1]; got {self.mix_lambda!r}.")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1]; got {self.threshold!r}.")
        check_pooling(self.kernel_size, "maxpool")

    @property
    def query_window(self) -> int:
        """Queries the cache must provide: the observation window."""
        return self.window

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        votes, positions = window_attention(keys, ctx, self.window, type(self).__name__)
        attending = (positions >= 0).sum(dim=1).clamp_min(1).to(torch.float32)[:, None, None]
        importance = votes / attending
        importance = pool_along_tokens(importance, ctx.slot_positions, ctx.valid, self.kernel_size, "maxpool")
        redundancy = key_redundancy(keys, ctx.slot_positions, ctx.valid, self.threshold)
        joint = self.mix_lambda * importance - (1.0 - self.mix_lambda) * redundancy
        return standardize(joint, ctx.candidates)


def key_redundancy(
    keys: torch.Tensor, slot_positions: torch.Tensor, valid: torch.Tensor | None, threshold: float
) -> torch.Tensor:
    """R-KV's redundancy ``R`` of each slot, float32 ``[B, H_kv, S]`` (a distribution over the valid slots).

    See ``RKVScorer``: mean cosine similarity to the other valid keys, with each token's pair to its most
    recent later copy exempted, softmaxed over the valid slots; invalid slots get 0.
    """
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
