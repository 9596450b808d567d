"""RoPE frequency-band scoring (TriAttention): the default eviction policy."""

from __future__ import annotations

from dataclasses import dataclass, field
import os
from typing import TYPE_CHECKING

import torch

from ..model.layouts import ROTATE_HALF
from .rope_scoring import query_weights, score_keys_weighted
from .base import ScoreContext, standardize
from .attention import grouped_attention, pool_along_tokens, spread_forward
from .key_novelty import key_novelty

# At a compaction right after a prompt, the window's vote (a z-score) is lifted by this many standard deviations
# where the prompt points (POINTED): those keys outrank every other. With the plain maximum of the vote and RoPE's
# z-score, RoPE's outliers took the budget at 16x and retrieval kept 2 of 8 codes (tune seeds), 8 of 8 with the lead.
VOTE_LEAD = 8.0
# The pooled vote z-score from which a key counts as pointed at by the prompt and gets the lead. Below it the vote
# competes with key novelty: a document's end points at nothing in particular, and with every key lifted by its
# vote a later question found 1 of 8 codes at 16x (tune seeds); with the lead from 3 up, 7 of 8 (5 and 8: 7 and 7),
# and with the question seen 8 of 8 (5 and 8: 7 and 7).
POINTED = 3.0

if TYPE_CHECKING:
    from ..statistics.frequency_stats import FrequencyStats


