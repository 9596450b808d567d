"""Candidate prompt votes, screened on the GPU against the default (``docs/quality.md``, "The prompt vote against a
baseline"). Benchmark code, not library options: a candidate that measures across the whole matrix moves into
``FrequencyScorer``; the rest are deleted.

The default's vote at a compaction right after a prompt is the z-score of the attention its last 32 queries put on
each key. Two changes, alone and together:

- ``ratio``: the vote against a baseline, the 32 queries before the window (``prompt_window=64`` captures both):
  ``log((window mass + u) / (baseline mass + u))``, ``u`` one uniform share, z-scored. What the last queries (a
  question) attend to beyond what any text attends to: attention sinks and the instruction lose their lead.
- ``share``: a token pointed at (z >= ``POINTED``) by at least ``share`` (layer, KV head) pairs of the forward gets the
  lead in every head. Every layer must be ranked in one ``score_layers`` call, so building a sharing scorer lifts
  the compactor's selection workspace bound (its batches of layers would otherwise depend on the batch size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from common import import_hf_ropekv

hf_ropekv = import_hf_ropekv()
import hf_ropekv.eviction.compactor as compactor  # noqa: E402
from hf_ropekv.scorers import frequency  # noqa: E402
from hf_ropekv.scorers.attention import (context_scale, group_mean, pool_along_tokens, spread_forward,  # noqa: E402
                                         summed_attention)
from hf_ropekv.scorers.base import standardize  # noqa: E402
from hf_ropekv.scorers.key_novelty import key_novelty  # noqa: E402

WINDOW = 32


@dataclass
class VoteCandidate(hf_ropekv.FrequencyScorer):
    """``FrequencyScorer`` with the prompt vote against a baseline (``ratio``) and/or shared across heads and layers
    (``share`` > 0: pairs that must agree). RoPE geometry scores every other compaction, as in the default."""

    ratio: bool = True
    share: int = 0

    def _vote_z(self, keys: torch.Tensor, ctx: Any) -> torch.Tensor:
        queries, positions = ctx.queries, ctx.query_positions
        scale = context_scale(ctx, keys.shape[-1])

        def pooled(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            mass = summed_attention(q, keys, p, ctx.slot_positions, ctx.valid, scale)
            return pool_along_tokens(group_mean(mass, keys.shape[1]), ctx.slot_positions, ctx.valid, 5, "avgpool")

        window = pooled(queries[:, :, -WINDOW:], positions[:, -WINDOW:])
        if not self.ratio:
            return standardize(window, ctx.candidates)
        n_base = queries.shape[2] - WINDOW
        base = (pooled(queries[:, :, :n_base], positions[:, :n_base]) if n_base > 0 else torch.zeros_like(window))
        uniform = WINDOW / ctx.candidates.sum(-1, keepdim=True).clamp_min(1).float()
        return standardize(torch.log((window + uniform) / (base + uniform)), ctx.candidates)

    def score_layers(self, keys: list[torch.Tensor], contexts: list[Any]) -> torch.Tensor:
        after_prompt = [context.queries is not None for context in contexts]
        if not any(after_prompt):
            return super().score_layers(keys, contexts)
        first = keys[0]
        out = torch.empty(len(keys), *first.shape[:3], dtype=torch.float32, device=first.device)
        rope = [i for i, prompt in enumerate(after_prompt) if not prompt]
        if rope:
            out[rope] = self._rope_scores([keys[i] for i in rope], [contexts[i] for i in rope])
        z = {i: self._vote_z(keys[i], contexts[i]) for i, prompt in enumerate(after_prompt) if prompt}
        counts = None
        if self.share:  # per row and token: the (layer, head) pairs that point at it
            tokens = max(int(c.slot_positions.max()) for c in contexts) + 1
            counts = torch.zeros(first.shape[0], tokens, device=first.device)
            for i, layer_z in z.items():
                hits = ((layer_z >= frequency.POINTED) & contexts[i].candidates).float()
                counts.scatter_add_(1, contexts[i].slot_positions.clamp_min(0).flatten(1), hits.flatten(1))
        lead = frequency.POINTED + frequency.VOTE_LEAD
        for i, layer_z in z.items():
            ctx = contexts[i]
            lifted = torch.where(layer_z >= frequency.POINTED, layer_z + frequency.VOTE_LEAD, layer_z)
            if counts is not None:
                shared = counts.gather(1, ctx.slot_positions.clamp_min(0).flatten(1)).view_as(layer_z) >= self.share
                lifted = torch.where(shared, lifted.clamp_min(lead), lifted)
            vote = spread_forward(lifted, ctx.slot_positions, ctx.valid, self.vote_span)
            out[i] = torch.maximum(key_novelty(keys[i], ctx.candidates), vote)
        return out

    def score(self, keys: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.score_layers([keys], [ctx])[0]


def _candidate(ratio: bool, share: int) -> dict[str, Any]:
    if share:
        compactor.SELECTION_WORKSPACE = 1 << 40
    return {"scorer": VoteCandidate(ratio=ratio, share=share, prompt_window=2 * WINDOW if ratio else WINDOW)}


#: name -> cache keyword arguments, as ``policies.POLICIES``. ``v_plain`` is the default's vote written here (the
#: check that this code matches it: same kept slots, same logits).
CANDIDATES = {
    "v_plain": lambda: _candidate(ratio=False, share=0),
    "v_ratio": lambda: _candidate(ratio=True, share=0),
    "v_ratio_share2": lambda: _candidate(ratio=True, share=2),
    "v_share3": lambda: _candidate(ratio=False, share=3),
}
