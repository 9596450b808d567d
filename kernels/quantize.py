"""Symmetric per-token-and-head quantization of KV storage, for ``decode_attention``'s int8 / fp8 path.

For ``x`` [B, H, S, D] every (row, head, token) vector gets one float32 scale::

    scale[b, h, s] = max_d |x[b, h, s, d]| / QMAX        (QMAX = 127 for int8, 448 for float8_e4m3fn)
    q[b, h, s, d]  = round(x[b, h, s, d] / scale[b, h, s])
    x ~ q * scale

int8 rounds half to even (``|x - q * scale| <= scale / 2``); float8_e4m3fn keeps 3 mantissa bits (relative error
<= 2**-4). Scales are clamped at ``1e-12``, so an all-zero vector quantizes to zeros.

Keys have outlier channels (a key bias, massive activations) that would set every token's scale and leave the other
channels a few levels; the storage quantizes ``x / balance`` instead, with one float32 ``balance [B, H, 1, D]`` per
row and head (``channel_balance``), and reads ``q * scale * balance``.
"""
from __future__ import annotations

import torch

from ._triton import HAS_TRITON, tl, triton

__all__ = ["QUANT_DTYPES", "channel_balance", "dequantize_kv", "quantize_kv"]

#: Storage dtypes ``decode_attention`` reads with per-token scales, and the largest magnitude of each.
QUANT_DTYPES = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    QUANT_DTYPES[torch.float8_e4m3fn] = 448.0

_MIN_SCALE = 1e-12


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.int8,
                balance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [B, H, S, D] (fp16/bf16/fp32; divided by ``balance [B, H, 1, D]`` in float32 when given) to
    ``dtype`` with one scale per (row, head, token).

    Returns ``(q [B, H, S, D] of dtype, scale float32 [B, H, S])`` with ``x ~ q * scale[..., None]`` (times
    ``balance``: :func:`dequantize_kv` with the same ``balance``).
    """
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"dtype must be one of {list(QUANT_DTYPES)}, got {dtype}")
    if not x.is_floating_point() or x.dim() != 4:
        raise ValueError(f"x must be a floating [B, H, S, D] tensor, got {x.dtype} of shape {tuple(x.shape)}")
    qmax = QUANT_DTYPES[dtype]
    xf = x.float() if balance is None else x.float() / balance
    scale = (xf.abs().amax(dim=-1) / qmax).clamp_min(_MIN_SCALE)
    y = xf / scale[..., None]
    if dtype == torch.int8:
        q = torch.round(y).clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(dtype)  # the cast rounds to nearest even
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                  balance: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scale[..., None]`` (times ``balance [B, H, 1, D]`` when given) in ``dtype``."""
    x = q.float() * scale[..., None].float()
    return (x if balance is None else x * balance).to(dtype)


#: A channel's balance is at least this fraction of its head's largest: a channel silent in the prompt that wakes up
#: later cannot blow up a token's scale by more than this.
BALANCE_FLOOR = 1e-3


def channel_balance(x: torch.Tensor, real_from: torch.Tensor | None = None,
                    partner: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[B, H, 1, D]``: each channel's largest ``|x|`` over the tokens of ``x [B, H, S, D]`` from
    ``real_from [B]`` on (a row's left padding left out, so a row's balance is its own), divided by the head's
    largest and floored at ``BALANCE_FLOOR``. ``partner [D]``: the other channel of each rotary pair, which gets the
    same balance (RoPE turns a key's magnitude from one channel of a pair to the other as positions grow); a row
    with no real token gets ones."""
    magnitude = x.float().abs()
    if real_from is not None:
        slot = torch.arange(x.shape[2], device=x.device)
        padding = slot[None, :] < real_from.to(x.device)[:, None]
        magnitude = magnitude.masked_fill(padding[:, None, :, None], 0.0)
    largest = magnitude.amax(dim=2, keepdim=True)
    if partner is not None:
        largest = torch.maximum(largest, largest[..., partner.to(x.device)])
    top = largest.amax(dim=-1, keepdim=True)
    return torch.where(top > 0, (largest / top).clamp_min(BALANCE_FLOOR), torch.ones_like(largest))


# --------------------------------------------------------------------------- writing new tokens into an int8 arena

if HAS_TRITON:

    @triton.jit
    def _quantize_into_kernel(
        x_ptr, codes_ptr, scale_ptr, index_ptr, balance_ptr,
        stride_xb, stride_xh, stride_xs,
        stride_bb, stride_bh,
        stride_cb, stride_ch, stride_cs,
        stride_sb, stride_sh, stride_ss,
        D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BALANCE: tl.constexpr,
    ):
        # One program: one new token of one (row, head); its codes and scale go to arena slot index[token].
        i, h, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + b * stride_xb + h * stride_xh + i * stride_xs + offs, mask=offs < D, other=0.0)
        x = x.to(tl.float32)
        if HAS_BALANCE:
            x = tl.math.div_rn(x, tl.load(balance_ptr + b * stride_bb + h * stride_bh + offs, mask=offs < D, other=1.0))
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12 * 127.0) / 127.0
        y = tl.math.div_rn(x, scale)
        r = tl.floor(y + 0.5)
        r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)  # ties to even, as torch
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        slot = tl.load(index_ptr + i).to(tl.int64)
        tl.store(codes_ptr + b * stride_cb + h * stride_ch + slot * stride_cs + offs, r.to(tl.int8), mask=offs < D)
        tl.store(scale_ptr + b * stride_sb + h * stride_sh + slot * stride_ss, scale)


def quantize_into_(codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, index: torch.Tensor,
                   balance: torch.Tensor | None = None) -> None:
    """Quantize ``x [B, H, q, D]`` (``x / balance`` with a float32 ``balance [B, H, 1, D]``; as :func:`quantize_kv`)
    straight into an arena: ``codes [B, H, C, D]`` int8 and ``scale [B, H, C]`` (or ``[B, H, C, 1]``) float32 at
    slots ``index [q]``. One launch on CUDA (a recorded decoding step would otherwise run a dozen small kernels per
    layer), :func:`quantize_into_reference_` elsewhere."""
    scale = scale.view(scale.shape[:3])
    contiguous = balance is None or balance.stride(-1) == 1
    if not (HAS_TRITON and x.is_cuda and x.stride(-1) == 1 and codes.stride(-1) == 1 and contiguous):
        quantize_into_reference_(codes, scale, x, index, balance)
        return
    B, H, q, D = x.shape
    _quantize_into_kernel[(q, H, B)](
        x, codes, scale, index, x if balance is None else balance,
        x.stride(0), x.stride(1), x.stride(2),
        *((0, 0) if balance is None else (balance.stride(0), balance.stride(1))),
        codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        D=D, BLOCK_D=triton.next_power_of_2(D), HAS_BALANCE=balance is not None, num_warps=1)


def quantize_into_reference_(codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, index: torch.Tensor,
                             balance: torch.Tensor | None = None) -> None:
    """Plain-PyTorch twin of :func:`quantize_into_`."""
    new_codes, new_scale = quantize_kv(x, balance=balance)
    codes.index_copy_(2, index, new_codes)
    scale.view(scale.shape[:3]).index_copy_(2, index, new_scale)
