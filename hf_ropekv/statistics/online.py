"""Query statistics gathered while the cache runs (the default scorer's), one set per batch row.

Every forward adds its pre-RoPE queries; a row's statistics hold its real (unpadded) queries only, and a forward's
queries count once it has finished, so a compaction scores every layer with the same tokens. Eager decoding steps
are folded :data:`DEFER_STEPS` at a time; a static cache's step folds in place at the last layer of each device. With
a half-life the sums decay by ``0.5 ** (new / half_life)`` before a forward's queries are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..model.geometry import ModelGeometry
from ..storage.buffers import mark_static, normal_tensors
from .query_sums import complex_means, masked_parts, query_parts

#: Eager decoding steps folded in one go, holding at most DEFER_BYTES of queries.
DEFER_STEPS = 16
DEFER_BYTES = 32 << 20


@dataclass(frozen=True)
class RowStatistics:
    """Per-row statistics as ``FrequencyScorer`` reads them: ``for_layer(i)`` gives ``(q_mean [B, H_q, F]
    complex64, q_abs_mean [B, H_q, F] float32)``."""

    q_mean: tuple[torch.Tensor | None, ...]
    q_abs_mean: tuple[torch.Tensor | None, ...]
    metadata: dict
    tokens: torch.Tensor  # float64 [B]: queries counted per row (their decayed weight with a half-life)

    def for_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_mean[layer_idx], self.q_abs_mean[layer_idx]


class OnlineStatistics:
    """Running per-row float64 sums of query parts per layer and query head, kept on the queries' devices.

    ``half_life``: tokens after which a query's weight halves (``None``: all alike); ``head_shrink``: a pseudo-count,
    in queries, pulling each head's means toward its layer's head average.
    """

    def __init__(self, geometry: ModelGeometry, half_life: float | None = None, head_shrink: float = 0) -> None:
        self.geometry = geometry
        self.half_life = half_life
        self.head_shrink = float(head_shrink)
        self._layout = geometry.require_rotary_layout()
        self._pairs = geometry.rotary_dim // 2
        self.reset()

    def reset(self) -> None:
        # Per device: float64 [L_device, B, 3, H_q, F] sums and [B] counts; layer -> (device, row in those sums).
        self._sums: dict[torch.device, torch.Tensor] = {}
        self._counts: dict[torch.device, torch.Tensor] = {}
        self._slot: dict[int, tuple[torch.device, int]] = {}
        self._pending: dict[int, torch.Tensor] = {}  # this forward's multi-token sums per layer [B, 3, H, F]
        self._stash: list[tuple[int, torch.Tensor]] = []  # this forward's single-token queries, per layer
        self._step: tuple[tuple[int, ...], torch.Tensor] | None = None  # this forward's queries at once [B, L, H, D]
        self._deferred: list[torch.Tensor] = []  # finished eager decoding steps not folded yet, [B, L, H, D] each
        self._mask: torch.Tensor | None = None  # this forward's new-token mask [B, S] (True = real)
        self._new = 0
        self._snapshot: RowStatistics | None = None
        self._fold_index: dict[tuple, tuple[torch.Tensor | None, int]] = {}
        self._weights: dict[tuple, torch.Tensor] = {}  # decay weights of n deferred steps, by (device, n)
        self.on_buffers = False  # a static cache's sums: its recorded steps fold in place
        self._static_step: list[tuple[int, torch.Tensor]] = []
        self._static_layers: dict[torch.device, tuple[int, ...]] = {}
        self._static_last: dict[int, torch.device] = {}

    def begin_forward(self, new_token_mask: torch.Tensor | None, new_tokens: int) -> None:
        """A forward of ``new_tokens`` starts; queries of a forward that never finished (it raised) are dropped."""
        self._pending, self._stash, self._step, self._static_step = {}, [], None, []
        self._mask, self._new = new_token_mask, new_tokens
        if self.on_buffers and new_tokens == 1:  # the step folds its queries itself; the counts move here
            for device, counts in self._counts.items():
                _decay_then_add(counts, self._factor(1), self._count_on(device))
            self._snapshot = None

    def add(self, layer_idx: int, queries: torch.Tensor) -> None:
        """One layer's pre-RoPE queries ``[B, S, H_q, D]`` of the running forward (read, never modified)."""
        self._check(queries)
        queries = queries.detach()
        if queries.shape[1] == 1 and self.on_buffers:
            self._static_step.append((layer_idx, queries))
            device = self._static_last.get(layer_idx)
            if device is not None:
                self._fold_static_step(device)
        elif queries.shape[1] == 1:
            self._stash.append((layer_idx, queries))
        else:
            parts = masked_parts(query_parts(queries, self._layout, self._pairs), self._mask_on(queries))
            self._pending[layer_idx] = parts.sum(dim=1, dtype=torch.float64)

    def add_step(self, layers: tuple[int, ...], queries: list[torch.Tensor]) -> None:
        """A decoding step's queries of ``layers`` (``[B, 1, H, D]`` each) at once: one concatenation instead of a
        call per layer."""
        device = queries[0].device
        if self.on_buffers or self._stash or self._step is not None or any(q.device != device for q in queries):
            for layer_idx, q in zip(layers, queries):
                self.add(layer_idx, q)
            return
        stacked = torch.cat(queries, dim=1)
        self._check(stacked)
        self._step = (layers, stacked.detach())

    def end_forward(self) -> None:
        for device in {q.device for _, q in self._static_step}:  # a device whose last layer gave no query
            self._fold_static_step(device)
        if self._step is not None:
            layers, stacked = self._step
            self._step = None
            if not self._pending and not self._stash and self._defer(layers, stacked):
                return
            self._stash.extend((layer_idx, stacked[:, i : i + 1]) for i, layer_idx in enumerate(layers))
        if not self._pending and not self._stash:
            return
        self.flush()
        if self.half_life is not None:  # the sums decay before this forward's queries are added
            for value in (*self._sums.values(), *self._counts.values()):
                value.mul_(self._factor(self._new))
        touched = set()
        # One fold per device, a handful of launches whatever the depth: a multi-token forward's per-layer sums, or
        # a decoding step's queries.
        summed: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for layer_idx, sums in self._pending.items():
            summed.setdefault(sums.device, []).append((layer_idx, sums))
        for device, items in summed.items():
            self._fold(device, tuple(layer_idx for layer_idx, _ in items), torch.stack([s for _, s in items], dim=1))
            touched.add(device)
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for layer_idx, q in self._stash:
            by_device.setdefault(q.device, []).append((layer_idx, q))
        for device, items in by_device.items():
            stacked = torch.cat([q for _, q in items], dim=1) if len(items) > 1 else items[0][1]
            parts = masked_parts(query_parts(stacked, self._layout, self._pairs), self._mask_on(stacked[:, :1]))
            self._fold(device, tuple(layer_idx for layer_idx, _ in items), parts)
            touched.add(device)
        for device in touched:
            if self._mask is None:
                self._counts[device].add_(float(self._new))
            else:
                self._counts[device] += self._count_on(device)
        self._pending, self._stash, self._snapshot = {}, [], None

    def _fold(self, device: torch.device, layers: tuple[int, ...], parts: torch.Tensor) -> None:
        """Add ``parts [B, L, 3, H, F]`` (of ``layers``, in order) to their layers' sums on ``device``."""
        index = self._index_of(device, layers, parts)
        parts = parts.transpose(0, 1)  # [L, B, 3, H, F], as the sums
        if index is None:
            self._sums[device].add_(parts)
        else:
            self._sums[device].index_add_(0, index, parts.to(torch.float64))

    def _defer(self, layers: tuple[int, ...], stacked: torch.Tensor) -> bool:
        """Keep a finished decoding step for a later fold (every layer of its one device, in order, no padding
        mask); False when it must be folded now."""
        device = stacked.device
        memo = self._fold_index.get((device, layers))
        every_layer = memo is not None and memo[0] is None and memo[1] == self._sums[device].shape[0]
        if self._mask is not None or self._new != 1 or len(self._sums) != 1 or not every_layer:
            return False
        self._deferred.append(stacked)
        self._snapshot = None
        if len(self._deferred) >= DEFER_STEPS or len(self._deferred) * stacked.nbytes > DEFER_BYTES:
            self.flush()
        return True

    def flush(self) -> None:
        """Fold the deferred steps: ``sums * f**n + sum_j f**(n-1-j) parts_j``."""
        if not self._deferred:
            return
        steps, n = list(self._deferred), len(self._deferred)
        self._deferred.clear()
        device = steps[0].device
        parts = query_parts(torch.stack(steps), self._layout, self._pairs).transpose(1, 2)  # [n, L, B, 3, H, F]
        sums, counts = self._sums[device], self._counts[device]
        if self.half_life is None:
            _decay_then_add(sums, None, parts.sum(dim=0, dtype=torch.float64))
            _decay_then_add(counts, None, float(n))
            return
        factor = self._factor(1)
        weights = self._weights.get((device, n))
        if weights is None:
            weights = torch.tensor([factor ** (n - 1 - j) for j in range(n)], dtype=torch.float64, device=device)
            self._weights[(device, n)] = weights
        _decay_then_add(sums, factor**n, torch.tensordot(weights, parts.to(torch.float64), dims=1))
        _decay_then_add(counts, factor**n, weights.sum())

    def snapshot(self) -> RowStatistics:
        """Per-row means of every finished forward's queries (cached until another forward finishes)."""
        self.flush()
        if self._snapshot is not None:
            return self._snapshot
        if not self._counts or len(self._slot) < len(self.geometry.full_attention_layers):
            raise RuntimeError(
                "RopeKVCache has no query statistics: no prompt went through the model with the cache attached. "
                "Build the cache from the model, or pass FrequencyScorer(stats=...) from hf_ropekv.calibrate.")
        means = []
        for layer_idx in range(self.geometry.num_layers):
            if layer_idx not in self._slot:  # a layer that gave no queries (sliding layers are never scored)
                means.append((None, None))
                continue
            device, index = self._slot[layer_idx]
            sums, counts = self._sums[device][index], self._counts[device]
            if self.head_shrink:  # a pseudo-count of head_shrink queries at the layer's head average
                pooled = sums.mean(dim=2, keepdim=True) / counts.clamp_min(1e-12).view(-1, 1, 1, 1)
                sums, counts = sums + self.head_shrink * pooled, counts + self.head_shrink
            means.append(complex_means(sums, counts))
        q_mean, q_abs = zip(*means)
        self._snapshot = RowStatistics(
            q_mean=q_mean, q_abs_mean=q_abs, tokens=self._counts[next(iter(self._counts))].clone(),
            metadata={"inv_freq": self.geometry.inv_freq.tolist(), "rotary_layout": self._layout,
                      "source": "online: the cache's own queries"})
        return self._snapshot

    def move_to_buffers(self, take: Callable[..., torch.Tensor]) -> None:
        """Move the sums into buffers from ``take(purpose, shape, dtype, make)`` (a static cache's lease), which a
        recorded decoding step updates in place."""
        self.flush()
        for table, name in ((self._sums, "online_sums"), (self._counts, "online_counts")):
            for device, value in table.items():
                buffer = take((name, device), tuple(value.shape), value.dtype, lambda v=value: torch.empty_like(v))
                table[device] = buffer.copy_(value)
        by_row = sorted(self._slot.items(), key=lambda item: item[1][1])  # layers in the order of their sums' rows
        self._static_layers = {device: tuple(i for i, (d, _) in by_row if d == device) for device in self._sums}
        self._static_last = {layers[-1]: device for device, layers in self._static_layers.items() if layers}
        self.on_buffers, self._snapshot = True, None

    def _fold_static_step(self, device: torch.device) -> None:
        """Fold the static step's queries of ``device``'s layers into their sums in place: decay, then add."""
        items = [(layer_idx, q) for layer_idx, q in self._static_step if q.device == device]
        self._static_step = [(layer_idx, q) for layer_idx, q in self._static_step if q.device != device]
        layers = tuple(layer_idx for layer_idx, _ in items)
        queries = torch.cat([q for _, q in items], dim=1) if len(items) > 1 else items[0][1]  # [B, L, H, D]
        parts = masked_parts(query_parts(queries, self._layout, self._pairs), self._mask_on(queries[:, :1]))
        parts = parts.transpose(0, 1)  # [L, B, 3, H, F]
        if layers == self._static_layers.get(device):  # every layer of the device, in order
            _decay_then_add(self._sums[device], self._factor(1), parts)
            return
        for position, layer_idx in enumerate(layers):
            _decay_then_add(self._sums[device][self._slot[layer_idx][1]], self._factor(1), parts[position])

    def buffers(self) -> list[torch.Tensor]:
        """The sums' tensors (a static cache gives them back to its lease on reset)."""
        self.flush()
        return [*self._sums.values(), *self._counts.values()]

    step_tensors = buffers  # every table a static decoding step reads or updates (a CUDA graph holds their addresses)

    @normal_tensors
    def select_batch(self, index: torch.Tensor) -> None:
        """Rows were reordered, selected or repeated (beam search, expansion)."""
        self.flush()
        for table in (self._sums, self._counts):
            for device, value in table.items():
                table[device] = value.index_select(1 if value.ndim > 1 else 0, index.to(device))
                mark_static(table[device])
        self._snapshot = None

    def _check(self, queries: torch.Tensor) -> None:
        g, shape = self.geometry, queries.shape
        if len(shape) != 4 or g.num_q_heads % shape[2] or shape[3] < 2 * self._pairs:  # TP: a share of the heads
            raise ValueError(
                f"Expected pre-RoPE queries [batch, seq, {g.num_q_heads} heads, {g.head_dim}], got {tuple(shape)}.")

    def _mask_on(self, queries: torch.Tensor) -> torch.Tensor | None:
        if self._mask is None:
            return None
        if tuple(self._mask.shape) != tuple(queries.shape[:2]):
            raise ValueError(f"new-token mask {tuple(self._mask.shape)} does not fit queries {tuple(queries.shape)}")
        return self._mask.to(device=queries.device, dtype=torch.bool)

    def _count_on(self, device: torch.device) -> torch.Tensor:
        if self._mask is None:
            return torch.full((self._counts[device].shape[0],), float(self._new), dtype=torch.float64, device=device)
        return self._mask.to(device).sum(dim=1, dtype=torch.float64)

    @normal_tensors
    def _place(self, layers: list[int], like: torch.Tensor) -> None:
        """Make the sums of ``layers`` (none placed yet) at their first queries, rows after the device's others;
        ``like`` ``[B, 3, H, F]``."""
        device, batch = like.device, like.shape[0]
        zeros = torch.zeros((len(layers), batch, *like.shape[1:]), dtype=torch.float64, device=device)
        first = self._sums[device].shape[0] if device in self._sums else 0
        self._slot.update((layer_idx, (device, first + n)) for n, layer_idx in enumerate(layers))
        if first:
            self._sums[device] = torch.cat([self._sums[device], zeros])
        else:
            self._sums[device] = zeros
            self._counts[device] = torch.zeros(batch, dtype=torch.float64, device=device)
        mark_static(self._sums[device], self._counts[device])

    def _index_of(self, device: torch.device, layers: tuple[int, ...], parts: torch.Tensor) -> torch.Tensor | None:
        """Rows of ``device``'s sums that ``layers`` (``parts [B, L, 3, H, F]``) go to, placing new layers; None
        when they are all rows in order (memoised)."""
        memo = self._fold_index.get((device, layers))
        if memo is not None and memo[1] == self._sums[device].shape[0]:
            return memo[0]
        new = [layer_idx for layer_idx in layers if layer_idx not in self._slot]
        if new:
            self._place(new, parts[:, 0])
        index = [self._slot[layer_idx][1] for layer_idx in layers]
        rows = self._sums[device].shape[0]
        result = None if index == list(range(rows)) else torch.tensor(index, device=device)
        self._fold_index[(device, layers)] = (result, rows)
        return result

    def _factor(self, new_tokens: int) -> float | None:
        """The decay before ``new_tokens`` tokens' queries are added (None: no half-life)."""
        return None if self.half_life is None else 0.5 ** (new_tokens / self.half_life)


def _decay_then_add(total: torch.Tensor, factor: float | None, addend: torch.Tensor | float) -> None:
    if factor is not None:
        total.mul_(factor)
    total.add_(addend)
