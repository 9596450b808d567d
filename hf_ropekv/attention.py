"""Grouped-query attention over a static arena without copying the key/value heads.

A static cache attends over its whole arena with a slot-validity mask. transformers' sdpa integration hands a
masked grouped-query attention to ``torch.nn.functional.scaled_dot_product_attention`` only after ``repeat_kv``
has copied every key/value head ``num_key_value_groups`` times (a mask rules out ``enable_gqa``'s fast kernels).
For one decoding token that copy costs more than the attention itself: at batch 16 and 2,176 slots it writes
about 0.6 GB per layer of a Qwen3-8B-shaped model. Newer transformers (5.24) avoid it in eager mode by folding
each key/value head's group of query heads into the query axis; under ``torch.compile``, which is where a static
cache runs, they still copy.

:func:`grouped_sdpa` is transformers' sdpa with that fold applied in every mode: for a single query token with a
mask, the ``groups`` query heads that share a key/value head become ``groups`` query rows of that head. Each row
sees the same keys, values and mask as before, so the result is the same attention. Every other call goes to
transformers' own sdpa function unchanged. It is registered as the attention implementation
``"hf_ropekv_sdpa"``, which a static cache selects on an sdpa model (:func:`use_grouped_sdpa`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import _compat
from .model_info import ModelGeometry

#: The attention implementation name under which :func:`grouped_sdpa` is registered with transformers.
GROUPED_SDPA = "hf_ropekv_sdpa"


def grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, with a single masked query token attending per key/value head (no copy).

    Same arguments and result as ``transformers.integrations.sdpa_attention.sdpa_attention_forward``: ``query``
    ``[B, H, q, D]``, ``key``/``value`` ``[B, H_kv, S, D]``, ``attention_mask`` ``[B or 1, 1 or H, q, S]``; returns
    ``([B, q, H, D], None)``.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    foldable = (
        groups > 1
        and attention_mask is not None
        and query.shape[2] == 1
        and key.shape[1] * groups == query.shape[1]
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
    )
    if not foldable:
        return _compat.sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    batch, heads, _, dim = query.shape
    kv_heads = heads // groups
    # Query head h uses key/value head h // groups (repeat_kv's order), so [B, H, 1, D] -> [B, H_kv, groups, D].
    grouped_query = query.reshape(batch, kv_heads, groups, dim)
    mask = attention_mask
    if mask.shape[1] != 1:  # one mask per query head: it follows its head into the group's rows
        mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped_query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: nn.Module, geometry: ModelGeometry) -> str | None:
    """Make an sdpa grouped-query ``model`` attend with :func:`grouped_sdpa`; return the implementation it had.

    Returns ``None`` and changes nothing when the model does not use sdpa or has as many key/value heads as
    query heads (``geometry``: nothing to copy). The change sets ``model.config._attn_implementation`` (and its
    sub-configs'), so ``restore_attention`` can undo it.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    if geometry.num_kv_heads == geometry.num_q_heads:
        return None
    _compat.register_attention(GROUPED_SDPA, grouped_sdpa)
    config._attn_implementation = GROUPED_SDPA
    return "sdpa"


def restore_attention(model: nn.Module, previous: str | None) -> None:
    """Undo :func:`use_grouped_sdpa` (``previous`` is what it returned); a no-op for ``None``."""
    config = getattr(model, "config", None)
    if previous is not None and config is not None and config._attn_implementation == GROUPED_SDPA:
        config._attn_implementation = previous
