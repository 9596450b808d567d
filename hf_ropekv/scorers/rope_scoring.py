"""The RoPE (TriAttention) key score, the one place its math is written:

    q_eff[h, f] = q_mean[h, f] * mean_{d in offsets} exp(i * omega_f * (t + d))
    score       = Re sum_f q_eff[h, f] * conj(k_f)  +  sum_f max(A[h, f] - |q_mean[h, f]|, 0) * |k_f|

with ``k_f`` the key's rotary pair ``f`` (model layout) and statistics shared by all rows (``[H_q, F]``) or per row
(``[B, H_q, F]``). :func:`query_weights` folds the offsets into one weight vector per (row, query head);
:func:`score_keys_weighted` streams the keys (Triton on CUDA).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ..kernels.score import HAS_TRITON, score_keys_reference, score_keys_triton
from ..model.layouts import ROTATE_HALF, pair_strides

__all__ = ["DEFAULT_OFFSETS", "query_weights", "score_keys", "score_keys_weighted"]

#: Future-query offsets averaged over: 1, 2, 4, ..., 65536 (17 offsets).
DEFAULT_OFFSETS: Tuple[int, ...] = tuple(2**i for i in range(17))

Position = Union[int, torch.Tensor]


def _check_stats(q_mean: torch.Tensor, q_abs_mean: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if not torch.is_tensor(q_mean) or not q_mean.is_complex():
        raise ValueError(
            f"q_mean must be a complex tensor [H_q, F] or [B, H_q, F], got {getattr(q_mean, 'dtype', type(q_mean))}")
    if q_mean.dim() not in (2, 3) or q_mean.shape[-1] == 0:
        raise ValueError("q_mean must be [H_q, F] (shared by all rows) or [B, H_q, F] (one set per row) with F > 0, "
                         f"got shape {tuple(q_mean.shape)}")
    if q_abs_mean.is_complex() or not q_abs_mean.is_floating_point():
        raise ValueError(f"q_abs_mean must be a real floating tensor, got {q_abs_mean.dtype}")
    if q_abs_mean.shape != q_mean.shape:
        raise ValueError(f"q_abs_mean shape {tuple(q_abs_mean.shape)} must equal q_mean shape {tuple(q_mean.shape)}")
    if inv_freq.dim() != 1 or inv_freq.shape[0] != q_mean.shape[-1]:
        raise ValueError(
            f"inv_freq must be [F] = [{q_mean.shape[-1]}] (one frequency per rotary pair), got {tuple(inv_freq.shape)}")


def _positions(position: Position, device: torch.device) -> torch.Tensor:
    """Absolute next-query positions as float64 [B] (exact for integers below 2**53)."""
    if isinstance(position, int) and not isinstance(position, bool):
        return torch.tensor([position], dtype=torch.float64, device=device)
    if torch.is_tensor(position):
        if position.is_floating_point() or position.is_complex() or position.dtype == torch.bool:
            raise ValueError(f"position tensor must hold integers, got {position.dtype}")
        if position.dim() > 1:
            raise ValueError(f"position must be an int or a tensor [B], got shape {tuple(position.shape)}")
        return position.reshape(-1).to(device=device, dtype=torch.float64)
    raise ValueError(f"position must be an int or an integer tensor [B], got {type(position).__name__}")


def query_weights(q_mean: torch.Tensor, q_abs_mean: torch.Tensor, inv_freq: torch.Tensor, position: Position,
                  offsets: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The statistics folded into per-head scoring weights.

    ``q_mean`` complex ``[H_q, F]`` or ``[B, H_q, F]``, ``q_abs_mean`` (``A``) real of the same shape, ``inv_freq``
    ``[F]``, ``position`` the next query's position ``t`` (an int or an integer tensor ``[B]``), ``offsets`` (default
    :data:`DEFAULT_OFFSETS`). Returns ``(w, c)`` on ``q_mean``'s device: ``w`` float32 ``[B', H_q, 2F] = [Re q_eff,
    Im q_eff]`` (``B'``: positions or statistics rows) and ``c`` float32 ``[1 or B, H_q, F] = clamp(A - |q_mean|, 0)``.
    """
    _check_stats(q_mean, q_abs_mean, inv_freq)
    if q_mean.dim() == 2:
        q_mean, q_abs_mean = q_mean.unsqueeze(0), q_abs_mean.unsqueeze(0)
    offs = DEFAULT_OFFSETS if offsets is None else tuple(offsets)
    if len(offs) == 0:
        raise ValueError("offsets must not be empty")
    # float64 phases (float32 is off by ~0.1 rad at t = 1e6), built on the CPU for MPS, which has no float64.
    dev = q_mean.device if q_mean.device.type != "mps" else torch.device("cpu")
    t = _positions(position, dev)
    if t.shape[0] not in (1, q_mean.shape[0]) and q_mean.shape[0] != 1:
        raise ValueError(
            f"position has {t.shape[0]} entries but the statistics have {q_mean.shape[0]} rows; give one per batch row")
    delta = torch.tensor(offs, dtype=torch.float64, device=dev)
    omega = inv_freq.to(device=dev, dtype=torch.float64)
    phase = omega[None, None, :] * (t[:, None, None] + delta[None, :, None])  # [B, n_offsets, F]
    rot = torch.polar(torch.ones_like(phase), phase).mean(dim=1)  # complex128 [B, F]
    q_eff = q_mean.to(device=dev, dtype=torch.complex128) * rot[:, None, :]  # [B', H_q, F]
    w = torch.cat([q_eff.real, q_eff.imag], dim=-1).to(device=q_mean.device, dtype=torch.float32)
    c = (q_abs_mean.double() - q_mean.to(torch.complex128).abs()).clamp_min(0).float()
    return w, c


