"""Recent post-RoPE queries of each layer, for the attention-based scorers (SnapKV, H2O, R-KV): captured before
RoPE by the statistics' hooks and rotated here. A layer holds every query since its last compaction plus the
``window`` most recent ones; a forward's queries count once it has finished. A RoPE ``attention_scaling`` (YaRN)
scales every logit of a query alike and is left out.
"""

from __future__ import annotations

import torch

from ..model.layouts import ROTATE_HALF, pair_strides
from ..model.geometry import ModelGeometry


def rotate(queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
           layout: str = ROTATE_HALF) -> torch.Tensor:
    """RoPE of ``layout`` applied to ``queries [..., B, S, H, D]`` at ``positions [B, S]`` (float64 phases; dims
    beyond ``2F`` pass through)."""
    pairs = inv_freq.numel()
    angle = positions.to(torch.float64)[..., None] * inv_freq.to(queries.device, torch.float64)  # [B, S, F]
    cos, sin = angle.cos().float()[:, :, None, :], angle.sin().float()[:, :, None, :]
    q = queries.float()
    stride, offset = pair_strides(layout, pairs)
    real, imag = slice(0, stride * pairs, stride), slice(offset, offset + stride * pairs, stride)
    x, y = q[..., real], q[..., imag]
    out = q.clone()
    out[..., real], out[..., imag] = x * cos - y * sin, y * cos + x * sin
    return out


def on_device(copies: dict[torch.device, torch.Tensor], tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in float64 on ``device``, copied once per device into ``copies``: copying a host tensor at every
    layer would make the host wait for the GPU each time, so it could not queue a prefill's work ahead."""
    if device not in copies:
        copies[device] = tensor.to(device, torch.float64)
    return copies[device]


class QueryWindow:
    """Per-layer post-RoPE queries ``[B, H_q, N, D]`` and their token indices ``[B, N]`` (-1: no query)."""

    def __init__(self, geometry: ModelGeometry, window: int) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"query_window must be a positive int; got {window!r}.")
        self.geometry = geometry
        self.window = window
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.scales: list[float | None] = [None] * geometry.num_layers
        self.reset()

    def reset(self) -> None:
        self._queries: dict[int, list[torch.Tensor]] = {}
        self._positions: dict[int, list[torch.Tensor]] = {}
        self._new: dict[int, int] = {}
        self._pending: dict[int, torch.Tensor] = {}
        self._forward: tuple[torch.Tensor, torch.Tensor] | None = None  # (token index, RoPE position) [B, S]

    def begin_forward(self, seen: int, new: int, pads: torch.Tensor, new_token_mask: torch.Tensor | None) -> None:
        """A forward of ``new`` tokens after ``seen``; ``pads`` [B] left padding, ``new_token_mask`` [B, new]."""
        index = torch.arange(seen, seen + new, device=pads.device).expand(pads.shape[0], new)
        rope = index - pads.view(-1, 1)
        if new_token_mask is not None:
            index = index.masked_fill(~new_token_mask.to(pads.device), -1)
        self._forward = (index, rope)
        self._pending = {}

    def add(self, layer_idx: int, queries: torch.Tensor) -> None:
        """One layer's pre-RoPE queries ``[B, S, H, D]`` of the running forward."""
        if self._forward is None:
            return
        geometry, rope = self.geometry, self._forward[1]
        inv_freq = on_device(self._inv_freq, geometry.inv_freq, queries.device)
        rotated = rotate(queries.detach(), rope.to(queries.device), inv_freq, geometry.rotary_layout)
        self._pending[layer_idx] = rotated.to(queries.dtype).transpose(1, 2)  # [B, H, S, D]

    def end_forward(self) -> None:
        if self._forward is None:
            return
        index = self._forward[0]
        for layer_idx, queries in self._pending.items():
            self._queries.setdefault(layer_idx, []).append(queries)
            self._positions.setdefault(layer_idx, []).append(index.to(queries.device))
            self._new[layer_idx] = self._new.get(layer_idx, 0) + queries.shape[2]
        self._pending, self._forward = {}, None

    def take(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """``(queries [B, H, N, D], positions [B, N], new)`` of one layer; ``(None, None, 0)`` before any."""
        chunks = self._queries.get(layer_idx)
        if not chunks:
            return None, None, 0
        if len(chunks) > 1:  # one tensor from now on
            self._queries[layer_idx] = [torch.cat(chunks, dim=2)]
            self._positions[layer_idx] = [torch.cat(self._positions[layer_idx], dim=1)]
        return self._queries[layer_idx][0], self._positions[layer_idx][0], self._new.get(layer_idx, 0)

    def compacted(self, layer_idx: int) -> None:
        """The layer was compacted: keep its ``window`` most recent queries, none of them new."""
        queries, positions, _ = self.take(layer_idx)
        if queries is not None:
            self._queries[layer_idx] = [queries[:, :, -self.window :].clone()]
            self._positions[layer_idx] = [positions[:, -self.window :].clone()]
        self._new[layer_idx] = 0

    def select_batch(self, index: torch.Tensor) -> None:
        for table in (self._queries, self._positions):
            for layer_idx, chunks in table.items():
                table[layer_idx] = [c.index_select(0, index.to(c.device)) for c in chunks]
