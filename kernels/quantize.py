"""Symmetric int8 quantization of keys and values, one scale per token and head (plain PyTorch: it runs once per
written token, and a Triton kernel would not pay for its launch)."""

from __future__ import annotations

import torch

__all__ = ["dequantize_kv", "quantize_kv"]

#: The smallest scale: a token-head of zeros quantizes to codes 0 with a finite scale.
MIN_SCALE = 1e-12


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H, S, D]`` -> ``(codes int8 [B, H, S, D], scale float32 [B, H, S])`` with ``x ~ codes * scale``:
    ``scale = absmax / 127`` over each token's head dims, codes rounded half to even (error <= scale / 2)."""
    scale = x.detach().abs().amax(dim=-1).float().clamp_min(MIN_SCALE) / 127.0
    codes = torch.round(x.float() / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes [B, H, S, D] * scale [B, H, S]`` in ``dtype`` (a new tensor)."""
    return (codes.float() * scale[..., None]).to(dtype)