@dataclass
class FrequencyScorer:
    """The default policy: each key's expected future attention from pre-RoPE query statistics. Per query head the
    raw ``trig + norm`` score (:mod:`.rope_scoring`) is z-scored over the candidates; the max over each GQA group
    gives the KV head's score.

    Args:
        stats: calibrated statistics (a ``FrequencyStats`` or the path of a file from ``hf_ropekv.calibrate``);
            ``None``: the cache gathers them online, per batch row, from every query the model computes with it.
        half_life: online statistics only: tokens after which a query's weight halves (``None``: all alike).
        head_shrink: online statistics only: a pseudo-count, in queries, pulling each query head's means toward
            its layer's head average (0: every head on its own).
        prompt_window: at a compaction right after a prompt (a turn, a prefill chunk), the keys its last
            ``prompt_window`` queries point at rank first (:mod:`.prompt_window`), the others by the larger of that
            vote and key novelty (:mod:`.key_novelty`: a question that comes later needs what stands out, not what
            average queries attend to); when a decoding step compacts (the input is being answered), the vote is
            taken against the ``prompt_window`` queries before them; 0: RoPE geometry alone, at every compaction.
        vote_span: when a decoding step compacts, tokens after each key the prompt window attends to that rank
            with it: an answer is read forward from where a question points (a name, then the code after it).
        offsets: future offsets the mean query is placed at (default 1, 2, 4, ..., 65536).
    """

    stats: "FrequencyStats | str | os.PathLike | None" = None
    half_life: float | None = 128
    head_shrink: float = 256
    prompt_window: int = 32
    vote_span: int = 16
    offsets: tuple[int, ...] | None = None
    # Per-(layer, device) copies of `_cached_stats` (held and compared by reference: an id() can be reused).
    _device_cache: dict = field(default_factory=dict, init=False, repr=False)
    _cached_stats: "FrequencyStats | None" = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        half_life = self.half_life
        if half_life is not None and (isinstance(half_life, bool) or not isinstance(half_life, (int, float))
                                      or not half_life > 0):
            raise ValueError(f"half_life must be a positive number of tokens or None; got {half_life!r}.")
        shrink = self.head_shrink
        if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0 <= shrink < float("inf"):
            raise ValueError(f"head_shrink must be a number of queries >= 0; got {shrink!r}.")
        if isinstance(self.prompt_window, bool) or not isinstance(self.prompt_window, int) or self.prompt_window < 0:
            raise ValueError(f"prompt_window must be an int >= 0 (queries); got {self.prompt_window!r}.")
        if isinstance(self.vote_span, bool) or not isinstance(self.vote_span, int) or self.vote_span < 0:
            raise ValueError(f"vote_span must be an int >= 0 (tokens); got {self.vote_span!r}.")

    def score(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        return self.score_layers([keys], [ctx])[0]

    def score_layers(self, keys: list[torch.Tensor], contexts: list[ScoreContext]) -> torch.Tensor:
        """:meth:`score` of several layers of one shape and device at once: float32 ``[L, B, H_kv, S]``. Right after a
        prompt the prompt window's vote and key novelty; else RoPE geometry (the query weights of every layer from
        one set of ops, the kernel once per layer)."""
        if self.stats is None:
            raise RuntimeError(
                "FrequencyScorer has no statistics: pass stats=, or let RopeKVCache(model, ...) gather them.")
        first = keys[0]
        if any(k.shape[:3] != first.shape[:3] for k in keys):
            raise ValueError("score_layers needs layers of one shape; score them one by one with score().")
        after_prompt = [bool(self.prompt_window) and context.queries is not None for context in contexts]
        if not any(after_prompt):
            return self._rope_scores(keys, contexts)
        z = torch.empty(len(keys), *first.shape[:3], dtype=torch.float32, device=first.device)
        rope = [i for i, prompt in enumerate(after_prompt) if not prompt]
        if rope:
            z[rope] = self._rope_scores([keys[i] for i in rope], [contexts[i] for i in rope])
        for i, (layer_keys, context) in enumerate(zip(keys, contexts)):
            if after_prompt[i]:  # its own attention ranks first, key novelty orders the rest
                novelty = key_novelty(layer_keys, context.candidates, context.slot_positions, context.valid)
                z[i] = torch.maximum(novelty, self._prompt_vote(layer_keys, context))
        return z

    def _rope_scores(self, keys: list[torch.Tensor], contexts: list[ScoreContext]) -> torch.Tensor:
        """RoPE geometry's z-scores of the layers, ``[L, B, H_kv, S]``."""
        first, ctx = keys[0], contexts[0]
        batch, kv_heads, slots = first.shape[:3]
        tensors = [self._layer_tensors(c.layer_idx, first.device, kv_heads) for c in contexts]
        q_mean = torch.stack([t[0] for t in tensors])  # [L, H_q, F] or [L, B, H_q, F]
        q_abs_mean = torch.stack([t[1] for t in tensors])
        inv_freq = tensors[0][2]
        layers, (q_heads, pairs) = len(keys), q_mean.shape[-2:]
        if q_mean.dim() == 4:  # one set per row: rows first, the layers' heads side by side
            q_mean, q_abs_mean = (t.transpose(0, 1).reshape(t.shape[1], layers * q_heads, pairs)
                                  for t in (q_mean, q_abs_mean))
        else:
            q_mean, q_abs_mean = (t.reshape(1, layers * q_heads, pairs) for t in (q_mean, q_abs_mean))
        w, c = query_weights(q_mean, q_abs_mean, inv_freq, ctx.position, self.offsets)
        # [B', L * H_q, *] -> [L, B', H_q, *]: each layer's weights contiguous, as the kernel reads them.
        w, c = (t.view(t.shape[0], layers, q_heads, -1).transpose(0, 1).contiguous().to(first.device) for t in (w, c))
        layout = self.stats.metadata.get("rotary_layout", ROTATE_HALF)
        raw = torch.empty(layers, batch, q_heads, slots, dtype=torch.float32, device=first.device)
        for i, layer_keys in enumerate(keys):
            score_keys_weighted(layer_keys, w[i], c[i], out=raw[i], layout=layout)
        group = q_heads // kv_heads
        candidates = torch.stack([context.candidates for context in contexts]).repeat_interleave(group, dim=2)
        return standardize(raw, candidates).view(layers, batch, kv_heads, group, slots).amax(dim=3)

    def _prompt_vote(self, keys: torch.Tensor, ctx: ScoreContext) -> torch.Tensor:
        """z-score of the attention the prompt window puts on each key (SnapKV's vote, pooled over 5 tokens), lifted
        by ``VOTE_LEAD`` where it reaches ``POINTED``; at a decoding step spread ``vote_span`` tokens forward.

        When a decoding step compacts, the input before it is being answered: its last queries (a question, an
        instruction) are weighed against the ``prompt_window`` queries before them, ``log((window + u) / (before +
        u))`` with ``u`` a uniform share, so attention sinks and the instruction that every query attends to lose
        their lead to what the question asks for. When more input follows, the window is one more stretch of text
        and that ratio would lift filler: the plain vote, not spread (it points at the text just read, whose
        continuation is not being copied; spread, it took the budget from what a later question needs: question
        unseen, 4K at 16x, with novelty against the prompt's mean key, 38 of 64 tune haystacks unspread, 31 spread)."""
        window = self.prompt_window
        mass = self._pooled_attention(keys, ctx, slice(-window, None))
        if ctx.decoding and ctx.queries.shape[2] > window:
            before = self._pooled_attention(keys, ctx, slice(None, -window))
            uniform = window / ctx.candidates.sum(-1, keepdim=True).clamp_min(1).float()
            mass = torch.log((mass + uniform) / (before + uniform))
        pooled = standardize(mass, ctx.candidates)
        lifted = torch.where(pooled >= POINTED, pooled + VOTE_LEAD, pooled)
        return spread_forward(lifted, ctx.slot_positions, ctx.valid, self.vote_span if ctx.decoding else 0)

    def _pooled_attention(self, keys: torch.Tensor, ctx: ScoreContext, queries: slice) -> torch.Tensor:
        """The attention the window's ``queries`` put on each key, summed, averaged over each GQA group and pooled
        over 5 tokens: ``[B, H_kv, S]``."""
        mass = grouped_attention(keys, ctx, queries, type(self).__name__)
        return pool_along_tokens(mass, ctx.slot_positions, ctx.valid, 5, "avgpool")

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


def _heads_of_this_rank(q_mean: torch.Tensor, q_abs_mean: torch.Tensor, kv_heads: int,
                        metadata: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The query heads that go with ``kv_heads`` local KV heads: under tensor parallelism, statistics of the whole
    model (a file) are sliced to this rank's contiguous share (online statistics already have it)."""
    total_q, total_kv = metadata.get("num_q_heads"), metadata.get("num_kv_heads")
    heads = q_mean.shape[-2]
    if not total_q or not total_kv or kv_heads == total_kv or heads == kv_heads * (total_q // total_kv):
        return q_mean, q_abs_mean
    if heads != total_q or total_kv % kv_heads:
        raise ValueError(f"Query statistics of {heads} heads do not fit {kv_heads} KV heads (the model has {total_q} "
                         f"query and {total_kv} KV heads).")
    shards = total_kv // kv_heads
    rank = torch.distributed.get_rank() % shards if torch.distributed.is_initialized() else 0
    per = total_q // shards
    return q_mean[..., rank * per : (rank + 1) * per, :], q_abs_mean[..., rank * per : (rank + 1) * per, :]
