"""Independent references for an evicting ``RopeKVCache``: a full ``DynamicCache`` forward masked to the kept tokens.

The cache under test decides which tokens each full-attention layer keeps; the reference does not trust how it
attends to them. It runs the same model on a ``DynamicCache`` that holds every token and hands each attention
layer its own additive 4-D mask: the tokens that layer kept (read through the public
``RopeKVCache.kept_positions``), causal, real tokens only. Sliding-window layers get the plain window mask,
built here from the 2-D padding mask. Two flavours:

* ``layers_alike=False`` (the default: every layer ranks its own keys): each layer gets the mask of what it kept.
* ``layers_alike=True``: every full-attention layer must hold the same tokens (a scorer that ranks the same
  everywhere, e.g. recency); the reference checks that and gives all of them one mask.

The per-layer masks reach the attention modules through forward pre-hooks that replace their
``attention_mask`` keyword for the duration of one reference forward; the model itself gets a plain causal
4-D mask, which transformers passes through without building its own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from transformers import DynamicCache

from conftest import attention_modules, cache_kw

FULL, SLIDING = "full_attention", "sliding_attention"


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """generate's position ids: count real tokens, padding parked at 1."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def layer_types(model: nn.Module) -> list[str]:
    """``full_attention`` / ``sliding_attention`` per decoder layer, from the config."""
    config = model.config
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    kind = SLIDING if getattr(config, "sliding_window", None) else FULL
    return [kind] * config.num_hidden_layers


