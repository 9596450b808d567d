"""RoPE frequency-band scoring (TriAttention): the default eviction policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..layouts import ROTATE_HALF
from ..scoring import score_keys
from .base import ScoreContext, standardize

if TYPE_CHECKING:
    from ..stats import FrequencyStats


@dataclass
class FrequencyScorer:
    """Expected future attention of each key from calibrated pre-RoPE query statistics (DESIGN.md §2).

    Per query head: raw ``trig + norm`` score (``hf_ropekv.score_keys``), z-scored over the candidate slots,
    then the max over the query heads of each GQA group gives one score per KV head.

    ``stats.for_layer(i)`` may return statistics shared by the batch (``[H_q, F]``) or one set per batch row
    (``[B, H_q, F]``); they are passed through as they are. The rotary pair layout is the statistics'
    ``metadata["rotary_layout"]`` (``"rotate_half"`` when absent: files written before the field existed).

    Args:
        stats: query statistics; ``None`` lets ``RopeKVCache`` fill them in from the prompt (online).
        offsets: future offsets the mean query is placed at (default 1, 2, 4, ..., 65536).
    """

    stats: "FrequencyStats | None" = None
    offsets: tuple[int, ...] | None = None
    # Per-(layer, device) copies of the statistics, valid for `_cached_stats` only. Held by reference and compared
    # with `is`: an id() key goes stale when online statistics replace a freed snapshot whose id() is reused.
    _device_cache: dict = field(default_factory=dict, init=False, repr=False)
    _cached_stats: "FrequencyStats | None" = field(default=None, init=False, repr=False)

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        if self.stats is None:
            raise RuntimeError("FrequencyScorer has no statistics: pass stats= or let RopeKVCache gather them.")
        q_mean, q_abs_mean, inv_freq = self._layer_tensors(ctx.layer_idx, keys.device, keys.shape[1])
        layout = self.stats.metadata.get("rotary_layout", ROTATE_HALF)
        raw = score_keys(keys, q_mean, q_abs_mean, inv_freq, ctx.position, self.offsets, layout=layout)  # [B, H_q, S]
        batch, kv_heads, slots = keys.shape[:3]
        group = raw.shape[1] // kv_heads
        candidates = ctx.candidates.repeat_interleave(group, dim=1)
        z = standardize(raw, candidates)
        return z.view(batch, kv_heads, group, slots).amax(dim=2)

    def _layer_tensors(self, layer_idx: int, device: torch.device, kv_heads: int) -> tuple[torch.Tensor, ...]:
        if self._cached_stats is not self.stats:
            self._device_cache.clear()
            self._cached_stats = self.stats
        key = (layer_idx, str(device), kv_heads)
        if key not in self._device_cache:
            q_mean, q_abs_mean = self.stats.for_layer(layer_idx)
            q_mean, q_abs_mean = _heads_of_this_rank(q_mean, q_abs_mean, kv_heads, self.stats.metadata)
            inv_freq = torch.tensor(self.stats.metadata["inv_freq"], dtype=torch.float32)
            self._device_cache[key] = tuple(t.to(device) for t in (q_mean, q_abs_mean, inv_freq))
        return self._device_cache[key]


def _heads_of_this_rank(
    q_mean: torch.Tensor, q_abs_mean: torch.Tensor, kv_heads: int, metadata: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query heads that go with ``kv_heads`` local KV heads.

    Under tensor parallelism (``tp_plan="auto"``) each rank holds a contiguous share of the KV heads and of
    their query heads. Statistics gathered on the rank (online) already have that share; statistics of the
    whole model (a file) are sliced to the rank's share, the rank being ``torch.distributed``'s (a
    tensor-parallel-only group, as transformers sets it up).
    """
    total_q, total_kv = metadata.get("num_q_heads"), metadata.get("num_kv_heads")
    heads = q_mean.shape[-2]
    if not total_q or not total_kv or kv_heads == total_kv or heads == kv_heads * (total_q // total_kv):
        return q_mean, q_abs_mean
    if heads != total_q or total_kv % kv_heads:
        raise ValueError(
            f"Query statistics of {heads} heads do not fit {kv_heads} KV heads (the model has {total_q} query and "
            f"{total_kv} KV heads)."
        )
    shards = total_kv // kv_heads
    rank = torch.distributed.get_rank() % shards if torch.distributed.is_initialized() else 0
    per = total_q // shards
    return q_mean[..., rank * per : (rank + 1) * per, :], q_abs_mean[..., rank * per : (rank + 1) * per, :]
