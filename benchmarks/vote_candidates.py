"""The prompt vote's ablation, screened against the default (``docs/quality.md``, "The prompt vote against a
baseline"). Benchmark code, not a library option.

When a decoding step compacts right after a prompt, the default weighs the prompt window's attention against the
queries before the window (the input is being answered: a question's attention beyond what any text attends to);
when more input follows, it takes the plain vote. ``plain_vote`` takes the plain vote always (the default before
the regime rule), so a run of both shows what the rule buys, cell by cell.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from common import import_hf_ropekv

hf_ropekv = import_hf_ropekv()
from hf_ropekv.scorers.base import ScoreContext  # noqa: E402


@dataclass
class PlainVoteScorer(hf_ropekv.FrequencyScorer):
    """``FrequencyScorer`` whose prompt vote never weighs the window against the queries before it."""

    def _prompt_vote(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        return super()._prompt_vote(keys, dataclasses.replace(ctx, decoding=False))


#: name -> cache keyword arguments, as ``policies.POLICIES``.
CANDIDATES: dict[str, Any] = {"plain_vote": lambda: {"scorer": PlainVoteScorer()}}


# --- Screen (2026-12-07, not committed as is): the ranking when more input follows the prompt. ---
from hf_ropekv.model.layouts import ROTATE_HALF  # noqa: E402
from hf_ropekv.scorers import frequency as _freq  # noqa: E402
from hf_ropekv.scorers.attention import spread_forward  # noqa: E402
from hf_ropekv.scorers.base import standardize  # noqa: E402
from hf_ropekv.scorers.key_novelty import key_novelty  # noqa: E402


def _pair_norms(keys: torch.Tensor, layout: str) -> torch.Tensor:
    """Each rotary pair's length, ``[..., D/2]``: what RoPE's rotation leaves unchanged."""
    k = keys.float()
    if layout == ROTATE_HALF:
        half = k.shape[-1] // 2
        a, b = k[..., :half], k[..., half:]
    else:
        a, b = k[..., 0::2], k[..., 1::2]
    return (a * a + b * b).sqrt()


@dataclass
class MoreInputScorer(hf_ropekv.FrequencyScorer):
    """The default, with another ranking at a compaction right after a prompt that more input follows."""

    vote: str = "max"  # "max": larger of vote and novelty; "lead": the vote only where pointed; "none"
    span: int = 16
    pointed: float = _freq.POINTED
    width: int = 129
    novelty: str = "keys"  # "keys" (post-RoPE, as cached) or "pairs" (rotary pair lengths)

    def score_layers(self, keys: list[torch.Tensor], contexts: list[ScoreContext]) -> torch.Tensor:
        z = super().score_layers(keys, contexts)
        for i, (k, c) in enumerate(zip(keys, contexts)):
            if self.prompt_window and c.queries is not None and not c.decoding:
                z[i] = self._more_input(k, c)
        return z

    def _more_input(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        if self.novelty == "local":
            nov = _local_novelty(keys, ctx, self.width)
        elif self.novelty == "pairs":
            layout = self.stats.metadata.get("rotary_layout", ROTATE_HALF)
            nov = key_novelty(_pair_norms(keys, layout), ctx.candidates)
        else:
            nov = key_novelty(keys, ctx.candidates)
        if self.vote == "none":
            return nov
        mass = self._pooled_attention(keys, ctx, slice(-self.prompt_window, None))
        pooled = standardize(mass, ctx.candidates)
        lifted = torch.where(pooled >= self.pointed, pooled + _freq.VOTE_LEAD, pooled)
        spread = spread_forward(lifted, ctx.slot_positions, ctx.valid, self.span)
        if self.vote == "max":
            return torch.maximum(nov, spread)
        return torch.where(spread >= self.pointed + _freq.VOTE_LEAD, spread, nov)


def _local_novelty(keys: torch.Tensor, ctx: ScoreContext, width: int = 129) -> torch.Tensor:
    k = keys.float()
    b, h, s, d = k.shape
    key = ctx.slot_positions if ctx.valid is None else ctx.slot_positions.masked_fill(~ctx.valid, 1 << 62)
    order = torch.argsort(key, dim=-1, stable=True)
    ks = k.gather(2, order.unsqueeze(-1).expand_as(k))
    x = ks.permute(0, 1, 3, 2).reshape(b * h, d, s)
    mean = torch.nn.functional.avg_pool1d(x, width, stride=1, padding=width // 2, count_include_pad=False)
    cos = torch.nn.functional.cosine_similarity(x, mean, dim=1).view(b, h, s)
    out = torch.empty_like(cos).scatter_(-1, order, cos)
    return standardize(-out, ctx.candidates)


def _mi(**kw: Any) -> Any:
    return lambda: {"scorer": MoreInputScorer(**kw)}


CANDIDATES.update({
    "mi_span0": _mi(span=0),
    "mi_lead": _mi(vote="lead"),
    "mi_lead_span0": _mi(vote="lead", span=0),
    "mi_novelty": _mi(vote="none"),
    "mi_pointed5": _mi(pointed=5.0),
    "mi_local": _mi(novelty="local", vote="none"),
    "mi_local_span0": _mi(novelty="local", span=0),
    "mi_local33_span0": _mi(novelty="local", span=0, width=33),
    "mi_local65_span0": _mi(novelty="local", span=0, width=65),
    "mi_local257_span0": _mi(novelty="local", span=0, width=257),
    "mi_local_lead_span0": _mi(novelty="local", vote="lead", span=0),
    "mi_local513_span0": _mi(novelty="local", span=0, width=513),
    "mi_local1025_span0": _mi(novelty="local", span=0, width=1025),
    "mi_local257": _mi(novelty="local", vote="none", width=257),
    "mi_pair": _mi(novelty="pairs"),
    "mi_pair_lead_span0": _mi(novelty="pairs", vote="lead", span=0),
    "mi_pair_only": _mi(novelty="pairs", vote="none"),
})
