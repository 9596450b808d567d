"""How a model pairs head dimensions into the complex numbers RoPE rotates: pair ``f`` (``F = rotary_dim / 2``) is
``x[real(f)] + i x[imag(f)]`` with ``"rotate_half"`` (Llama, Qwen, Mistral, ...): ``real = f``, ``imag = f + F``, or
``"interleaved"`` (GPT-J, CodeGen, Cohere, GLM, ...): ``real = 2f``, ``imag = 2f + 1``. Dims ``>= rotary_dim`` are
never scored."""

from __future__ import annotations

import torch

ROTATE_HALF = "rotate_half"
INTERLEAVED = "interleaved"
LAYOUTS = (ROTATE_HALF, INTERLEAVED)


def pair_strides(layout: str, pairs: int) -> tuple[int, int]:
    """``(pair_stride, imag_offset)``: pair ``f`` is dims ``f * pair_stride`` and ``f * pair_stride + imag_offset``."""
    if layout not in LAYOUTS:
        raise ValueError(f"rotary layout must be one of {LAYOUTS}, got {layout!r}.")
    return (1, pairs) if layout == ROTATE_HALF else (2, 1)


def split_pairs(x: torch.Tensor, layout: str, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real, imag)`` parts ``[..., F]`` of the rotary pairs of ``x [..., D]`` (views, no copy)."""
    stride, offset = pair_strides(layout, pairs)
    return x[..., 0 : stride * pairs : stride], x[..., offset : offset + stride * pairs : stride]


def pair_partner(layout: str, pairs: int, dim: int) -> torch.Tensor:
    """int64 ``[dim]``: the other channel of each channel's rotary pair (a channel RoPE leaves alone is its own)."""
    stride, offset = pair_strides(layout, pairs)
    real = torch.arange(pairs) * stride
    partner = torch.arange(dim)
    partner[real], partner[real + offset] = real + offset, real
    return partner
