"""Query statistics gathered while the cache runs (``RopeKVCache(model, stats=None)``), one set per batch row.

Every forward adds its pre-RoPE queries: the prompt, later user turns and prefill chunks, and every decoding
step, so the statistics follow the generation instead of describing the prompt alone. A row's statistics
hold that row's real (unpadded) queries only, so its evictions do not depend on its batch-mates.

Cost per decoding step: the query hooks keep a reference to each layer's ``[B, 1, H, D]`` query; when the
forward has finished, all layers of a device are folded into running float64 sums in a handful of kernel
launches and no host synchronisation. A forward's queries count once that forward has finished, so a
compaction (which runs at the first layer of a forward) always scores every layer with the same tokens. A static
cache's decoding step does the same inside the (compiled) forward: its layers' queries are folded in one go at the
last layer of their device, so the step traces one fold, not one per layer.

With ``half_life`` set, older queries weigh less: before a forward's queries are added, the sums decay by
``0.5 ** (new_tokens / half_life)`` (the tokens of one multi-token forward weigh alike).

Workload statistics (``hf_ropekv.statistics.workload``): with ``learn`` set, the same folds also add their
undecayed, batch-summed parts into the model's workload sums (one more reduction per fold, no host sync); with
``prior`` set, a row's means start from the workload's, worth ``prior_tokens`` queries. A static cache's compiled
decoding step adds its parts to undecayed per-row sums beside its own (the same pointwise update, which inductor
fuses with it); they go into
the workload, summed over rows, between steps (``WorkloadFeed.drain``: whenever the statistics are read or handed
back, before learning freezes, and when the cache is dropped). A batch's rows that have ended are left out of
what the workload learns (``WorkloadFeed.rows_to_learn``). What is learned and when is kept apart, in
``statistics.workload_feed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..model.layouts import split_pairs
from ..model.geometry import ModelGeometry
from ..storage.buffers import mark_static  # the running sums: a static cache's compiled step updates them in place
from .workload import WorkloadPrior, WorkloadStatistics
from .workload_feed import WorkloadFeed


def decay_then_add(total: torch.Tensor, factor: float | None, addend: torch.Tensor | float) -> None:
    """``total = total * factor + addend``, in place: the one update of a running sum under a half-life
    (``factor`` ``None``: no half-life, no decay)."""
    if factor is not None:
        total.mul_(factor)
    total.add_(addend)


@dataclass(frozen=True)
class RowStatistics:
    """Per-row query statistics in the shape :class:`~hf_ropekv.scorers.FrequencyScorer` reads.

    ``for_layer(i)`` returns ``(q_mean [B, H_q, F] complex64, q_abs_mean [B, H_q, F] float32)`` on the
    layer's device; ``metadata["inv_freq"]`` the model's rotary frequencies.
    """

    q_mean: tuple[torch.Tensor, ...]
    q_abs_mean: tuple[torch.Tensor, ...]
    metadata: dict
    tokens: torch.Tensor  # float64 [B]: queries counted per row (decayed weight with a half-life)

    def for_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_mean[layer_idx], self.q_abs_mean[layer_idx]


class OnlineStatistics:
    """Running per-row sums of pre-RoPE query pairs, per layer and query head, on the queries' devices.

    Args:
        geometry: the model's attention geometry.
        half_life: tokens after which a query's weight halves; ``None`` weighs every query alike.
        learn: the model's workload statistics to feed with every finished forward's real queries (until they
            freeze), or ``None``.
        prior: the workload's means when the cache was built, which every row's means start from, or ``None``.
        prior_tokens: the weight of ``prior``, in queries (it never decays).
        filler_ids: token ids ``generate()`` feeds a batch's finished rows (the model's pad and end-of-sequence
            ids); the ids a prompt is padded with are added as prompts come. A decoding step whose input is one
            of them is not learned by the workload (see ``WorkloadFeed.rows_to_learn``).
        prompt_weight: what the prompt's queries (those of the forwards before the first decoding step: the
            prompt, all its prefill chunks; decayed like the rest) weigh against the decoding steps' once decoding
            has begun (a row whose decoding steps have not counted yet still uses its prompt alone);
            ``0`` scores with the generation's own queries only, and the workload then learns no prompt either.
            The cache option ``stats_prompt_weight`` (default 1: the prompt counts like the generation).
        shrink_heads: a pseudo-count, in queries, pulling each query head's means toward the average of its layer's
            heads (the row's own, weighted alike): ``(sums_h + k * pooled) / (count + k)``. The cache option
            ``stats_head_shrink`` (default 256, measured on GSM8K; 0: every head on its own).
        shrink_within: the heads ``shrink_heads`` averages over: ``"layer"`` (every query head of the layer: the
            default, what was measured) or ``"kv_group"`` (the query heads that share the KV head, whose keys
            they score). Experimental, not a cache option: ``benchmarks/task_accuracy.py`` sets it
            (``online.shrink_within=kv_group``) to measure it.
    """

    SHRINK_WITHIN = ("layer", "kv_group")

    def __init__(self, geometry: ModelGeometry, half_life: float | None = None, *,
                 learn: WorkloadStatistics | None = None, prior: WorkloadPrior | None = None,
                 prior_tokens: float = 0, filler_ids: Iterable[int] = (), prompt_weight: float = 1.0,
                 shrink_heads: float = 0, shrink_within: str = "layer") -> None:
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be a positive number of tokens or None; got {half_life!r}.")
        self.geometry = geometry
        self.half_life = half_life
        self.prior = prior if prior_tokens > 0 else None
        self.prior_tokens = float(prior_tokens)
        self._prior_on: dict[tuple[int, torch.device], torch.Tensor] = {}  # layer's prior means on its device
        self._layout = geometry.require_rotary_layout()  # how the model pairs dims (rotate_half / interleaved)
        self._pairs = geometry.rotary_dim // 2
        self._feed = WorkloadFeed(learn, filler_ids)  # what the workload statistics learn from this object
        if not prompt_weight >= 0:
            raise ValueError(f"prompt_weight must be a number >= 0; got {prompt_weight!r}.")
        self.prompt_weight = float(prompt_weight)
        if not shrink_heads >= 0:
            raise ValueError(f"shrink_heads must be a number of queries >= 0; got {shrink_heads!r}.")
        self.shrink_heads = float(shrink_heads)
        self.shrink_within = shrink_within  # (checked by its setter)
        self.reset()
        # while learning: the workload flushes this object before it reads, and adopts what it holds when it goes
        self._feed.hand_over_at_end(self, self._deferred, self._layout, self._pairs)

    @property
    def learn(self) -> WorkloadStatistics | None:
        """The model's workload statistics this object feeds (``None``: it learns nothing)."""
        return self._feed.workload

    @property
    def shrink_within(self) -> str:
        return self._shrink_within

    @shrink_within.setter
    def shrink_within(self, value: str) -> None:  # checked here: benchmarks set it as an attribute too
        if value not in self.SHRINK_WITHIN:
            raise ValueError(f"shrink_within must be one of {self.SHRINK_WITHIN}; got {value!r}.")
        self._shrink_within = value
        self._snapshot = None

    def reset(self) -> None:
        if getattr(self, "_deferred", None) or self._feed.rows:
            self.flush()  # finished forwards: the workload keeps them even though this object forgets them
        # Per device: float64 [L_device, B, 3, H_q, F] sums (real, imaginary, modulus) and [B] counts.
        self._sums: dict[torch.device, torch.Tensor] = {}
        self._counts: dict[torch.device, torch.Tensor] = {}
        self._slot: dict[int, tuple[torch.device, int]] = {}  # layer -> (device, index in that device's sums)
        self._pending: dict[int, torch.Tensor] = {}  # this forward's multi-token sums per layer [B, 3, H, F]
        self._stash: list[tuple[int, torch.Tensor]] = []  # this forward's single-token queries
        self._mask: torch.Tensor | None = None  # this forward's new-token mask [B, S] (True = real)
        self._new = 0
        self._snapshot: RowStatistics | None = None
        self._on_buffers = False
        # prompt_weight: the prompt's sums and counts per device (shaped as _sums / _counts, decayed as they are), and
        # whether a decoding step has begun
        self._prompt_sums: dict[torch.device, torch.Tensor] = {}
        self._prompt_counts: dict[torch.device, torch.Tensor] = {}
        self._decoded = False
        self._fold_indices: dict[tuple, tuple[torch.Tensor | None, int]] = {}  # see _fold_index
        self._step: tuple[tuple[int, ...], torch.Tensor] | None = None  # this forward's add_step: [B, L, H, D]
        # Finished decoding steps not folded yet, [B, L_device, H, D] each. One list for the object's life: a cache
        # dropped with steps still here hands them to the workload statistics (see __init__).
        self._deferred: list[torch.Tensor] = getattr(self, "_deferred", [])
        self._feed.reset()  # (its per-row learning sums were drained by the flush above)
        # A static decoding step's queries, kept from layer to layer and folded at once at the last layer of their
        # device (one fold per step instead of one per layer: fewer launches, and a shorter trace to compile);
        # the layers of each device's sums in order, and the last of them.
        self._static_step: list[tuple[int, torch.Tensor]] = []
        self._static_layers: dict[torch.device, tuple[int, ...]] = {}
        self._static_last: dict[int, torch.device] = {}
        self._weights: dict[tuple, torch.Tensor] = {}  # the deferred steps' decay weights, by (device, steps)

    # ------------------------------------------------------------------ one forward
    def begin_forward(self, new_token_mask: torch.Tensor | None, new_tokens: int,
                      input_ids: torch.Tensor | None = None) -> None:
        """Start a forward of ``new_tokens`` tokens (``input_ids``: its token ids, when the model got ids); drop
        queries of a forward that never finished (it raised)."""
        self._pending, self._stash, self._step = {}, [], None
        self._static_step = []
        self._mask, self._new = new_token_mask, new_tokens
        self._decoded = self._decoded or new_tokens == 1
        self._feed.begin_forward(input_ids, new_token_mask, new_tokens)
        if self._on_buffers and new_tokens == 1:
            # A static cache's decoding step: its queries are folded into the sums during the forward, at the last
            # layer of each device (_fold_static_step, inside the compiled step, so no query outlives it); the
            # counts move here, before it.
            self._decay_counts_and_add()
            self._snapshot = None
            if self._feed.learner() is not None:  # the fold adds its queries to the learning rows; counted at its end
                self._feed.begin_static_step(next(iter(self._counts.values())).shape[0], self._mask, self._new)

    def add(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Take one layer's pre-RoPE queries ``[B, S, H_q, D]`` of the running forward (read, never modified)."""
        self._check_queries(queries)
        shape = queries.shape
        if queries.requires_grad:  # a forward with autograd on: keep the statistics out of its graph
            queries = queries.detach()
        if shape[1] == 1 and self._on_buffers:
            self._static_step.append((layer_idx, queries))
            device = self._static_last.get(layer_idx)
            if device is not None:
                self._fold_static_step(device)
        elif shape[1] == 1:
            self._stash.append((layer_idx, queries))  # folded with the other layers at the end
        else:
            self._pending[layer_idx] = self._row_sums(queries, self._mask_on(queries.device, shape[:2]))

    def add_step(self, layers: tuple[int, ...], queries: list[torch.Tensor], heads_dim: int) -> None:
        """Take a decoding step's queries of ``layers`` at once, each as the model handed it to RoPE (``[B, 1, H, D]``
        with ``heads_dim`` 2, ``[B, H, 1, D]`` with 1): one concatenation instead of a view and a call per layer."""
        device = queries[0].device
        if self._on_buffers or self._stash or self._step is not None or any(q.device != device for q in queries):
            for layer_idx, q in zip(layers, queries):  # a static cache, several devices, a mixed forward: per layer
                self.add(layer_idx, q.transpose(1, 2) if heads_dim == 1 else q)
            return
        if heads_dim == 1:
            stacked = torch.cat(queries, dim=2).transpose(1, 2)  # [B, H, L, D] -> [B, L, H, D]
        else:
            stacked = torch.cat(queries, dim=1)
        self._check_queries(stacked)
        self._step = (layers, stacked.detach() if stacked.requires_grad else stacked)

    def end_forward(self) -> None:
        """The forward finished: its queries now count."""
        for device in {q.device for _, q in self._static_step}:  # a step whose device's last layer gave no query
            self._fold_static_step(device)
        self._feed.end_forward(self._on_buffers)  # a static step's learning rows: the rows not learned, its tokens
        if self._step is not None:
            layers, stacked = self._step
            self._step = None
            if not self._pending and not self._stash and self._defer(layers, stacked):
                return
            self._stash.extend((layer_idx, stacked[:, i : i + 1]) for i, layer_idx in enumerate(layers))
        if not self._pending and not self._stash:
            return
        self.flush()
        self._decay(self._new)
        learner = self._feed.learner()
        prompt = not self._decoded and bool(self._pending)  # (pending: multi-token forwards only)
        apart = prompt and self.prompt_weight != 1  # kept apart from the decoding steps' sums
        if prompt and self.prompt_weight == 0:
            learner = None  # the prompt counts for nothing, here and in the workload
        places = {layer_idx: self._place(layer_idx, sums) for layer_idx, sums in self._pending.items()}
        # where this forward's sums and counts go, per device: the prompt's own tables (grown to the layers placed
        # by now, once per forward) or the running ones
        targets = {device: self._prompt_tables(device) if apart else (self._sums[device], self._counts[device])
                   for device, _ in places.values()}
        for layer_idx, sums in self._pending.items():
            device, index = places[layer_idx]
            targets[device][0][index] += sums
            if learner is not None:
                learner.add_layers((layer_idx,), sums.sum(dim=0, keepdim=True))
        stash_devices = {q.device for _, q in self._stash}
        if len(stash_devices) == 1:  # the usual case: no grouping to do
            by_device = {device: self._stash for device in stash_devices}
        else:
            by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
            for layer_idx, q in self._stash:
                by_device.setdefault(q.device, []).append((layer_idx, q))
        for device, items in by_device.items():
            # One concatenation of the layers' [B, 1, H, D] queries, [B, L, H, D], and one fold: a decoding step
            # costs a handful of launches whatever the depth (no per-layer views).
            stacked = torch.cat([q for _, q in items], dim=1) if len(items) > 1 else items[0][1]
            parts = self._parts(stacked)  # [B, L, 3, H, F]
            mask = self._mask_on(device, (stacked.shape[0], 1))
            if mask is not None:
                parts = torch.where(mask[:, :, None, None, None], parts, 0.0)
            layers = tuple(layer_idx for layer_idx, _ in items)
            index = self._fold_index(device, layers, parts)
            if learner is not None:
                learner.add_layers(layers, self._feed.learned(parts, device).sum(dim=0, dtype=torch.float64))
            sums = self._sums[device]
            parts = parts.transpose(0, 1)  # [L, B, 3, H, F], as the sums
            if index is None:  # the usual case: every layer of the device, in order
                sums.add_(parts)
            else:
                sums.index_add_(0, index, parts.to(torch.float64))
        for device in self._devices_touched():
            counts = targets[device][1] if device in targets else self._counts[device]
            if self._mask is None:
                counts.add_(float(self._new))  # the same float64 sum as adding a tensor of them
            else:
                counts += self._count_on(device)
        if learner is not None:
            any_sums = next(iter(self._pending.values()), None)
            batch = any_sums.shape[0] if any_sums is not None else self._stash[0][1].shape[0]
            learner.count(self._feed.real_tokens(batch, self._mask, self._new))
        self._pending, self._stash = {}, []
        self._snapshot = None

    # ------------------------------------------------------------------ deferred folding of decoding steps
    #: Decoding steps folded in one go: a step then costs one concatenation of its queries instead of the fold's
    #: dozen launches (a host-bound step at batch 1 shows each of them).
    DEFER_STEPS = 16
    #: ... and no more queries than this are held for it (large batches fold sooner; they are not host-bound).
    DEFER_BYTES = 32 << 20

    def _defer(self, layers: tuple[int, ...], stacked: torch.Tensor) -> bool:
        """Keep a finished decoding step (``stacked [B, L, H, D]``, no padding mask) for a later fold, when it holds
        every layer of its device in order; False when it must be folded now."""
        device = stacked.device
        memo = self._fold_indices.get((device, layers))  # (index, rows) of the fold of exactly these layers
        every_layer_in_order = memo is not None and memo[0] is None and memo[1] == self._sums[device].shape[0]
        if self._mask is not None or self._new != 1 or len(self._sums) != 1 or not every_layer_in_order \
                or self._feed.live is not None:  # (a deferred step is learned from every row)
            return False
        self._deferred.append(stacked)
        self._feed.deferred_layers[0] = layers
        self._snapshot = None
        if len(self._deferred) >= self.DEFER_STEPS or len(self._deferred) * stacked.nbytes > self.DEFER_BYTES:
            self.flush()
        return True

    def flush(self) -> None:
        """Fold the deferred decoding steps: the sums decay by ``f`` and gain a step's parts, once per step in order,
        which is ``sums * f**n + sum_j f**(n-1-j) * parts_j`` (float64; the same up to its rounding)."""
        self._feed.drain()
        if not self._deferred:
            return
        steps = list(self._deferred)
        self._deferred.clear()
        device, n = steps[0].device, len(steps)
        parts = self._parts(torch.stack(steps))  # [n, B, L, 3, H, F]
        parts = parts.transpose(1, 2)  # [n, L, B, 3, H, F], as the sums
        sums, counts = self._sums[device], self._counts[device]
        learner = self._feed.learner()
        if learner is not None:  # the one extra reduction: every step and row, undecayed
            learner.add_layers(self._layers_on(device), parts.sum(dim=(0, 2), dtype=torch.float64))
            learner.count(n * parts.shape[2])  # deferred steps have no mask: every row's token is real
        if self.half_life is None:
            decay_then_add(sums, None, parts.sum(dim=0, dtype=torch.float64))
            decay_then_add(counts, None, float(n))
            return
        factor = self._decay_factor(1)
        weights = self._weights.get((device, n))
        if weights is None:
            weights = torch.tensor([factor ** (n - 1 - j) for j in range(n)], dtype=torch.float64, device=device)
            self._weights[(device, n)] = weights
        decay_then_add(sums, factor ** n, torch.tensordot(weights, parts.to(torch.float64), dims=1))
        decay_then_add(counts, factor ** n, weights.sum())
        self._decay_prompt(factor ** n)

    def _fold_index(self, device: torch.device, layers: tuple[int, ...], parts: torch.Tensor) -> torch.Tensor | None:
        """Rows of ``device``'s sums that ``layers``' queries (``parts [B, L, 3, H, F]``) go to, placing the layers
        seen for the first time; ``None`` when they are all rows, in order. Memoised: the same layers come in
        every decoding step, and a layer once placed stays where it is (until ``reset``)."""
        memo = self._fold_indices.get((device, layers))
        if memo is not None and memo[1] == self._sums[device].shape[0]:
            return memo[0]
        for position, layer_idx in enumerate(layers):
            if layer_idx not in self._slot:
                self._place(layer_idx, parts[:, position])
        index = [self._slot[layer_idx][1] for layer_idx in layers]
        rows = self._sums[device].shape[0]
        result = None if index == list(range(rows)) else torch.tensor(index, device=device)
        self._fold_indices[(device, layers)] = (result, rows)
        return result

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> RowStatistics:
        """Per-row means of every finished forward's queries (cached until another forward finishes)."""
        self.flush()
        if self._snapshot is None:
            if not self._counts or len(self._slot) < len(self.geometry.full_attention_layers):
                raise RuntimeError(
                    "RopeKVCache has no query statistics: no prompt went through the model with the cache "
                    "attached. Pass stats= (hf_ropekv.calibrate) or build the cache from the model."
                )
            # per device, once: the rows' weights of the prompt's part kept apart (prompt_weight), and the counts
            prompt_w = {device: self._prompt_weights(self._counts[device]) for device in self._prompt_counts}
            counts_on = {device: counts + prompt_w[device] * self._prompt_counts[device] if device in prompt_w
                         else counts for device, counts in self._counts.items()}
            q_mean, q_abs = [], []
            for layer_idx in range(self.geometry.num_layers):
                if layer_idx not in self._slot:  # a layer that never gave queries (sliding layers are never scored)
                    q_mean.append(None)
                    q_abs.append(None)
                    continue
                device, index = self._slot[layer_idx]
                sums, counts = self._sums[device][index], counts_on[device]
                if device in prompt_w:  # the prompt's part, kept apart
                    sums = sums + prompt_w[device].view(-1, 1, 1, 1) * self._prompt_sums[device][index]
                if self.shrink_heads:  # toward the heads' average: a pseudo-count of shrink_heads queries
                    pooled = self._head_average(sums) / counts.clamp_min(1e-12).view(-1, 1, 1, 1)
                    sums, counts = sums + self.shrink_heads * pooled, counts + self.shrink_heads
                if self.prior is None:
                    means = sums / counts.clamp_min(1e-12).view(-1, 1, 1, 1)
                else:  # blend by count: the prior weighs prior_tokens queries and never decays
                    w = self.prior_tokens
                    prior = self._prior_for(layer_idx, device)
                    means = (sums + w * prior) / (counts + w).view(-1, 1, 1, 1)
                q_mean.append(torch.complex(means[:, 0].float(), means[:, 1].float()))
                q_abs.append(means[:, 2].float())
            first = counts_on[next(iter(self._counts))]
            self._snapshot = RowStatistics(
                q_mean=tuple(q_mean),
                q_abs_mean=tuple(q_abs),
                metadata={"inv_freq": self.geometry.inv_freq.tolist(), "rotary_layout": self._layout,
                          "source": "online: the cache's own queries" + (
                              "" if self.prior is None else
                              f", from a workload prior of {self.prior.tokens} tokens worth {self.prior_tokens:g}")},
                tokens=first.clone(),
            )
        return self._snapshot

    # ------------------------------------------------------------------ static caches
    @property
    def on_buffers(self) -> bool:
        return self._on_buffers

    def move_to_buffers(self, take: Callable[..., torch.Tensor]) -> None:
        """Move the running sums into buffers from ``take(purpose, shape, dtype, make)`` (a static cache's
        ``BufferLease.take``): a compiled decode step updates them in place at addresses the next cache of the
        model takes over."""
        self.flush()
        for table, name in ((self._sums, "online_sums"), (self._counts, "online_counts")):
            for device, value in table.items():
                buffer = take((name, device), tuple(value.shape), value.dtype, lambda v=value: torch.empty_like(v))
                table[device] = buffer.copy_(value)
        self._static_layers = {device: self._layers_on(device) for device in self._sums}
        self._static_last = {layers[-1]: device for device, layers in self._static_layers.items() if layers}
        self._feed.take_rows(take, self._sums, self._static_layers)
        self._on_buffers = True
        self._snapshot = None

    def _fold_static_step(self, device: torch.device) -> None:
        """Fold the static decoding step's queries of ``device``'s layers into their sums, in place (inside the
        compiled step): the same arithmetic as ``end_forward`` (decay, then add), all layers in one go."""
        items = [(layer_idx, q) for layer_idx, q in self._static_step if q.device == device]
        self._static_step = [(layer_idx, q) for layer_idx, q in self._static_step if q.device != device]
        layers = tuple(layer_idx for layer_idx, _ in items)
        queries = torch.cat([q for _, q in items], dim=1) if len(items) > 1 else items[0][1]  # [B, L, H, D]
        parts = self._parts(queries)  # [B, L, 3, H, F]
        mask = self._mask_on(device, (queries.shape[0], 1))
        if mask is not None:
            parts = torch.where(mask[:, :, None, None, None], parts, 0.0)
        parts = parts.transpose(0, 1)  # [L, B, 3, H, F], as the sums
        rows = self._feed.rows.get(device)  # the workload's: counted at the step's end; drained between steps
        # (not gated on the workload's freeze: inside a compiled step that check is a guard, and a freeze in
        # mid-generation would recompile the step; after the freeze the drain discards what this adds)
        factor = self._decay_factor(1)
        if layers == self._static_layers.get(device):  # the usual case: every layer of the device, in order
            decay_then_add(self._sums[device], factor, parts)
            if rows is not None:
                rows.add_(parts)
            return
        for position, layer_idx in enumerate(layers):
            _, index = self._slot[layer_idx]
            decay_then_add(self._sums[device][index], factor, parts[position])
            if rows is not None:
                rows[index].add_(parts[position])

    def _decay_counts_and_add(self) -> None:
        for device, counts in self._counts.items():
            decay_then_add(counts, self._decay_factor(1), self._count_on(device))
        self._decay_prompt(self._decay_factor(1))  # (the step's fold decays the decoding sums)

    def buffers(self) -> list[torch.Tensor]:
        """The running sums' tensors (a static cache gives them back to its lease on reset)."""
        self.flush()
        return [*self._sums.values(), *self._counts.values(), *self._feed.rows.values()]

    def step_tensors(self) -> list[torch.Tensor]:
        """Every table a static decoding step reads or updates in place (sums, counts, learning rows, the prompt's
        tables), as they are now: a CUDA graph of the step holds their addresses (``hooks.graphed_step``)."""
        tables = (self._sums, self._counts, self._feed.rows, self._prompt_sums, self._prompt_counts)
        return [tensor for table in tables for tensor in table.values()]

    # ------------------------------------------------------------------ batch reshuffles (beam search, expansion)
    def select_batch(self, index: torch.Tensor) -> None:
        self.flush()
        self._feed.rows_reordered()
        for table in (self._sums, self._counts, self._feed.rows,  # (the learning sums were drained: zeros)
                      self._prompt_sums, self._prompt_counts):
            for device, value in table.items():
                dim = 1 if value.ndim > 1 else 0
                table[device] = value.index_select(dim, index.to(device))
                mark_static(table[device])
        self._snapshot = None

    # ------------------------------------------------------------------ internals
    def _head_average(self, sums: torch.Tensor) -> torch.Tensor:
        """``sums [B, 3, H, F]`` averaged over the heads that ``shrink_within`` pools, broadcastable to them."""
        if self.shrink_within == "layer":
            return sums.mean(dim=2, keepdim=True)
        # "kv_group": query heads j * G ... (j + 1) * G - 1 share KV head j (transformers' repeat_kv); H may be a shard's heads
        group = self.geometry.num_q_heads // self.geometry.num_kv_heads
        b, parts, heads, pairs = sums.shape
        grouped = sums.view(b, parts, heads // group, group, pairs).mean(dim=3, keepdim=True)
        return grouped.expand(-1, -1, -1, group, -1).reshape(b, parts, heads, pairs)

    def _layers_on(self, device: torch.device) -> tuple[int, ...]:
        """The layers of ``device``'s sums, in row order."""
        placed = sorted((index, layer_idx) for layer_idx, (d, index) in self._slot.items() if d == device)
        return tuple(layer_idx for _, layer_idx in placed)

    def _prior_for(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        """The prior's float64 ``[3, H, F]`` means of a layer on ``device`` (copied there once)."""
        key = (layer_idx, device)
        means = self._prior_on.get(key)
        if means is None:
            means = self._prior_on[key] = self.prior.means[layer_idx].to(device)
        return means

    def _check_queries(self, queries: torch.Tensor) -> None:
        g = self.geometry
        shape = queries.shape  # (the rotary width is 2 * self._pairs: geometry.rotary_dim counts inv_freq each call)
        if len(shape) != 4 or g.num_q_heads % shape[2] or shape[3] < 2 * self._pairs:  # TP: a share of the heads
            raise ValueError(
                f"Expected pre-RoPE queries [batch, seq, {g.num_q_heads} heads, {g.head_dim}], "
                f"got {tuple(queries.shape)}."
            )

    def _parts(self, q: torch.Tensor) -> torch.Tensor:
        """``[..., H, D]`` queries -> float32 ``[..., 3, H, F]``: real parts, imaginary parts, moduli."""
        pairs = self._pairs
        if q.shape[-1] != 2 * pairs:  # partial rotary: only the rotary dims
            q = q[..., : 2 * pairs]
        q = q.float()
        real, imag = split_pairs(q, self._layout, pairs)
        return torch.stack((real, imag, torch.hypot(real, imag)), dim=-3)

    def _row_sums(self, queries: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        parts = self._parts(queries)  # [B, S, 3, H, F]
        if mask is not None:
            parts = torch.where(mask[:, :, None, None, None], parts, 0.0)  # where: padding may hold NaN
        return parts.sum(dim=1, dtype=torch.float64)

    def _mask_on(self, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor | None:
        if self._mask is None:
            return None
        if tuple(self._mask.shape) != tuple(shape):
            raise ValueError(f"new-token mask {tuple(self._mask.shape)} does not fit queries of [batch, seq] = {tuple(shape)}")
        return self._mask.to(device=device, dtype=torch.bool)

    def _count_on(self, device: torch.device) -> torch.Tensor:
        if self._mask is None:
            batch = self._counts[device].shape[0]
            return torch.full((batch,), float(self._new), dtype=torch.float64, device=device)
        return self._mask.to(device).sum(dim=1, dtype=torch.float64)

    def _place(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.device, int]:
        """Where ``layer_idx``'s sums live (allocated at its first queries, beside the other layers of its device)."""
        if layer_idx not in self._slot:
            device = like.device
            batch = like.shape[0]
            zeros = torch.zeros((1, batch) + tuple(like.shape[1:]), dtype=torch.float64, device=device)
            if device in self._sums:
                self._slot[layer_idx] = (device, self._sums[device].shape[0])
                self._sums[device] = torch.cat([self._sums[device], zeros])
            else:
                self._slot[layer_idx] = (device, 0)
                self._sums[device] = zeros
                self._counts[device] = torch.zeros(batch, dtype=torch.float64, device=device)
            mark_static(self._sums[device], self._counts[device])
        return self._slot[layer_idx]

    def _prompt_weights(self, counts: torch.Tensor) -> torch.Tensor:
        """Per row, what the prompt's sums kept apart weigh: ``prompt_weight`` once the row's decoding steps count."""
        if self.prompt_weight == 1 or not self._decoded:
            return torch.ones_like(counts)
        return torch.where(counts > 0, self.prompt_weight, 1.0).to(counts.dtype)

    def _prompt_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's sums and counts on ``device``, kept apart (``prompt_weight``), with a row per placed layer."""
        sums = self._prompt_sums.get(device)
        if sums is None:
            sums = torch.zeros_like(self._sums[device])
            self._prompt_counts[device] = torch.zeros_like(self._counts[device])
        elif sums.shape[0] < self._sums[device].shape[0]:  # layers placed since
            more = self._sums[device].shape[0] - sums.shape[0]
            sums = torch.cat([sums, sums.new_zeros((more,) + tuple(sums.shape[1:]))])
        self._prompt_sums[device] = sums
        mark_static(sums, self._prompt_counts[device])
        return sums, self._prompt_counts[device]

    def _devices_touched(self) -> set[torch.device]:
        devices = {self._slot[i][0] for i in self._pending}
        devices |= {q.device for _, q in self._stash}
        return devices

    def _decay_factor(self, new_tokens: int) -> float | None:
        """What the sums are multiplied by before ``new_tokens`` tokens' queries are added; ``None``: no half-life."""
        return None if self.half_life is None else 0.5 ** (new_tokens / self.half_life)

    def _decay(self, new_tokens: int) -> None:
        """The decay half of ``decay_then_add`` for every sum and count: end_forward then adds to some rows only."""
        factor = self._decay_factor(new_tokens)
        if factor is None:
            return
        for table in (self._sums, self._counts):
            for value in table.values():
                value.mul_(factor)
        self._decay_prompt(factor)

    def _decay_prompt(self, factor: float | None) -> None:
        """Decay the prompt's sums kept apart (``prompt_weight``) as the others."""
        if factor is None:
            return
        for table in (self._prompt_sums, self._prompt_counts):
            for value in table.values():
                value.mul_(factor)

