"""What the cache knows about each batch row: its left padding, its holes, whether it evicted; the mask that hides
the holes."""

from __future__ import annotations

import torch

from .. import _compat
from ..eviction.schedule import Plan


def padding_holes(pads: tuple[int, ...], dropped: int) -> tuple[int, ...]:
    """Each row's left padding that is still among a layer's slots once its first ``dropped`` token indices are
    gone: the holes an unmodified 2-D attention mask already hides."""
    return tuple(max(0, pad - dropped) for pad in pads)


class BatchRows:
    """Per-row bookkeeping of one cache: the batch size, each row's left padding (on the device and on the host),
    the slots in front of its real tokens (holes) and whether it evicted a real token. Planning reads the host
    copies only, so it never synchronises; they are refreshed only by multi-token forwards (which may hold padding).
    """

    def __init__(self) -> None:
        self.batch_size: int | None = None
        self.pads: torch.Tensor | None = None  # left padding per row among the tokens seen + new (device)
        self.pads_total = -1  # token count `pads` describes
        self.pads_host: tuple[int, ...] | None = None  # the same, on the host (planning never syncs)
        self.holes: tuple[int, ...] | None = None  # slots before each row's real tokens; None: its padding
        self.holes_pads: tuple[int, ...] = ()  # the rows' padding (`pads_host`) when `holes` was recorded
        self.evicted: list[bool] = []
        self._on_device: tuple[tuple[int, ...], torch.Tensor] | None = None  # see `on_device`

    def current_holes(self) -> tuple[int, ...]:
        """Slots in front of each row's real tokens now: its left padding until the first compaction."""
        if self.holes is not None:
            # Left padding that arrived since (a long padded prompt sent in chunks) is more holes.
            return tuple(h + p - p0 for h, p, p0 in zip(self.holes, self.pads_host, self.holes_pads))
        if self.pads_host is not None:
            return self.pads_host
        return (0,) * (self.batch_size or 1)

    def on_device(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``values`` as a device tensor, copied from the host only when they change (at compactions, for holes)."""
        if self._on_device is None or self._on_device[0] != values or self._on_device[1].device != device:
            self._on_device = (values, torch.tensor(values, device=device))
        return self._on_device[1]

    def appends_real_token(self, total: int, new: int, batch: int) -> bool:
        """Whether this forward is a decoding step right after a forward whose padding was recorded: its token is
        real (``generate`` appends a one to its mask), so the padding is the known one and the step skips the ops
        on generate's full-length mask (or on the positions)."""
        return (new == 1 and self.pads_total == total - 1 and self.pads is not None and self.pads.shape[0] == batch
                and self.pads_host is not None and len(self.pads_host) == batch)

    def check_batch(self, batch: int) -> None:
        """Fix the batch size at the first forward; refuse another one later."""
        if self.batch_size is None:
            self.batch_size = batch
            if len(self.evicted) != batch:
                self.evicted = [False] * batch
        elif batch != self.batch_size:
            raise ValueError(
                f"This RopeKVCache holds a batch of {self.batch_size} rows but got {batch}. A cache belongs to one "
                "batch: create a fresh RopeKVCache for every generate() call (or use hf_ropekv.enable(model, ...)).")

    def observe_mask(self, attention_mask: torch.Tensor, new: int) -> bool:
        """Record left padding from generate's 2-D attention mask (tokens seen + new); returns whether this forward
        is a decoding step appending a real token (``appends_real_token``)."""
        batch, total = attention_mask.shape[0], attention_mask.shape[-1]
        self.check_batch(batch)
        decoding = self.appends_real_token(total, new, batch)
        if not decoding:
            self.pads = (attention_mask == 0).sum(-1)
            if self.pads_host is None or new > 1 or len(self.pads_host) != batch:
                self.pads_host = tuple(self.pads.tolist())
        self.pads_total = total
        return decoding

    def observe_update(self, total: int, new: int, device: torch.device, kwargs: dict, from_model: bool) -> None:
        """The padding of a forward the model attachment did not describe: from ``position_ids`` (transformers
        5.24 passes them to ``update``), else none. ``from_model``: whether the cache has the model's hooks."""
        if self.pads is not None and self.pads_total == total:
            return  # the model attachment saw this forward's attention mask
        if self.appends_real_token(total, new, self.batch_size):
            self.pads_total = total  # a decoding step: the positions go on from the padding already known
            return
        position_ids = _compat.position_ids_from_update(kwargs)
        if position_ids is not None:
            last = position_ids[..., -1].reshape(-1).to(device)
            self.pads = (total - 1 - last).clamp_min(0).expand(self.batch_size).clone()
            if self.pads_host is None or new > 1:
                self.pads_host = tuple(self.pads.tolist())
        elif self.pads is None or self.pads.shape[0] != self.batch_size:
            if self.batch_size > 1 and not from_model:
                raise ValueError("RopeKVCache was built from a config and this transformers version does not tell the "
                                 "cache where the left padding of a batch is. Build it from the model instead: "
                                 "RopeKVCache(model, ...).")
            self.assume_no_padding(self.batch_size, device)
        self.pads_total = total

    def assume_no_padding(self, batch: int, device: torch.device) -> None:
        self.pads = torch.zeros(batch, dtype=torch.long, device=device)
        self.pads_host = (0,) * batch

    def record_compaction(self, plan: Plan, from_model: bool) -> None:
        """A compaction moved each row's real tokens behind ``plan.holes_after`` holes (host only)."""
        if (not from_model and any(self.pads_host or ())
                and plan.holes_after != padding_holes(self.pads_host, plan.seen - plan.slots_after)):
            raise ValueError(  # the unmodified mask cannot hide these holes
                "RopeKVCache was built from a config, so it cannot hide the rows' evicted slots in the "
                "attention mask of a padded batch. Build it from the model instead: RopeKVCache(model, ...).")
        for row in plan.evicting_rows:
            self.evicted[row] = True
        self.holes = plan.holes_after
        self.holes_pads = self.pads_host

    def select(self, index: torch.Tensor) -> None:
        """Rows were reordered, selected or repeated (``index``: the old row of each new one)."""
        if self.pads is not None:
            self.pads = self.pads.index_select(0, index.to(self.pads.device))
        per_row = (self.pads_host, self.holes, self.holes_pads, tuple(self.evicted))
        if any(rows and len(set(rows)) > 1 for rows in per_row):  # rows differ: where each goes matters (syncs)
            order = index.tolist()
        elif len(index) != len(self.evicted):  # uniform rows: only the count changes
            order = [0] * len(index)
        else:
            return
        self.pads_host, self.holes, holes_pads, evicted = (None if not rows else tuple(rows[i] for i in order)
                                                           for rows in per_row)
        self.holes_pads, self.evicted = holes_pads or (), list(evicted or ())

    def mask_for(self, attention_mask: torch.Tensor, new: int, plan: Plan, decoding: bool) -> torch.Tensor | None:
        """The 2-D mask a growing cache's forward must use: generate's own, with each row's holes hidden once they
        differ from its left padding; or None at a decoding step (``decoding``) with no padded or evicted slot.

        The full-attention layers read the mask's last ``slots + new`` columns (what ``get_mask_sizes`` reports),
        where left padding hides the first ``max(0, pad - (seen - slots))``: where that is each row's holes (always
        before the first compaction), generate's mask is already the one to use.
        """
        if decoding and not any(self.pads_host) and not any(plan.holes_after):
            # No mask needed (newer generates drop an all-ones one). Given one, transformers 5.17 gathers its kept
            # columns every step (three kernels DynamicCache's steps do not run) and synchronises on their all().
            return None
        if (self.holes is None and not plan.compacts
                or plan.holes_after == padding_holes(self.pads_host, plan.seen - plan.slots_after)):
            return attention_mask
        holes = self.on_device(plan.holes_after, attention_mask.device)
        region = torch.arange(plan.slots_after + new, device=attention_mask.device)[None, :] >= holes[:, None]
        mask = attention_mask.clone()
        mask[:, mask.shape[1] - region.shape[1] :] = region.to(mask.dtype)
        return mask
