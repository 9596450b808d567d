"""Attention recomputed from captured post-RoPE queries and the cached keys, for the scorers that rank keys by
attention (SnapKV, H2O, R-KV): sdpa and flash attention never materialise the weights. Plain PyTorch, float32,
chunked over the queries so the ``[B, H_q, n, S]`` intermediate stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import ScoreContext

# Elements of one chunk's logits at most (float32: 256 MiB).
_CHUNK_ELEMENTS = 1 << 26


def attention_from_queries(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                           slot_positions: torch.Tensor, valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention of each query over the valid, causal slots.

    Args:
        queries: ``[B, H_q, N, D]`` post-RoPE queries (query head ``h`` reads KV head ``h // (H_q // H_kv)``).
        keys: ``[B, H_kv, S, D]`` post-RoPE keys.
        query_positions: int64 ``[B, N]`` token index of each query, -1 for none.
        slot_positions: int64 ``[B, H_kv, S]`` token index held by each slot.
        valid: bool ``[B, H_kv, S]`` or ``None`` (all valid).
        scale: logit scale.

    Returns:
        float32 ``[B, H_q, N, S]``: a distribution over the valid slots with ``slot_positions <= query_positions``;
        zeros where no slot qualifies.
    """
    batch, q_heads, n_queries, _ = queries.shape
    out = torch.empty(batch, q_heads, n_queries, keys.shape[2], dtype=torch.float32, device=keys.device)
    for start, stop, probs in _chunks(queries, keys, query_positions, slot_positions, valid, scale):
        out[:, :, start:stop] = probs.flatten(1, 2)
    return out


