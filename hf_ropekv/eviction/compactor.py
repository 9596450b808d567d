"""Scoring, selection and in-place compaction of a forward's full-attention layers."""

from __future__ import annotations

import itertools
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol, Sequence

import torch

from ..scorers.base import ScoreContext, Scorer, hashed_uniform
from ..storage.paged import PagedKV, compact_arenas
from .schedule import Plan
from .selection import Guards, select_keep, slot_masks

#: Slots (layers x rows x KV heads x slots) one batched selection ranks at most: its temporaries stay under ~256 MiB.
SELECTION_WORKSPACE = 1 << 21
#: Slots of a row's room (its target less its pinned prompt and sink) the scorer keeps beside a full recent window.
SCORER_FLOOR = 16


def recent_window(room: int, window: int) -> int:
    """The default recent window of a row with ``room`` slots for unpinned tokens: the whole ``window`` once the
    room holds it and ``SCORER_FLOOR`` slots for the scorer, else half the room.

    Measured on GSM8K chain of thought (Qwen2.5-Coder-1.5B, budget = longest prompt + G, rows batch-invariant, so
    each row's result depends on its own window only): a window taking the whole room left the scorer nothing at
    G = 24 (0.53 of full, tune problems); half the room below 48 slots and 32 + 16 from 48 on gave 133 / 156 / 173
    of 300 tune problems at G = 24 / 32 / 48, against 130 / 143 / 173 for ``room - min(16, room // 2)`` and
    134 / 158 / 167 for half the room everywhere."""
    return window if room >= window + SCORER_FLOOR else min(window, room // 2)


class StoredLayer(Protocol):
    """What the compactor reads of a full-attention layer."""

    layer_idx: int
    storage: PagedKV


@dataclass(eq=False)
class Compactor:
    """Picks each row's survivors in a set of layers and compacts them in place. ``online``: statistics handed to
    the scorer before it scores; ``queries``: a ``QueryWindow`` for scorers that recompute attention."""

    scorer: Scorer
    _: KW_ONLY
    sink: int
    window: int
    auto_window: bool
    seed: int
    online: Any = None
    queries: Any = None

    def compact(self, layers: Sequence[StoredLayer], plan: Plan, pads: torch.Tensor, pads_host: tuple[int, ...],
                pinned: int) -> None:
        """Compact ``layers`` from ``plan.slots_before`` to ``plan.slots_after`` slots; ``pads``: each row's left
        padding (``pads_host`` on the host), ``pinned``: tokens per row never evicted. Each layer is ranked on its
        own, the layers of a device batched along the rows in bounded groups."""
        first = layers[0].storage
        per_layer = first.keys.shape[0] * first.keys.shape[1] * plan.slots_before  # slots a layer ranks
        chunk = max(1, SELECTION_WORKSPACE // max(1, per_layer))
        for _, same_device in itertools.groupby(layers, key=lambda layer: layer.storage.keys.device):
            same_device = list(same_device)
            for i in range(0, len(same_device), chunk):
                group = same_device[i : i + chunk]
                keep, start = self._select(group, plan, pads, pads_host, pinned)
                for layer, layer_keep in zip(group, keep):
                    compact_arenas([layer.storage], layer_keep, start)

    def _select(self, layers: Sequence[StoredLayer], plan: Plan, pads: torch.Tensor, pads_host: tuple[int, ...],
                pinned: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Score ``layers`` and pick each row's survivors: ``(keep [L, B, H, K], start [B])`` (row ``b`` keeps
        ``plan.kept_after[b]`` real slots, right-aligned from ``start[b]``)."""
        device = layers[0].storage.keys.device
        seen = plan.seen
        pads = pads.to(device)
        holes = torch.tensor([plan.slots_before - k for k in plan.kept_before], device=device)
        window = self.window
        if self.auto_window and self.window:  # the default, cut per row to the room beside its pinned prompt and sink
            pads_host = pads_host or (0,) * len(plan.kept_after)
            room = [max(0, kept - max(0, pinned - pad) - self.sink) for kept, pad in zip(plan.kept_after, pads_host)]
            window = torch.tensor([recent_window(r, self.window) for r in room], device=device)
        slot_positions = torch.stack([layer.storage.live_positions() for layer in layers])  # [L, B, H, S]
        rows = slot_positions.shape[0]  # layers ranked side by side
        flat_positions = slot_positions.flatten(0, 1)
        guards = Guards(pinned=pinned, sink=self.sink,
                        window=window.repeat(rows) if isinstance(window, torch.Tensor) else window)
        row_pads = pads.repeat(rows)
        is_hole, protected = slot_masks(flat_positions, holes.repeat(rows), row_pads, seen, guards)
        candidates = (~(is_hole | protected)).view(slot_positions.shape)
        if self.online is not None:
            self.scorer.stats = self.online.snapshot()
        scores = self._score(layers, seen - pads, seen, slot_positions, candidates, is_hole.view(slot_positions.shape),
                             decoding=plan.new == 1)
        # Tie-break noise that depends on the token (real index) and head only, never on the batch.
        heads = torch.arange(flat_positions.shape[1], device=device).view(1, -1, 1)
        noise = hashed_uniform(self.seed, flat_positions - row_pads.view(-1, 1, 1), heads)
        # A row whose left padding reaches into this forward's tokens has a negative count (its holes then cover
        # them); it keeps no stored token.
        targets = torch.tensor(plan.kept_after, device=device).clamp_min(0)
        keep, start = select_keep(scores.flatten(0, 1), is_hole, protected, targets.repeat(rows), plan.slots_after,
                                  noise)
        return keep.view(rows, *slot_positions.shape[1:3], keep.shape[-1]), start[: targets.shape[0]]

    def _score(self, layers: Sequence[StoredLayer], position: torch.Tensor, seen: int, slot_positions: torch.Tensor,
               candidates: torch.Tensor, is_hole: torch.Tensor, decoding: bool) -> torch.Tensor:
        """float32 ``[L, B, H, S]`` scores of ``layers``, all on one device (in one call to a scorer with
        ``score_layers``)."""
        contexts = []
        for i, layer in enumerate(layers):
            fields = {}
            if self.queries is not None:  # an attention-based scorer's fields
                queries, positions, new = self.queries.take(layer.layer_idx)
                fields = dict(queries=queries, query_positions=positions, new_queries=new, valid=~is_hole[i],
                              attention_scale=self.queries.scales[layer.layer_idx], decoding=decoding)
            contexts.append(ScoreContext(layer.layer_idx, position, seen, slot_positions[i], candidates[i], **fields))
        keys = [layer.storage.live_keys() for layer in layers]
        score_layers = getattr(self.scorer, "score_layers", None)
        if score_layers is not None and len(keys) > 1:
            scores = score_layers(keys, contexts)
        else:
            scores = torch.stack([self.scorer.score(k, ctx).float() for k, ctx in zip(keys, contexts)])
        if self.queries is not None:
            for layer in layers:
                self.queries.compacted(layer.layer_idx)
        return scores.float()
