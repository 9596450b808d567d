"""Turning scores into the slots to keep: guards, holes, tie-break noise, per-row top-k in original order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_BREAK_NOISE = 1e-6


@dataclass(frozen=True)
class Guards:
    """Tokens never evicted: token indices below ``pinned`` (the prompt, padding included), each row's first
    ``sink`` real tokens and its ``window`` most recent ones (an int, or int64 ``[B]``)."""

    pinned: int = 0
    sink: int = 0
    window: int | torch.Tensor = 0


def slot_masks(slot_positions: torch.Tensor, holes: torch.Tensor, pads: torch.Tensor, tokens_seen: int,
               guards: Guards) -> tuple[torch.Tensor, torch.Tensor]:
    """``(is_hole, protected)`` bool masks ``[B, H, S]`` of the live slots, from the token index each slot holds
    (int64 ``[B, H, S]``), each row's holes in front of its real tokens and its left padding (int64 ``[B]``)."""
    device = slot_positions.device
    slot = torch.arange(slot_positions.shape[-1], device=device)
    is_hole = (slot[None, None, :] < holes.to(device).view(-1, 1, 1)).expand(slot_positions.shape)
    real_index = slot_positions - pads.to(device).view(-1, 1, 1)
    protected = (slot_positions < guards.pinned) | (real_index < guards.sink)
    window = guards.window
    if isinstance(window, torch.Tensor):
        protected |= slot_positions >= tokens_seen - window.to(device).view(-1, 1, 1)
    elif window:
        protected |= slot_positions >= tokens_seen - window
    return is_hole, protected & ~is_hole


def select_keep(scores: torch.Tensor, is_hole: torch.Tensor, protected: torch.Tensor, targets: torch.Tensor,
                slots_after: int, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots each row keeps, right-aligned: ``(keep [B, H, slots_after], start [B])``.

    Row ``b`` keeps its ``targets[b]`` best real slots (protected ones first) in their original order, in
    ``keep[b, :, start[b]:]``; entries before ``start[b]`` are -1. ``noise`` in [0, 1) breaks ties. ``ValueError``
    if a row has more protected slots than it may keep.
    """
    targets = targets.to(scores.device)
    num_protected = protected.sum(-1)  # [B, H]
    if bool((num_protected > targets[:, None]).any()):
        row = int((num_protected > targets[:, None]).any(-1).nonzero()[0, 0])
        raise ValueError(f"{int(num_protected[row].max())} tokens of row {row} are protected (pinned prompt, sink and "
                         f"window) but only {int(targets[row])} can be kept. Raise `budget`, shrink `window`/`sink`, "
                         "or pass `protect_prompt=False`.")
    ranked = scores.float() + TIE_BREAK_NOISE * noise
    ranked = ranked.masked_fill(protected, float("inf")).masked_fill(is_hole, float("-inf"))
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    chosen = rank < targets.view(-1, 1, 1)
    slot = torch.arange(scores.shape[-1], device=scores.device).expand_as(rank)
    # Unchosen slots sort to the front as -1; the last `slots_after` entries are the row's survivors, ascending.
    ordered = torch.where(chosen, slot, torch.full_like(slot, -1)).sort(dim=-1).values
    return ordered[..., ordered.shape[-1] - slots_after :], slots_after - targets
