"""The query statistics' arithmetic, shared by calibration and online statistics: a query's parts (real and
imaginary part and modulus of each rotary pair ``q_f``), summed in float64, and means from those sums."""

from __future__ import annotations

import torch

from ..model.layouts import split_pairs


def query_parts(queries: torch.Tensor, layout: str, pairs: int) -> torch.Tensor:
    """``queries [..., H, D]`` -> float32 ``[..., 3, H, F]``: real parts, imaginary parts and moduli of the pairs."""
    q = queries.detach()[..., : 2 * pairs].float()
    real, imag = split_pairs(q, layout, pairs)
    return torch.stack((real, imag, torch.hypot(real, imag)), dim=-3)


def masked_parts(parts: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``parts [B, S, 3, H, F]`` with the positions where ``mask [B, S]`` is False zeroed (padding may be NaN)."""
    return parts if mask is None else torch.where(mask[:, :, None, None, None], parts, 0.0)


def complex_means(sums: torch.Tensor, counts: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``sums [..., 3, H, F]`` over ``counts`` -> ``(q_mean complex64, q_abs_mean float32)`` ``[..., H, F]``."""
    if isinstance(counts, torch.Tensor):
        counts = counts.clamp_min(1e-12).view(*counts.shape, *(1,) * (sums.dim() - counts.dim()))
    means = sums / counts
    return torch.complex(means[..., 0, :, :].float(), means[..., 1, :, :].float()), means[..., 2, :, :].float()