def score_keys_weighted(keys: torch.Tensor, w: torch.Tensor, c: torch.Tensor, *, backend: Optional[str] = None,
                        out: Optional[torch.Tensor] = None, layout: str = ROTATE_HALF) -> torch.Tensor:
    """float32 ``[B, H_q, S]`` scores of ``keys [B, H_kv, S, D]`` (any strides, fp16/bf16/fp32) from weights ``w
    [B or 1, H_q, 2F]`` and ``c [B or 1, H_q, F]``. ``backend``: ``"triton"``, ``"torch"`` or ``None`` (Triton on
    CUDA when installed)."""
    pair_stride, imag_offset = pair_strides(layout, w.shape[-1] // 2)
    if backend is None:
        backend = "triton" if HAS_TRITON and keys.is_cuda else "torch"
    if backend == "triton":
        return score_keys_triton(keys, w, c, out=out, pair_stride=pair_stride, imag_offset=imag_offset)
    if backend == "torch":
        return score_keys_reference(keys, w, c, out=out, pair_stride=pair_stride, imag_offset=imag_offset)
    raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")


def score_keys(keys: torch.Tensor, q_mean: torch.Tensor, q_abs_mean: torch.Tensor, inv_freq: torch.Tensor,
               position: Position, offsets: Optional[Sequence[int]] = None, *, backend: Optional[str] = None,
               layout: str = ROTATE_HALF) -> torch.Tensor:
    """Raw scores (float32 ``[B, H_q, S]``) of post-RoPE keys ``[B, H_kv, S, D]``: :func:`query_weights`, checked,
    then :func:`score_keys_weighted` (query head ``h`` reads KV head ``h // (H_q // H_kv)``)."""
    if not torch.is_tensor(keys) or keys.dim() != 4:
        raise ValueError(f"keys must be a 4-D tensor [B, H_kv, S, D], got {getattr(keys, 'shape', type(keys))}")
    _check_stats(q_mean, q_abs_mean, inv_freq)
    B = keys.shape[0]
    if torch.is_tensor(position) and position.numel() not in (1, B):
        raise ValueError(f"position tensor has {position.numel()} entries, keys have batch {B}")
    if q_mean.dim() == 3 and q_mean.shape[0] not in (1, B):
        raise ValueError(f"per-row statistics have {q_mean.shape[0]} rows, keys have batch {B}")
    w, c = query_weights(q_mean, q_abs_mean, inv_freq, position, offsets)
    # Head counts, head_dim and dtypes are checked by the kernel launcher's check_score_args.
    return score_keys_weighted(keys, w.to(keys.device), c.to(keys.device), backend=backend, layout=layout)
