"""Symmetric per-token-and-head quantization of KV storage, for ``decode_attention``'s int8 / fp8 path.

For ``x`` [B, H, S, D] every (row, head, token) vector gets one float32 scale::

    scale[b, h, s] = max_d |x[b, h, s, d]| / QMAX        (QMAX = 127 for int8, 448 for float8_e4m3fn)
    q[b, h, s, d]  = round(x[b, h, s, d] / scale[b, h, s])
    x ~ q * scale

int8 rounds half to even (``torch.round``), so ``|x - q * scale| <= scale / 2``; float8_e4m3fn keeps
3 mantissa bits (relative error <= 2**-4). Scales are clamped at ``1e-12``: an all-zero vector
quantizes to zeros instead of dividing by zero. Plain PyTorch: these run once per written token.
"""
from __future__ import annotations

import torch

__all__ = ["QUANT_DTYPES", "dequantize_kv", "quantize_kv"]

#: Storage dtypes ``decode_attention`` reads with per-token scales, and the largest magnitude of each.
QUANT_DTYPES = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    QUANT_DTYPES[torch.float8_e4m3fn] = 448.0

_MIN_SCALE = 1e-12


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [B, H, S, D] (fp16/bf16/fp32) to ``dtype`` with one scale per (row, head, token).

    Returns ``(q [B, H, S, D] of dtype, scale float32 [B, H, S])`` with ``x ~ q * scale[..., None]``.
    """
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"dtype must be one of {list(QUANT_DTYPES)}, got {dtype}")
    if not x.is_floating_point() or x.dim() != 4:
        raise ValueError(f"x must be a floating [B, H, S, D] tensor, got {x.dtype} of shape {tuple(x.shape)}")
    qmax = QUANT_DTYPES[dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / qmax).clamp_min(_MIN_SCALE)
    y = xf / scale[..., None]
    if dtype == torch.int8:
        q = torch.round(y).clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(dtype)  # the cast rounds to nearest even
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale[..., None]`` computed in float32, returned as ``dtype``."""
    return (q.float() * scale[..., None].float()).to(dtype)