def summed_attention(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                     slot_positions: torch.Tensor, valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``attention_from_queries(...).sum(dim=2)``, float32 ``[B, H_q, S]``, one chunk of queries at a time."""
    batch, q_heads = queries.shape[:2]
    total = torch.zeros(batch, q_heads, keys.shape[2], dtype=torch.float32, device=keys.device)
    for _, _, probs in _chunks(queries, keys, query_positions, slot_positions, valid, scale):
        total += probs.sum(dim=3).flatten(1, 2)
    return total


def _chunks(queries, keys, query_positions, slot_positions, valid, scale):
    """``(start, stop, probabilities)`` of consecutive query chunks."""
    _check_shapes(queries, keys, query_positions, slot_positions, valid)
    batch, q_heads, n_queries, _ = queries.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * q_heads * keys.shape[2]))
    for start in range(0, n_queries, step):
        stop = min(start + step, n_queries)
        yield start, stop, _chunk_probabilities(queries[:, :, start:stop], keys, query_positions[:, start:stop],
                                                slot_positions, valid, scale)


def group_mean(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H_q, S]`` -> ``[B, H_kv, S]``: mean over the query heads of each GQA group (as kvpress does)."""
    batch, q_heads, slots = per_query_head.shape
    return per_query_head.view(batch, kv_heads, q_heads // kv_heads, slots).mean(dim=2)


def require_queries(ctx: ScoreContext, scorer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's queries and their positions, or an error saying how to get them."""
    if ctx.queries is None or ctx.query_positions is None:
        raise RuntimeError(
            f"{scorer} ranks keys by attention and needs the layer's post-RoPE queries, but the ScoreContext has "
            "none (ctx.queries is None). Use it with a RopeKVCache that captures queries for scorers with a "
            "`query_window` attribute, or pick a query-free scorer (FrequencyScorer, RecencyScorer, ...).")
    return ctx.queries, ctx.query_positions


def context_scale(ctx: ScoreContext, head_dim: int) -> float:
    return ctx.attention_scale if ctx.attention_scale is not None else head_dim**-0.5


def _chunk_probabilities(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                         slot_positions: torch.Tensor, valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """float32 ``[B, H_kv, G, n, S]`` probabilities of a chunk of queries (G = query heads per KV head)."""
    batch, q_heads, n, dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.to(device=keys.device, dtype=torch.float32).view(batch, kv_heads, q_heads // kv_heads, n, dim)
    logits = torch.matmul(grouped, keys.to(torch.float32).unsqueeze(2).transpose(-1, -2)) * scale
    q_pos = query_positions.to(keys.device)[:, None, None, :, None]  # [B, 1, 1, n, 1]
    allowed = (slot_positions.to(keys.device)[:, :, None, None, :] <= q_pos) & (q_pos >= 0)
    if valid is not None:
        allowed = allowed & valid.to(keys.device)[:, :, None, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # A query with no allowed slot softmaxes to NaN: it attends nowhere, so it contributes nothing.
    return torch.where(allowed.any(dim=-1, keepdim=True), probs, torch.zeros((), device=probs.device))


def _check_shapes(queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
                  slot_positions: torch.Tensor, valid: torch.Tensor | None) -> None:
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries must be [B, H_q, N, D] and keys [B, H_kv, S, D]; got {tuple(queries.shape)} and "
                         f"{tuple(keys.shape)}.")
    batch, q_heads, n_queries, dim = queries.shape
    k_batch, kv_heads, slots, k_dim = keys.shape
    if batch != k_batch or dim != k_dim:
        raise ValueError(
            f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} must agree on batch size and head dim.")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads}) for GQA.")
    if tuple(query_positions.shape) != (batch, n_queries):
        raise ValueError(f"query_positions must be [B, N] = {(batch, n_queries)}; got {tuple(query_positions.shape)}.")
    if tuple(slot_positions.shape) != (batch, kv_heads, slots):
        raise ValueError(
            f"slot_positions must be [B, H_kv, S] = {(batch, kv_heads, slots)}; got {tuple(slot_positions.shape)}.")
    if valid is not None and tuple(valid.shape) != (batch, kv_heads, slots):
        raise ValueError(f"valid must be [B, H_kv, S] = {(batch, kv_heads, slots)}; got {tuple(valid.shape)}.")


def window_attention(keys: torch.Tensor, ctx: ScoreContext, window: int,
                     scorer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The observation-window vote of SnapKV and R-KV: ``(mass [B, H_kv, S], positions [B, N])``, the attention the
    last ``window`` queries put on each slot, averaged over each GQA group."""
    _, positions = require_queries(ctx, scorer)
    return grouped_attention(keys, ctx, slice(-window, None), scorer), positions[:, -window:]


def grouped_attention(keys: torch.Tensor, ctx: ScoreContext, queries: slice, scorer: str) -> torch.Tensor:
    """``[B, H_kv, S]``: the attention the context's ``queries`` (a slice of them) put on each slot, summed over
    those queries and averaged over each GQA group."""
    all_queries, positions = require_queries(ctx, scorer)
    scale = context_scale(ctx, keys.shape[-1])
    mass = summed_attention(all_queries[:, :, queries], keys, positions[:, queries], ctx.slot_positions, ctx.valid,
                            scale)
    return group_mean(mass, keys.shape[1])


def pool_along_tokens(scores: torch.Tensor, slot_positions: torch.Tensor, valid: torch.Tensor | None, kernel_size: int,
                      mode: str) -> torch.Tensor:
    """1-D pooling (``mode`` ``"avgpool"`` or ``"maxpool"``, stride 1, same length) of ``[B, H, S]`` scores over
    neighbouring tokens in token order; invalid slots are zeroed and sorted last."""
    if kernel_size == 1:
        return scores
    pool = torch.nn.functional.avg_pool1d if mode == "avgpool" else torch.nn.functional.max_pool1d
    return _in_token_order(scores, slot_positions, valid,
                           lambda x: pool(x, kernel_size=kernel_size, stride=1, padding=kernel_size // 2))


def spread_forward(scores: torch.Tensor, slot_positions: torch.Tensor, valid: torch.Tensor | None,
                   span: int) -> torch.Tensor:
    """Each slot's score becomes the largest of its own and those of the ``span`` slots before it in token order
    (invalid slots zeroed and last): a key a query points at passes its score on to the tokens that follow it."""
    if span == 0:
        return scores
    return _in_token_order(scores, slot_positions, valid, lambda x: torch.nn.functional.max_pool1d(
        torch.nn.functional.pad(x, (span, 0), value=float("-inf")), kernel_size=span + 1, stride=1))


def _in_token_order(scores: torch.Tensor, slot_positions: torch.Tensor, valid: torch.Tensor | None,
                    fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` (``[N, 1, S]`` -> same shape) applied to ``[B, H, S]`` scores sorted by token, invalid slots zeroed and
    last; the result back in slot order."""
    batch, heads, slots = scores.shape
    if valid is not None:
        scores = scores.masked_fill(~valid, 0.0)
        order_key = slot_positions.masked_fill(~valid, torch.iinfo(torch.int64).max)
    else:
        order_key = slot_positions
    order = torch.argsort(order_key, dim=-1, stable=True)
    done = fn(scores.gather(-1, order).reshape(batch * heads, 1, slots)).reshape(batch, heads, slots)
    return torch.empty_like(done).scatter_(-1, order, done)


def check_window(window: int, kernel_size: int, pooling: str) -> None:
    """Validate the observation ``window`` and the (kernel_size, pooling) pair of SnapKV / R-KV."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (queries); got {window!r}.")
    if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd int (pooling keeps the length); got {kernel_size!r}.")
    if pooling not in ("avgpool", "maxpool"):
        raise ValueError(f"pooling must be 'avgpool' or 'maxpool'; got {pooling!r}.")
