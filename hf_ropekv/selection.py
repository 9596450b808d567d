"""Turning scores into the slots to keep: guards, padding, seeded tie-break, top-k in original order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_BREAK_NOISE = 1e-6


@dataclass(frozen=True)
class Guards:
    """Tokens that are never evicted (except padding, which always goes first).

    Attributes:
        pinned: token indices (padding included) below this are the pinned prompt.
        sink: the first ``sink`` real tokens of each row (attention sinks).
        window: the ``window`` most recent tokens.
    """

    pinned: int = 0
    sink: int = 0
    window: int = 0


def slot_masks(
    slot_positions: torch.Tensor, pads: torch.Tensor, tokens_seen: int, guards: Guards
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(is_pad, protected)`` bool masks ``[B, H, S]`` for slots holding token indices ``slot_positions``.

    ``pads`` ``[B]``: left-padding tokens of each row among the first ``tokens_seen`` tokens.
    """
    real_index = slot_positions - pads.to(slot_positions.device).view(-1, 1, 1)
    is_pad = real_index < 0
    protected = (slot_positions < guards.pinned) | (real_index < guards.sink)
    if guards.window:
        protected |= slot_positions >= tokens_seen - guards.window
    return is_pad, protected & ~is_pad


def select_keep(
    scores: torch.Tensor,
    is_pad: torch.Tensor,
    protected: torch.Tensor,
    keep: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Indices ``[B, H, keep]`` (int64, ascending) of the slots to keep.

    Padding is dropped first, protected slots are kept, the rest by score; ``1e-6``-scale seeded noise breaks
    ties so equal scores do not always favour the same end of the sequence.

    Raises:
        ValueError: if more slots are protected than ``keep`` (the budget cannot honour the guards).
    """
    num_protected = int(protected.sum(-1).max())
    if num_protected > keep:
        raise ValueError(
            f"{num_protected} tokens are protected (pinned prompt, sink and window) but only {keep} can be kept. "
            "Raise `budget`, shrink `window`/`sink`, or pass `protect_prompt=False`."
        )
    noise = torch.rand(scores.shape, generator=generator, device=generator.device if generator else "cpu")
    ranked = scores.float() + TIE_BREAK_NOISE * noise.to(scores.device)
    ranked = ranked.masked_fill(protected, float("inf")).masked_fill(is_pad, float("-inf"))
    indices = ranked.topk(keep, dim=-1, sorted=False).indices
    return indices.sort(dim=-1).values
