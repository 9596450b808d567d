"""Calibrated pre-RoPE query statistics, per layer ``l``, query head ``h`` and rotary pair ``f``:
``q_mean[l, h, f] = E[q_f]`` (complex64) and ``q_abs_mean[l, h, f] = E|q_f|`` (float32), with ``q_f`` the pair of
the model's rotary layout. Files are safetensors (float32 tensors, metadata as header JSON): no pickle.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..model.geometry import ModelGeometry
from ..model.layouts import ROTATE_HALF
from ..warnings import warn
from .fingerprint import warn_if_other_weights
from .query_sums import complex_means, masked_parts, query_parts


FORMAT_VERSION = 1
_HEADER_KEY = "hf_ropekv"
_FIX = "recalibrate with hf_ropekv.calibrate(model, tokenizer, texts).save(path) for this model"
_EXPECTED_SAFETENSORS = "a safetensors file of hf_ropekv query statistics (written by FrequencyStats.save)"
_IDENTITY_FIELDS = {  # metadata key -> its name in messages
    "model_type": "model type", "num_layers": "layers", "num_q_heads": "query heads", "num_kv_heads": "KV heads",
    "head_dim": "head dim", "rotary_dim": "rotary dim", "rope_type": "rope type", "rotary_layout": "rotary pair layout",
}
_DEFAULTS = {"rotary_layout": ROTATE_HALF}


@dataclass
class FrequencyStats:
    """Per-layer, per-query-head statistics of the pre-RoPE query.

    Attributes:
        q_mean: complex64 ``[L, H_q, F]``, mean of each rotary pair ``q_f`` (L = every decoder layer).
        q_abs_mean: float32 ``[L, H_q, F]``, mean modulus of the same pairs.
        metadata: JSON-able dict: the model's geometry (:func:`geometry_metadata`), ``tokens`` (positions averaged,
            0 when unknown), ``source``, ``format_version`` and, from ``calibrate``, ``weights_fingerprint`` and
            ``weights_source``.
    """

    q_mean: torch.Tensor
    q_abs_mean: torch.Tensor
    metadata: dict

    def __post_init__(self) -> None:
        if self.q_mean.ndim != 3 or self.q_mean.shape != self.q_abs_mean.shape:
            raise ValueError("FrequencyStats needs q_mean and q_abs_mean of the same shape [layers, q_heads, "
                             f"rotary_dim/2]; got {tuple(self.q_mean.shape)} and {tuple(self.q_abs_mean.shape)}.")
        if not self.q_mean.is_complex():
            raise TypeError(f"FrequencyStats.q_mean must be complex (complex64), got {self.q_mean.dtype}.")
        self.q_mean = self.q_mean.to(torch.complex64)
        self.q_abs_mean = self.q_abs_mean.to(torch.float32)

    def for_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_mean [H_q, F] complex64, q_abs_mean [H_q, F] float32)`` of one decoder layer."""
        if not 0 <= layer_idx < self.q_mean.shape[0]:
            raise IndexError(f"Layer {layer_idx} is out of range: the statistics cover {self.q_mean.shape[0]} layers.")
        return self.q_mean[layer_idx], self.q_abs_mean[layer_idx]

    @property
    def tokens(self) -> int:
        return int(self.metadata.get("tokens", 0))

    def __repr__(self) -> str:
        layers, heads, pairs = self.q_mean.shape
        return (f"FrequencyStats(model_type={self.metadata.get('model_type')!r}, layers={layers}, q_heads={heads}, "
                f"pairs={pairs}, tokens={self.tokens}, source={self.metadata.get('source')!r})")

    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file (float32 real / imaginary / modulus tensors, metadata as header JSON)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"q_mean_real": self.q_mean.real.contiguous().cpu(),
                   "q_mean_imag": self.q_mean.imag.contiguous().cpu(), "q_abs_mean": self.q_abs_mean.contiguous().cpu()}
        metadata = {**self.metadata, "format_version": FORMAT_VERSION}
        save_file(tensors, str(path), metadata={_HEADER_KEY: json.dumps(_jsonable(metadata))})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FrequencyStats":
        """Read a file written by :meth:`save`; ``FileNotFoundError`` without one, ``ValueError`` naming the file
        when it is not hf_ropekv statistics."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"No statistics file at {path}; make one with hf_ropekv.calibrate(model, tokenizer, texts).save(path).")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                header = f.metadata() or {}
                tensors = {name: f.get_tensor(name).clone() for name in f.keys()}  # not a map of the file
        except Exception as err:  # safetensors raises its own error types for corrupt or foreign files
            raise ValueError(f"{path} could not be read as {_EXPECTED_SAFETENSORS} ({err}); {_FIX}.") from None
        if _HEADER_KEY not in header:
            raise ValueError(f"{path} is a safetensors file but holds no hf_ropekv statistics (no '{_HEADER_KEY}' "
                             f"header); expected {_EXPECTED_SAFETENSORS}: {_FIX}.")
        try:
            metadata = json.loads(header[_HEADER_KEY])
        except ValueError:
            metadata = None
        if not isinstance(metadata, dict):
            raise ValueError(f"{path} has a damaged '{_HEADER_KEY}' header (not a JSON object): {_FIX}.")
        version = int(metadata.get("format_version", 0))
        if version > FORMAT_VERSION:
            raise ValueError(f"{path} has statistics format {version}, newer than this hf_ropekv understands "
                             f"({FORMAT_VERSION}); upgrade hf_ropekv.")
        missing = {"q_mean_real", "q_mean_imag", "q_abs_mean"} - tensors.keys()
        if missing:
            raise ValueError(f"{path} lacks the tensors {sorted(missing)}; {_FIX}.")
        q_mean = torch.complex(tensors["q_mean_real"].float(), tensors["q_mean_imag"].float())
        return cls(q_mean=q_mean, q_abs_mean=tensors["q_abs_mean"].float(), metadata=metadata)

    @classmethod
    def resolve(cls, stats_or_path: "FrequencyStats | str | os.PathLike", geometry: ModelGeometry,
                model: nn.Module | None = None) -> "FrequencyStats":
        """Statistics from an object or a file, checked against the model's geometry and, given ``model``, its
        weights' fingerprint (a warning)."""
        is_path = isinstance(stats_or_path, (str, os.PathLike))
        if not is_path and not isinstance(stats_or_path, FrequencyStats):
            raise TypeError(
                f"stats must be a FrequencyStats or the path of a statistics file, got {type(stats_or_path).__name__}.")
        stats = cls.load(stats_or_path) if is_path else stats_or_path
        stats.check_compatible(geometry)
        if model is not None:
            warn_if_other_weights(stats.metadata, model, str(stats_or_path) if is_path else None)
        return stats

    def check_compatible(self, geometry: ModelGeometry) -> None:
        """Raise ``ValueError`` naming every difference between these statistics and the model."""
        meta = self.metadata
        problems: list[str] = []

        def differ(name: str, ours: Any, model: Any) -> None:
            problems.append(f"{name}: statistics have {ours!r}, the model has {model!r}")

        geometry.require_rotary_layout()
        for key, label in _IDENTITY_FIELDS.items():
            model_value = getattr(geometry, key)
            ours = meta.get(key, _DEFAULTS.get(key))
            if ours != model_value:
                differ(label, ours, model_value)
        expected_shape = (geometry.num_layers, geometry.num_q_heads, geometry.rotary_dim // 2)
        if tuple(self.q_mean.shape) != expected_shape:
            differ("tensor shape [layers, q_heads, rotary_dim/2]", tuple(self.q_mean.shape), expected_shape)
        if not _same_number(meta.get("rope_theta"), geometry.rope_theta):
            differ("rope theta", meta.get("rope_theta"), geometry.rope_theta)
        ours_scaling = _rope_scaling(meta.get("rope_parameters") or {})
        model_scaling = _rope_scaling(geometry.rope_parameters)
        if not _same_params(ours_scaling, model_scaling):
            differ("rope scaling", ours_scaling, model_scaling)
        inv_freq, model_freq = torch.tensor(meta.get("inv_freq") or [], dtype=torch.float32), geometry.inv_freq
        if inv_freq.shape != model_freq.shape or not torch.allclose(inv_freq, model_freq, rtol=1e-5, atol=0):
            problems.append("inv_freq (RoPE frequencies): the statistics were taken with other rotary frequencies")
        if problems:
            source = meta.get("source", "unknown source")
            raise ValueError(
                f"These query statistics ({source}) do not fit this model ('{geometry.model_type}'):\n  - "
                + "\n  - ".join(problems)
                + f"\nStatistics belong to one model: {_FIX}.")


class FrequencyAccumulator:
    """Running float64 sums of pre-RoPE query parts per layer and query head, kept on the queries' device so that
    adding never synchronises a GPU."""

    def __init__(self, geometry: ModelGeometry) -> None:
        self.geometry = geometry
        self.layout = geometry.require_rotary_layout()
        self._pairs = geometry.rotary_dim // 2
        self._heads: int | None = None  # query heads the tensors show (fewer than the model's under TP)
        # Per layer: float64 [3, H_q, F] sums and an int64 count.
        self._sums: list[torch.Tensor | None] = [None] * geometry.num_layers
        self._counts: list[torch.Tensor | None] = [None] * geometry.num_layers

    def add(self, layer_idx: int, queries: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add pre-RoPE queries ``[B, S, H_q, D]`` of one layer; ``mask`` (bool ``[B, S]``) is False at padding."""
        g = self.geometry
        if not 0 <= layer_idx < g.num_layers:
            raise IndexError(f"layer_idx {layer_idx} is out of range for a model of {g.num_layers} layers.")
        # Under tensor parallelism a rank sees a share of the heads: any divisor of the model's count, always the same.
        heads = queries.shape[2] if queries.ndim == 4 else -1
        if heads < 1 or g.num_q_heads % heads or queries.shape[3] < g.rotary_dim or self._heads not in (None, heads):
            raise ValueError(f"Expected pre-RoPE queries [batch, seq, {self._heads or g.num_q_heads} heads (or a "
                             f"tensor-parallel share of them), >= {g.rotary_dim} dims], got {tuple(queries.shape)}.")
        self._heads = heads
        device = queries.device if queries.device.type != "mps" else torch.device("cpu")  # no float64 on MPS
        parts = query_parts(queries.to(device), self.layout, self._pairs)  # [B, S, 3, H, F]
        if mask is not None:
            if mask.shape != queries.shape[:2]:
                raise ValueError(f"mask must be [batch, seq] = {tuple(queries.shape[:2])}, got {tuple(mask.shape)}.")
            mask = mask.to(device=device, dtype=torch.bool)
            parts, count = masked_parts(parts, mask), mask.sum(dtype=torch.int64)
        else:
            count = torch.tensor(queries.shape[0] * queries.shape[1], dtype=torch.int64, device=device)
        sums = parts.sum(dim=(0, 1), dtype=torch.float64)
        if self._sums[layer_idx] is None:
            self._sums[layer_idx], self._counts[layer_idx] = sums, count
        else:
            self._sums[layer_idx] += sums.to(self._sums[layer_idx].device)
            self._counts[layer_idx] += count.to(self._counts[layer_idx].device)

    @property
    def tokens(self) -> int:
        """Positions counted in every layer (the smallest per-layer count; 0 until every layer saw some)."""
        if any(c is None for c in self._counts):
            return 0
        return min(int(c) for c in self._counts)

    def to_stats(self, source: str) -> FrequencyStats:
        """The means so far, as float32 / complex64 CPU :class:`FrequencyStats`."""
        counts = [0 if c is None else int(c) for c in self._counts]
        empty = [i for i, n in enumerate(counts) if n == 0]
        if empty:
            raise ValueError(f"No queries were recorded for layers {empty}: run the model forward over some text with "
                             "QueryCapture attached (hf_ropekv.calibrate does this) before building statistics.")
        if len(set(counts)) > 1:
            warn(f"Layers saw different numbers of query positions ({min(counts)} to {max(counts)}): a forward stopped "
                 "part way through calibration? The statistics use each layer's own count.")
        sums = torch.stack([s.cpu() for s in self._sums])  # [L, 3, H, F] float64
        q_mean, q_abs_mean = complex_means(sums, torch.tensor(counts, dtype=torch.float64))
        metadata = {**geometry_metadata(self.geometry), "tokens": min(counts), "source": source,
                    "format_version": FORMAT_VERSION}
        return FrequencyStats(q_mean=q_mean, q_abs_mean=q_abs_mean, metadata=metadata)


def geometry_metadata(geometry: ModelGeometry) -> dict[str, Any]:
    """The part of the statistics metadata that identifies the model (compared by ``check_compatible``)."""
    names = ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "rotary_dim", "rope_type",
             "rope_theta")
    return {**{name: getattr(geometry, name) for name in names}, "rope_parameters": _jsonable(geometry.rope_parameters),
            "inv_freq": [float(x) for x in geometry.inv_freq.tolist()], "rotary_layout": geometry.rotary_layout}


def _rope_scaling(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}


def _same_number(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=1e-6)


def _same_params(a: dict, b: dict) -> bool:
    def same(x: Any, y: Any) -> bool:
        numbers = isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool)
        return _same_number(x, y) if numbers else x == y

    return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)


def _jsonable(value: Any) -> Any:
    """Plain JSON types (tensors become lists, dtypes and other objects strings)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return str(value)  # other objects, and non-finite floats (not JSON)