def _additive(allowed: torch.Tensor, query_pos: torch.Tensor, columns: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """Boolean [B, H_kv, new, total] -> additive float [B, H_q, new, total] (GQA: each KV head's mask repeated
    for its ``group`` query heads). Padding queries see nothing; they may see themselves so no NaN enters the
    reference (their logits are never compared)."""
    allowed = allowed | ((columns == query_pos) & ~allowed.any(-1, keepdim=True))
    allowed = allowed.repeat_interleave(group, dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _grid(total: int, new: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    query_pos = torch.arange(total - new, total, device=device).view(1, 1, new, 1)
    columns = torch.arange(total, device=device).view(1, 1, 1, total)
    return query_pos, columns


def kept_mask(
    kept: torch.Tensor, mask2d: torch.Tensor, new: int, group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4-D mask [B, H_q, new, total]: each query sees the kept tokens of its KV head, causally.

    ``kept``: int64 [B, H_kv, K] token indices, -1 at holes (``RopeKVCache.kept_positions``).
    """
    batch, kv_heads, _ = kept.shape
    total, device = mask2d.shape[1], kept.device
    allowed = torch.zeros(batch, kv_heads, total + 1, dtype=torch.bool, device=device)
    allowed.scatter_(2, torch.where(kept < 0, total, kept), True)  # holes (-1) land in a column then dropped
    query_pos, columns = _grid(total, new, device)
    allowed = allowed[:, :, None, :total] & (columns <= query_pos) & mask2d.bool().to(device)[:, None, None, :]
    return _additive(allowed, query_pos, columns, group, dtype)


def window_mask(
    mask2d: torch.Tensor, new: int, window: int, kv_heads: int, group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4-D mask [B, H_q, new, total] of a sliding-window layer: real tokens with
    ``query - window < column <= query`` (transformers' sliding-window rule)."""
    total, device = mask2d.shape[1], mask2d.device
    query_pos, columns = _grid(total, new, device)
    allowed = (columns <= query_pos) & (columns > query_pos - window) & mask2d.bool()[:, None, None, :]
    return _additive(allowed.expand(-1, kv_heads, -1, -1), query_pos, columns, group, dtype)


def kv_head_count(config) -> int:
    """KV heads per layer, under each family's own name (GPT-NeoX and Persimmon have one per query head)."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1  # Falcon's old multi-query layout
    for name in ("num_key_value_heads", "num_kv_heads"):
        if getattr(config, name, None):
            return getattr(config, name)
    return config.num_attention_heads


def reference_masks(model: nn.Module, cache, mask2d: torch.Tensor, new: int, layers_alike: bool) -> list[torch.Tensor]:
    """One additive 4-D mask per decoder layer for the forward that just ran on ``cache``.

    Full-attention layers: the tokens ``cache`` holds for that layer (``layers_alike``: the first full layer's,
    after checking every full layer holds the same). Sliding layers: their window.
    """
    config = model.config
    kv_heads = kv_head_count(config)
    group = config.num_attention_heads // kv_heads
    types = layer_types(model)
    full = [i for i, kind in enumerate(types) if kind == FULL]
    kept = {i: cache.kept_positions(i) for i in full}
    if layers_alike and full:
        first = kept[full[0]]
        for i in full[1:]:
            assert torch.equal(kept[i], first), f"layers {full[0]} and {i} disagree on the kept tokens"
    masks = []
    for i, kind in enumerate(types):
        if kind == FULL:
            masks.append(kept_mask(kept[i], mask2d, new, group, model.dtype))
        else:
            masks.append(window_mask(mask2d, new, config.sliding_window, kv_heads, group, model.dtype))
    return masks


@contextmanager
def attention_masks(model: nn.Module, masks: list[torch.Tensor]) -> Iterator[list[int]]:
    """Within the block, decoder layer ``i``'s attention gets ``masks[i]`` as its ``attention_mask``.

    Yields a list of per-layer call counts, so the caller can check every mask was really used.
    """
    layers = attention_modules(model)
    if len(layers) != len(masks):
        raise ValueError(f"{len(masks)} masks for {len(layers)} decoder layers")
    calls = [0] * len(layers)
    handles = []

    def hook_for(i: int):
        def hook(module, args, kwargs):
            if "attention_mask" not in kwargs:
                raise AssertionError(f"layer {i}'s attention was called without an attention_mask keyword")
            calls[i] += 1
            return args, {**kwargs, "attention_mask": masks[i]}

        return hook

    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(hook_for(i), with_kwargs=True))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def run_and_compare(
    model: nn.Module,
    cache,
    chunks: list[torch.Tensor],
    mask: torch.Tensor,
    decode_steps: int,
    atol: float = 1e-5,
    layers_alike: bool = False,
    reference: DynamicCache | None = None,
) -> int:
    """Feed ``chunks`` (then ``decode_steps`` greedy tokens) to ``cache`` and to the masked full-cache reference;
    compare the logits of every real new position. Returns the most slots the cache held at once.

    ``reference``: the full cache to run the reference on (default: a ``DynamicCache()`` without config, so every
    layer, sliding ones included, keeps every token)."""
    reference = DynamicCache() if reference is None else reference
    seen = 0
    steps = list(chunks) + [None] * decode_steps
    next_token = None
    max_kept = 0
    for chunk in steps:
        if chunk is None:
            chunk = next_token
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        new = chunk.shape[1]
        mask2d = mask[:, : seen + new]
        positions = positions_from_mask(mask2d)[:, -new:]
        with torch.no_grad():
            got = model(input_ids=chunk, attention_mask=mask2d, position_ids=positions, **cache_kw(model, cache)).logits
            masks = reference_masks(model, cache, mask2d, new, layers_alike)
            with attention_masks(model, masks) as calls:
                # The model gets the first layer's 4-D mask (passed through as is); the hooks replace it per layer.
                want = model(
                    input_ids=chunk, attention_mask=masks[0], position_ids=positions, **cache_kw(model, reference)
                ).logits
            assert calls == [1] * len(masks), f"attention calls per layer: {calls}"
        real = mask2d[:, -new:].bool()
        torch.testing.assert_close(got[real], want[real], atol=atol, rtol=0)
        seen += new
        max_kept = max(max_kept, cache.tokens_kept)
        next_token = got[:, -1:].argmax(-1)
    return max_kept
