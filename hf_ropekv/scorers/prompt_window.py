"""The default scorer's observation window: the last queries of the most recent prompt (or turn, or prefill chunk),
for the compaction right after it. There, the input's own attention says what it needs (SnapKV's vote), where RoPE
geometry predicts an unknown future; a decoding step makes the window stale, so compactions during generation score
by RoPE alone. ``FrequencyScorer`` ranks the keys the window points at first, the rest by its vote or key novelty.
"""

from __future__ import annotations

import torch

from ..model.geometry import ModelGeometry
from .query_window import on_device, rotate


class PromptWindow:
    """Post-RoPE queries ``[B, H_q, w, D]`` of the last ``window`` tokens of the latest multi-token forward, per layer,
    with their token indices ``[B, w]`` (-1: padding); empty after a decoding step. Fed like the online statistics."""

    def __init__(self, geometry: ModelGeometry, window: int) -> None:
        self.geometry, self.window = geometry, window
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.scales: list[float | None] = [None] * geometry.num_layers
        self.reset()

    def reset(self) -> None:
        self._queries: dict[int, torch.Tensor] = {}
        self._positions: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}
        self._forward: tuple[torch.Tensor, torch.Tensor] | None = None  # (token index, RoPE position) [B, w]

    def begin_forward(self, seen: int, new: int, pads: torch.Tensor, new_token_mask: torch.Tensor | None) -> None:
        self._pending, self._forward = {}, None
        if new > 1:
            w = min(self.window, new)
            index = torch.arange(seen + new - w, seen + new, device=pads.device).expand(pads.shape[0], w)
            rope = index - pads.view(-1, 1)
            if new_token_mask is not None:
                index = index.masked_fill(~new_token_mask[:, -w:].to(pads.device), -1)
            self._forward = (index, rope)

    def add(self, layer_idx: int, queries: torch.Tensor) -> None:
        """One layer's pre-RoPE queries ``[B, S, H, D]`` (single-token forwards are ignored, also when recorded)."""
        if self._forward is not None and queries.shape[1] > 1:
            # A copy: a view would keep the layer's queries of the whole prompt alive until the forward ends.
            self._pending[layer_idx] = queries[:, -self._forward[0].shape[1]:].detach().clone()

    def end_forward(self) -> None:
        """A multi-token forward replaces the window; a decoding step makes it stale."""
        self._queries = self._rotated(self._pending) if self._forward is not None else {}
        self._positions = None if self._forward is None else self._forward[0]
        self._pending, self._forward = {}, None

    def _rotated(self, pending: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every layer's window rotated to its positions, ``[B, H, w, D]``: one rotation for all layers of a shape
        and device (a prefill's host issues a few launches, not a dozen per layer)."""
        groups: dict[tuple, list[int]] = {}
        for layer_idx, q in pending.items():
            groups.setdefault((q.device, q.dtype, tuple(q.shape)), []).append(layer_idx)
        rope, rotated = self._forward[1], {}
        for (device, dtype, _), layers in groups.items():
            inv_freq = on_device(self._inv_freq, self.geometry.inv_freq, device)
            stacked = torch.stack([pending[i] for i in layers])  # [L, B, w, H, D]
            out = rotate(stacked, rope.to(device), inv_freq, self.geometry.rotary_layout).to(dtype)
            rotated.update((i, out[n].transpose(1, 2)) for n, i in enumerate(layers))
        return rotated

    def take(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """``(queries, positions, new)`` of one layer, as ``QueryWindow.take``; ``(None, None, 0)`` when stale."""
        queries = self._queries.get(layer_idx)
        return (None, None, 0) if queries is None else (queries, self._positions.to(queries.device), queries.shape[2])

    def compacted(self, layer_idx: int) -> None:
        self._queries.pop(layer_idx, None)  # the window serves one compaction

    def select_batch(self, index: torch.Tensor) -> None:
        self._queries = {i: q.index_select(0, index.to(q.device)) for i, q in self._queries.items()}
        if self._positions is not None:
            self._positions = self._positions.index_select(0, index.to(self._positions.device))

