"""A fingerprint of the weights query statistics were calibrated on: loading statistics of other weights with the
same geometry (a fine-tune, another checkpoint) warns, naming both.

The fingerprint is 12 hex digits of a SHA-256 over an 8 x 8 sample of the query projection weights of the first,
middle and last layers, rounded to bfloat16 (|w| < 2**-13 counts as 0), so float32 / bfloat16 / float16 copies
share it. Quantized weights are dequantized first (so they get a fingerprint of their own); unreadable weights
(meta, sharded, unknown projection) give none, and nothing is checked.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any, Mapping

import torch
from torch import nn

from ..warnings import warn

#: Attention attributes holding the query projection (separate, or fused with K and V).
PROJECTION_NAMES = ("q_proj", "qkv_proj", "query_key_value", "Wqkv", "c_attn")
_SAMPLE = 8  # rows and columns sampled per layer
_ZERO_BELOW = 2.0**-13  # |w| below this counts as 0 (float16 subnormals lose bits there)
_DIGITS = 12

_by_model: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str | None]]" = weakref.WeakKeyDictionary()
_warned: set[tuple[str, str, str]] = set()


def weights_fingerprint(model: nn.Module) -> str | None:
    """The fingerprint of ``model``'s query projection weights, or ``None``; cached per model until a sampled
    weight changes in place."""
    projections = _projections(model)
    if not projections:
        return None
    key = tuple((id(p.weight), getattr(p.weight, "_version", 0)) for p in projections)
    cached = _by_model.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    digest = hashlib.sha256()
    for projection in projections:
        weight = _dense_weight(projection)
        if weight is None or weight.ndim != 2:
            fingerprint = None
            break
        rows = torch.linspace(0, weight.shape[0] - 1, _SAMPLE).round().long().to(weight.device)
        cols = torch.linspace(0, weight.shape[1] - 1, _SAMPLE).round().long().to(weight.device)
        sample = weight.detach().index_select(0, rows).index_select(1, cols).float().cpu().to(torch.bfloat16)
        sample = torch.where(sample.abs() < _ZERO_BELOW, torch.zeros_like(sample), sample)
        digest.update(repr(tuple(weight.shape)).encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    else:
        fingerprint = digest.hexdigest()[:_DIGITS]
    _by_model[model] = (key, fingerprint)
    return fingerprint


def model_source(model: nn.Module) -> str:
    """What the model was loaded from, for messages: its ``name_or_path``, else its class name."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else type(model).__name__


def warn_if_other_weights(metadata: Mapping[str, Any], model: nn.Module, where: str | None = None) -> bool:
    """Warn (once per fingerprint pair and model) if statistics with this ``metadata`` were calibrated on other
    weights than ``model``'s; returns whether the fingerprints differ (False when either side has none)."""
    theirs = metadata.get("weights_fingerprint")
    if not theirs:
        return False
    ours = weights_fingerprint(model)
    if ours is None or ours == theirs:
        return False
    source = metadata.get("source", "unknown text")
    calibrated_on = metadata.get("weights_source", "unknown model")
    here = model_source(model)
    if (theirs, ours, here) not in _warned:
        _warned.add((theirs, ours, here))
        origin = f"{where}: " if where else ""
        warn(f"{origin}these query statistics were calibrated on weights with fingerprint {theirs} ({calibrated_on}; "
             f"text: {source}), but this model ({here}) has fingerprint {ours}. Same geometry, other weights (a "
             "fine-tune or another checkpoint?): eviction would rank keys by another model's queries. Recalibrate with "
             "hf_ropekv.calibrate(model, tokenizer, texts).save(path) on this model. (A quantized copy of the "
             "calibrated model also has another fingerprint; statistics of the unquantized model are then still a good "
             "fit.)")
    return True


def _projections(model: nn.Module) -> list[nn.Module]:
    """The query projection of the first, middle and last decoder layers ([] if not found)."""
    from ..model.capture import find_attention_modules

    try:
        attention = find_attention_modules(model)
    except ValueError:
        return []
    found = []
    for module in (attention[0], attention[len(attention) // 2], attention[-1]):
        projection = next((getattr(module, n) for n in PROJECTION_NAMES if hasattr(module, n)), None)
        if not isinstance(projection, nn.Module) or getattr(projection, "weight", None) is None:
            return []
        found.append(projection)
    return found


def _dense_weight(projection: nn.Module) -> torch.Tensor | None:
    """The projection's weight as a dense floating tensor (quantized weights dequantized), or ``None``."""
    weight = projection.weight
    if weight.device.type == "meta" or hasattr(weight, "full_tensor"):  # offloaded, or a TP-sharded DTensor
        return None
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:  # bitsandbytes 4-bit (Params4bit)
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(weight.data, quant_state)
    scales = getattr(weight, "SCB", None) if weight.dtype == torch.int8 else None
    if scales is not None:  # bitsandbytes 8-bit (Int8Params): one absmax scale per output row
        return weight.data.float() * (scales.float().view(-1, 1) / 127.0)
    if type(weight) not in (torch.Tensor, nn.Parameter) and callable(getattr(weight, "dequantize", None)):
        return weight.dequantize()  # optimum-quanto QTensor
    return weight if weight.is_floating_point() else None
