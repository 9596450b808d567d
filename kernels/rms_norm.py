"""RMSNorm over the last dimension in one kernel, and its PyTorch twin: transformers' Llama RMSNorm, op for op::

    y = weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype)

An eager RMSNorm launches eight kernels (cast, square, mean, add, rsqrt, multiply, cast, multiply); a decode step of
Qwen3-8B runs 145 norms over 4,096 or 128 numbers each, so they are about half the kernels of a replayed step, each
costing its launch more than its work. One program here normalizes one row in registers, in float32.

It follows the eager norm's roundings (the normalized row rounded to ``x``'s dtype before the weight, the product in
``weight``'s and ``x``'s promoted dtype) but sums the squares in another order, so it agrees with it to the last bit
of the float32 variance, not bit for bit. Never syncs (CUDA-graph capturable).
"""
from __future__ import annotations

import torch

from ._triton import FLOAT_DTYPES, HAS_TRITON, check_device, tl, triton

__all__ = ["MAX_NORM_DIM", "rms_norm", "rms_norm_reference"]

#: The longest row one program holds in registers.
MAX_NORM_DIM = 16384


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``: ``x [..., N]``, ``weight [N]``."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, inv_n, eps, stride_x, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        inside = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, 0) * inv_n  # torch's mean: the sum times 1/N
        normed = (x * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)  # a bf16 * bf16 product is computed in float32, then rounded
        tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rms_norm_reference` in one Triton kernel: ``x [..., N]`` (fp16, bf16 or fp32), ``weight [N]``; the
    result has ``x``'s shape and the dtype ``weight * x`` would have (written into ``out`` when given)."""
    check_device("rms_norm", x)
    n = x.shape[-1]
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and weight must be float16, bfloat16 or float32, got {x.dtype} and {weight.dtype}")
    if tuple(weight.shape) != (n,) or weight.device != x.device:
        raise ValueError(f"weight must be [{n}] on {x.device}, got {tuple(weight.shape)} on {weight.device}")
    if not 0 < n <= MAX_NORM_DIM:
        raise ValueError(f"rows of 1 to {MAX_NORM_DIM} elements are supported, got {n}")
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif tuple(out.shape) != tuple(x.shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(x.shape)}")
    flat = out.view(-1, n)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), flat, n, 1.0 / n, eps, rows.stride(0),
                                           flat.stride(0), BLOCK=block,
                                           num_warps=1 if block <= 256 else 4 if block <= 2048 else 8)
    return out
