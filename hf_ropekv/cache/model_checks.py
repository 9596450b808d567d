"""What a cache's options need from the model it holds (its layer kinds), checked when the cache is built."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapter.graphed_step import not_capturable
from ..model.attention import GROUPED_SDPA, dispatches_by_name
from ..model.geometry import FULL, SLIDING, ModelGeometry, describe
from ..warnings import warn
from .options import OPTION_NAMES, CacheOptions


def checked_options(model_or_config: Any, budget: int | None, options: dict[str, Any],
                    caller: str) -> tuple[CacheOptions, ModelGeometry]:
    """The options of a cache of ``model_or_config`` (``scorer`` aside) and the model's geometry, once every check
    that needs no scorer has passed; ``caller`` names who was called in the unknown-option error. Shared by
    ``RopeKVCache`` and ``hf_ropekv.enable``, so enable refuses before any generation what a cache would refuse."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"{caller} got unknown option(s) {unknown}; the options are {list(OPTION_NAMES)}.")
    cache_options = CacheOptions(budget=budget, **{name: value for name, value in options.items() if name != "scorer"})
    geometry = describe(model_or_config)  # raises ValueError for models the cache cannot hold
    check_sliding_windows(geometry, budget)
    check_kv_bits(cache_options.kv_bits, model_or_config)
    return cache_options, geometry


def check_sliding_windows(geometry: ModelGeometry, budget: int | None) -> None:
    """Sliding layers read the last ``window`` columns of the mask the full layers read, where shorter rows have
    holes: a budget of at least the window keeps those out of reach. On a model with sliding layers only, a budget
    bounds nothing (they are bounded already)."""
    windows = [w for kind, w in zip(geometry.layer_types, geometry.sliding_windows) if kind == SLIDING and w]
    if budget is not None and windows and FULL not in geometry.layer_types:
        warn(f"budget={budget} evicts nothing on '{geometry.model_type}': all its layers are sliding-window layers, "
             f"already bounded by their window ({max(windows)} tokens), which RopeKVCache leaves as they are. Use a "
             "DynamicCache, or budget=None to silence this.")
    if budget is not None and windows and FULL in geometry.layer_types and budget < max(windows):
        raise ValueError(f"budget={budget} is smaller than the sliding window ({max(windows)}) of "
                         f"'{geometry.model_type}''s sliding-window layers. Use budget >= {max(windows)}: the "
                         "full-attention layers then always keep at least as many tokens as a window holds.")


def static_error(geometry: ModelGeometry, budget: int | None, model_or_config: Any, scorer: Any = None) -> str | None:
    """Why a cache cannot be static, or None. ``static=True`` needs a budget (the arena's size), the model (its hooks
    prepare each forward), no scorer that recomputes attention, and one window for every sliding-window layer
    (transformers builds one sliding-window mask for them all)."""
    if budget is None:
        return "static=True needs a budget: the fixed arena holds budget + compress_every slots per layer."
    if not isinstance(model_or_config, nn.Module):
        return (
            "static=True needs the model, not its config: RopeKVCache(model, budget=..., static=True). The cache "
            "prepares every forward (compaction, slots, mask) from the model's hooks before the compiled step runs.")
    if getattr(scorer, "query_window", None) is not None:
        name = type(scorer).__name__
        return (f"static=True cannot run {name}: it ranks keys by attention weights, recomputed from a window of the "
                "model's recent queries that the cache gathers and keeps growing on the eager path; a static cache's "
                "compiled decode step (fixed shapes, every decision taken before the forward) cannot hold or hand over "
                f"those queries. Use static=False with {name}, or keep static=True with a RoPE or query-free scorer "
                "(the default RoPE FrequencyScorer, RecencyScorer, KeyNormScorer, RandomScorer).")
    windows = {w for kind, w in zip(geometry.layer_types, geometry.sliding_windows) if kind == SLIDING}
    if None in windows or len(windows) > 1:
        return (f"static=True does not support '{geometry.model_type}': its sliding-window layers have windows "
                f"{sorted(windows, key=str)}; a static cache needs one window size for all of them. Use static=False.")
    return None


def check_static(geometry: ModelGeometry, budget: int | None, model_or_config: Any, scorer: Any = None) -> None:
    """Raise ``ValueError`` with :func:`static_error`'s reason where ``static=True`` cannot hold this model."""
    error = static_error(geometry, budget, model_or_config, scorer)
    if error is not None:
        raise ValueError(error)


def static_unsupported(geometry: ModelGeometry, budget: int | None, model: nn.Module | None, scorer: Any) -> str | None:
    """Why ``static="auto"`` leaves this cache growing, or None. Static pays only where its decode steps replay CUDA
    graphs (the model on one CUDA device and rank) and ``generate`` would ask for a compiled forward (the
    quantization allows it); elsewhere its eager steps are slower than a growing cache's."""
    if model is None:
        return "built from a config"
    device = getattr(model, "device", torch.device("cpu"))
    reason = static_error(geometry, budget, model, scorer) or not_capturable(model, device)
    quantizer = getattr(model, "hf_quantizer", None)
    if reason is None and quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return f"transformers does not compile {type(quantizer).__name__} models"
    return reason


def check_kv_bits(kv_bits: int | None, model_or_config: Any) -> None:
    """``kv_bits=8`` stores int8 codes, which only hf_ropekv's attention reads: it needs the model, on sdpa attention
    that transformers dispatches by name (``hf_ropekv.model.attention``)."""
    if kv_bits is None:
        return
    if not isinstance(model_or_config, nn.Module):
        raise ValueError("kv_bits=8 needs the model, not its config: RopeKVCache(model, budget=..., kv_bits=8). The "
                         "cache switches the model's attention to one that reads int8 keys and values.")
    implementation = getattr(getattr(model_or_config, "config", None), "_attn_implementation", None)
    if implementation not in ("sdpa", GROUPED_SDPA):
        raise ValueError("kv_bits=8 needs a model on sdpa attention that transformers dispatches by name; this "
                         f"{type(model_or_config).__name__} uses {implementation!r}. Load it with "
                         "attn_implementation='sdpa', or use kv_bits=None.")
    if not dispatches_by_name(model_or_config):
        raise ValueError(f"kv_bits=8 needs attention that transformers looks up by name; this transformers version's "
                         f"{type(model_or_config).__name__} calls sdpa itself, so its attention cannot read int8 keys "
                         "and values. Use kv_bits=None, or a transformers version where the model dispatches by name.")
