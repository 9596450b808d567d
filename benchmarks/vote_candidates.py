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
