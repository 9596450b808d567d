"""The attention a RopeKVCache's model runs: the Triton decode kernel over the kept arena, else sdpa.

A decoding step (one query token, on CUDA) whose cache is quantized (``storage.paged.SCALES``) or has evicted tokens
(``DECODE``) attends with ``hf_ropekv.kernels.attention.decode_attention``. Before any eviction the cache keeps sdpa,
so its tokens equal ``DynamicCache``'s bit for bit (the kernel sums in another order).

Over a static arena (a masked grouped-query attention) transformers' sdpa copies every key/value head per query head
(``repeat_kv``; under ``torch.compile`` even in 5.24), which for one decoding token costs more than the attention.
:func:`grouped_sdpa` folds the ``groups`` query heads of a key/value head into its query rows instead: the same keys,
values and mask per row, so the same attention, with no copy (:func:`_fold_is_cheaper` says when it pays for a
prefill chunk). :func:`ropekv_attention` is registered as ``"hf_ropekv_sdpa"`` (:func:`use_ropekv_attention`)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from .. import _compat
from ..kernels.attention import decode_attention
from ..kernels.quantize import dequantize_kv
from ..storage.paged import DECODE, FIXED, SCALES
from .capture import find_attention_modules


def ropekv_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``query [B, H, q, D]``, ``key``/``value`` ``[B, H_kv, S, D]``,
    a boolean sdpa mask) -> ``([B, q, H, D], None)``: the decode kernel where it applies, else sdpa."""
    scales = getattr(key, SCALES, None)
    if query.shape[2] == 1 and query.is_cuda and (scales is not None or getattr(key, DECODE, False)) \
            and not dropout and kwargs.get("s_aux") is None and not kwargs.get("output_attentions", False):
        mask = None if attention_mask is None else attention_mask[:, 0, -1, :].expand(query.shape[0], -1)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask == 0  # an additive mask: 0 where attended
        out = decode_attention(balanced_query(query[:, :, 0], None if scales is None else scales[2]), key, value,
                               mask, scale=scaling or query.shape[-1] ** -0.5,
                               softcap=kwargs.get("softcap"), key_scale=None if scales is None else scales[0],
                               value_scale=None if scales is None else scales[1])
        return out.unsqueeze(1), None
    if scales is not None:  # a prefill chunk, or the CPU: attend over the dequantized arena
        key, value = dequantize_kv(key, scales[0], query.dtype, scales[2]), dequantize_kv(value, scales[1], query.dtype)
    elif not getattr(key, FIXED, False):
        return _compat.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, is_causal=is_causal, **kwargs)
    return grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def balanced_query(query: torch.Tensor, balance: torch.Tensor | None) -> torch.Tensor:
    """``query [B, H, D]`` times the int8 keys' channel balance ``[B, H_kv, 1, D]`` of its key/value head: the decode
    kernel then reads the balanced keys' codes as they are (``q . (k * b) = (q * b) . k``)."""
    if balance is None:
        return query
    batch, heads, dim = query.shape
    grouped = query.reshape(batch, balance.shape[1], heads // balance.shape[1], dim) * balance  # float32 product
    return grouped.reshape(batch, heads, dim).to(query.dtype)


GROUPED_SDPA = "hf_ropekv_sdpa"


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` (same arguments and result), with masked queries attending per
    key/value head (no key/value copy); ``attention_mask`` ``[B or 1, 1 or H, q or 1, S]``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if not (groups > 1 and attention_mask is not None and key.shape[1] * groups == query.shape[1]
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False)
            and _fold_is_cheaper(query, key, attention_mask, groups)):
        return _compat.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, q_len, dim = query.shape
    kv_heads = heads // groups
    # Query head h uses key/value head h // groups (repeat_kv's order): [B, H, q, D] -> [B, H_kv, groups * q, D],
    # rows ordered (group member, token).
    grouped_query = query.reshape(batch, kv_heads, groups * q_len, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped_query, key, value, attn_mask=_grouped_mask(attention_mask, kv_heads, groups, q_len), dropout_p=dropout,
        scale=scaling, is_causal=False)
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def _grouped_mask(mask: torch.Tensor, kv_heads: int, groups: int, q_len: int) -> torch.Tensor:
    """``mask [B or 1, 1 or H, q or 1, S]`` laid out for the grouped query rows ``[.., H_kv, groups * q, S]``."""
    if mask.shape[1] == 1 and (q_len == 1 or mask.shape[2] == 1):
        return mask  # the same row for every head and token: broadcasts over the grouped rows as it is
    rows, heads, _, slots = mask.shape
    if heads == 1:  # one mask for all heads: each group member's block of rows repeats the tokens' rows
        return mask.expand(rows, groups, q_len, slots).reshape(rows, 1, groups * q_len, slots)
    return mask.expand(rows, heads, q_len, slots).reshape(rows, kv_heads, groups * q_len, slots)


def _fold_is_cheaper(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, groups: int) -> bool:
    """Whether the mask rows the fold repeats cost fewer bytes than the key/value heads ``repeat_kv`` would copy."""
    q_len = query.shape[2]
    if mask.shape[1] != 1 or q_len == 1 or mask.shape[2] == 1:
        return True  # nothing to repeat: the mask is used as it is or only viewed
    mask_bytes = mask.shape[0] * groups * q_len * mask.shape[-1] * mask.element_size()
    kv_bytes = 2 * key.shape[0] * key.shape[1] * groups * key.shape[2] * key.shape[3] * key.element_size()
    return mask_bytes < kv_bytes


def use_ropekv_attention(model: nn.Module) -> str | None:
    """Make an sdpa ``model`` attend with :func:`ropekv_attention` (through ``config._attn_implementation``); return
    the implementation it had, or ``None`` (nothing changed) when it does not use sdpa or dispatch by name."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == GROUPED_SDPA:
        return "sdpa"  # switched already (by this model's hooks, or, for a copy of a model, by the original's)
    if implementation != "sdpa" or not dispatches_by_name(model):
        return None
    _compat.register_attention(GROUPED_SDPA, ropekv_attention)
    model.config._attn_implementation = GROUPED_SDPA
    return "sdpa"


def dispatches_by_name(model: nn.Module) -> bool:
    """Whether the model's attention looks its function up by name (``ALL_ATTENTION_FUNCTIONS``); Falcon on
    transformers 5.17 tests ``_attn_implementation == "sdpa"`` itself, and under another name runs eager attention."""
    try:
        attention = type(find_attention_modules(model)[0])
    except ValueError:
        return False
    return _looks_up_by_name(attention)


@functools.cache  # by class: reading the source costs milliseconds, and every cache attaches anew
def _looks_up_by_name(attention: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(attention.forward)
    except (OSError, TypeError):
        return False


def restore_attention(model: nn.Module, previous: str | None) -> None:
    """Undo :func:`use_ropekv_attention` (``previous`` is what it returned); a no-op for ``None``."""
    config = getattr(model, "config", None)
    if previous is not None and config is not None and config._attn_implementation == GROUPED_SDPA:
        config._attn_implementation = previous
