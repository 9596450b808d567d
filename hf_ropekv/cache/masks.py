"""Where each row's holes are: the 2-D mask a forward uses, and the token index each slot holds."""

from __future__ import annotations

from typing import Any

import torch

from ..eviction.schedule import Plan
from .rows import BatchRows, padding_holes


def mask_for_forward(attention_mask: torch.Tensor, new: int, plan: Plan, rows: BatchRows,
                     decoding: bool) -> torch.Tensor | None:
    """The 2-D mask a growing cache's forward must use: generate's own, with each row's holes hidden once rows
    differ; or None, for a decoding step where no row has a padded or evicted slot to hide.

    The full-attention layers read the mask's last ``slots + new`` columns (the geometry ``get_mask_sizes``
    reports). Until the first compaction every row's holes are its left padding, which the mask already hides;
    after it, the rows' holes come from the plan. ``decoding``: a step appending a real token to known padding.
    """
    if decoding and not any(rows.pads_host) and not any(plan.holes_after):
        # Every column would read one: the model needs no mask (generate itself drops an all-ones mask on newer
        # transformers). Given one, transformers 5.17 gathers the kept slots' columns of it every decoding step
        # (three kernels that DynamicCache's steps do not run) and synchronises on their all().
        return None
    if rows.holes is None and not plan.compacts:
        return attention_mask
    # Left padding hides the first max(0, pad - (seen - slots)) columns of the region: when that is each row's
    # holes (no padding and rows kept alike, e.g. batch 1), generate's mask is already the one to use.
    if plan.holes_after == padding_holes(rows.pads_host, plan.seen - plan.slots_after):
        return attention_mask
    holes = rows.on_device(plan.holes_after, attention_mask.device)
    region = torch.arange(plan.slots_after + new, device=attention_mask.device)[None, :] >= holes[:, None]
    mask = attention_mask.clone()
    mask[:, mask.shape[1] - region.shape[1] :] = region.to(mask.dtype)
    return mask


def with_holes(positions: torch.Tensor, holes: tuple[int, ...]) -> torch.Tensor:
    """``positions`` ``[B, H, S]`` with each row's first ``holes[b]`` slots set to -1."""
    slot = torch.arange(positions.shape[-1], device=positions.device)
    is_hole = slot[None, None, :] < torch.tensor(holes, device=positions.device).view(-1, 1, 1)
    return positions.masked_fill(is_hole, -1)


def window_positions(layer: Any, pads_host: tuple[int, ...] | None, rows: int) -> torch.Tensor:
    """The token index of each slot of a sliding-window layer (its last tokens), -1 at a row's padding."""
    if not layer.is_initialized or layer.keys is None:
        return torch.empty(rows, 0, 0, dtype=torch.long)
    batch, heads, kept = layer.keys.shape[:3]
    seen = layer.get_seq_length()
    positions = torch.arange(seen - kept, seen, device=layer.keys.device).expand(batch, heads, kept).clone()
    pads = pads_host or (0,) * batch
    return with_holes(positions, padding_holes(pads, seen - kept))


def window_mask_part(attention_mask: torch.Tensor | None, seen: int, new: int, window: int, batch: int,
                     device: torch.device) -> torch.Tensor:
    """A static cache's sliding-window layers' part of the 2-D mask of a forward of ``new`` tokens: ``[B, window - 1
    + new]`` bool, column ``j`` for token index ``seen - (window - 1) + j`` (``hf_ropekv.cache.window``). A column is
    live where its token exists (index >= 0) and generate's mask (``[B, seen + new]``, None: no padding) keeps it:
    the columns a ``DynamicCache``'s sliding layer reads of that mask."""
    first = seen - (window - 1)
    index = torch.arange(first, seen + new, device=device)
    exists = index >= 0
    if attention_mask is None:
        return exists[None, :].expand(batch, -1)
    return attention_mask.to(device)[:, index.clamp_min(0)].bool() & exists[None, :]
