"""In-place, order-preserving compaction of KV storage (docs/how-it-works.md, "Storage"), and its PyTorch twin.

For every tensor ``t`` [B, H, C, D], ``keep`` [B, H, K] and an optional first destination ``start`` [B] (0)::

    t[b, h, j, :] = t_old[b, h, keep[b, h, j], :]    for start[b] <= j < K

``keep[b, h, start[b]:]`` is strictly ascending; entries before ``start[b]`` are ignored, and those slots, like
slots ``>= K``, are left as they were (the cache masks them: a row's "holes"). No full-size temporary is made.

Why in place is race-free: ``keep`` strictly ascending means ``keep[j] - j`` never decreases along ``j``, so the
right movers (only rows with ``start > 0``) form a prefix of ``[start, K)`` and the left movers a suffix, and neither
touches the other's sources or destinations. Left movers are walked in ascending blocks (a block's destinations lie
below every later block's sources), right movers in descending blocks; a barrier separates a block's loads from its
stores (a program's threads run out of step).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch

from ._triton import HAS_TRITON, check_device, tl, triton

__all__ = ["compact_", "compact_triton_", "compact_reference_", "check_compact_args"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)  # int8: quantized codes


def check_compact_args(tensors: Sequence[torch.Tensor], keep: torch.Tensor, start: Optional[torch.Tensor] = None, *,
                       validate_keep: bool = False) -> None:
    """Raise ``ValueError`` unless ``tensors``, ``keep`` and ``start`` fit ``compact_``'s contract; with
    ``validate_keep=True`` also that ``keep`` is in range and strictly ascending from ``start`` on (a device sync)."""
    if keep.dim() != 3:
        raise ValueError(f"keep must be [B, H, K], got shape {tuple(keep.shape)}")
    if keep.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"keep must be int32 or int64, got {keep.dtype}")
    if len(tensors) == 0:
        raise ValueError("compact_ needs at least one tensor")
    ptrs = set()
    for t in tensors:
        if t.dim() != 4:
            raise ValueError(f"storage tensors must be [B, H, C, D], got shape {tuple(t.shape)}")
        if tuple(t.shape[:2]) != tuple(keep.shape[:2]):
            raise ValueError(f"storage [B, H] = {tuple(t.shape[:2])} does not match keep {tuple(keep.shape[:2])}")
        if keep.shape[2] > t.shape[2]:
            raise ValueError(f"keep holds {keep.shape[2]} slots but the storage has only {t.shape[2]}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"storage dtype must be float16, bfloat16, float32 or int8, got {t.dtype}")
        if t.device != keep.device:
            raise ValueError(f"storage ({t.device}) and keep ({keep.device}) must be on one device")
        if t.numel() and t.data_ptr() in ptrs:
            raise ValueError("the same storage is passed twice: it would be compacted twice")
        ptrs.add(t.data_ptr())
    if start is not None:
        if start.dim() != 1 or start.shape[0] != keep.shape[0]:
            raise ValueError(f"start must be [B] = [{keep.shape[0]}], got shape {tuple(start.shape)}")
        if start.dtype not in (torch.int32, torch.int64) or start.device != keep.device:
            raise ValueError(
                f"start must be an int32/int64 tensor on {keep.device}, got {start.dtype} on {start.device}")
    if validate_keep and keep.numel():
        used = _used_entries(keep, start)
        if bool(((keep < 0) & used).any()) or bool(((keep >= tensors[0].shape[2]) & used).any()):
            raise ValueError("keep holds slot indices outside [0, C)")
        if keep.shape[2] > 1 and not bool(((keep[..., 1:] > keep[..., :-1]) | ~used[..., :-1]).all()):
            raise ValueError("keep must be strictly ascending along its last dimension (from start on)")
        if start is not None and bool(((start < 0) | (start > keep.shape[2])).any()):
            raise ValueError("start must lie in [0, K]")


def _used_entries(keep: torch.Tensor, start: Optional[torch.Tensor]) -> torch.Tensor:
    """bool [B, H, K]: the entries of ``keep`` that name a source (``j >= start[b]``)."""
    j = torch.arange(keep.shape[2], device=keep.device)
    if start is None:
        return torch.ones(keep.shape, dtype=torch.bool, device=keep.device)
    return (j[None, :] >= start[:, None])[:, None, :].expand(keep.shape)


# --------------------------------------------------------------------------- Triton

if HAS_TRITON:

    @triton.jit
    def _compact_kernel(
        ptrs_ptr, like_ptr, keep_ptr, start_ptr, H, K, D,
        stride_b, stride_h, stride_c, stride_kb, stride_kh, stride_kk,
        HAS_START: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr,
    ):
        # One program owns one (row, head) of one tensor, or a column slice of it.
        pid_bh = tl.program_id(0)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        # The tensors of a launch share shape, strides and dtype; their base addresses come from a table, typed
        # like ``like_ptr``. A loaded pointer has no known alignment: the hint (checked by the launcher) keeps the
        # accesses 16 bytes wide.
        base = tl.multiple_of(tl.load(ptrs_ptr + tl.program_id(1)).to(like_ptr.dtype), ALIGN)
        base = base + b * stride_b + h * stride_h
        keep_row = keep_ptr + b * stride_kb + h * stride_kh
        offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        first = 0
        if HAS_START:
            first = tl.load(start_ptr + b).to(tl.int32)

        # Left movers (and the untouched prefix, which moves no bytes), ascending.
        for j0 in range(0, K, BLOCK_K):
            j = j0 + tl.arange(0, BLOCK_K)
            valid = (j < K) & (j >= first)
            src = tl.load(keep_row + j * stride_kk, mask=valid, other=0).to(tl.int64)
            m = (valid & (src > j))[:, None] & mask_d[None, :]
            vals = tl.load(base + src[:, None] * stride_c + offs_d[None, :], mask=m)
            tl.debug_barrier()  # every thread's loads of this block before any store
            tl.store(base + j.to(tl.int64)[:, None] * stride_c + offs_d[None, :], vals, mask=m)
        if HAS_START:
            # Right movers (only rows whose survivors sit behind holes), descending.
            tl.debug_barrier()
            n_blocks = tl.cdiv(K, BLOCK_K)
            for i in range(0, n_blocks):
                j = (n_blocks - 1 - i) * BLOCK_K + tl.arange(0, BLOCK_K)
                valid = (j < K) & (j >= first)
                src = tl.load(keep_row + j * stride_kk, mask=valid, other=0).to(tl.int64)
                m = (valid & (src < j))[:, None] & mask_d[None, :]
                vals = tl.load(base + src[:, None] * stride_c + offs_d[None, :], mask=m)
                tl.debug_barrier()
                tl.store(base + j.to(tl.int64)[:, None] * stride_c + offs_d[None, :], vals, mask=m)


@functools.lru_cache(maxsize=1024)
def _pointer_table(ptrs: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Device int64 tensor of base addresses, cached by content (the same storages are compacted every round: no
    host-to-device copy per call, a CUDA-graph capturable launch; keyed by the addresses, never stale). A cache
    compacts layer by layer, one table per layer and plane dtype (two with int8): room for every layer of the
    largest models, or each round would miss them all."""
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def compact_triton_(tensors: Sequence[torch.Tensor], keep: torch.Tensor, start: Optional[torch.Tensor] = None, *,
                    block_k: int = 64, num_warps: int = 4) -> None:
    """Compact ``tensors`` (unit last stride) in place with the Triton kernel (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); tensors of one dtype, shape and strides go in one launch. The untouched prefix
    (``keep[j] == j``) costs nothing."""
    check_compact_args(tensors, keep, start)
    check_device("compact_triton_", keep)
    for t in tensors:
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"compact_triton_ needs storage with unit last stride, got strides {t.stride()}")
    B, H, K = keep.shape
    if K == 0 or B * H == 0:
        return

    groups: dict = {}
    for t in tensors:
        if t.shape[-1] == 0:
            continue
        groups.setdefault((t.dtype, tuple(t.shape), t.stride()), []).append(t)
    for (dtype, shape, strides), ts in groups.items():
        D = shape[3]
        ptrs = _pointer_table(tuple(t.data_ptr() for t in ts), keep.device)
        # Split the head dim only when (row, head, tensor) programs alone would leave most SMs idle.
        block_d = triton.next_power_of_2(D)
        while block_d > 32 and B * H * len(ts) * triton.cdiv(D, block_d) < 1024:
            block_d //= 2
        grid = (B * H, len(ts), triton.cdiv(D, block_d))
        _compact_kernel[grid](
            ptrs, ts[0], keep, keep if start is None else start, H, K, D,
            strides[0], strides[1], strides[2], keep.stride(0), keep.stride(1), keep.stride(2),
            HAS_START=start is not None, BLOCK_K=block_k, BLOCK_D=block_d,
            ALIGN=16 if all(t.data_ptr() % 16 == 0 for t in ts) else 1, num_warps=num_warps)


# --------------------------------------------------------------------------- PyTorch twin


def compact_reference_(tensors: Sequence[torch.Tensor], keep: torch.Tensor, start: Optional[torch.Tensor] = None, *,
                       chunk: int = 256) -> None:
    """Pure-PyTorch twin of :func:`compact_triton_`, also in place: ascending chunks of ``chunk`` slots gathered
    into a small temporary, then written (a chunk's destinations lie below every later chunk's sources); with
    ``start``, each row's used entries gathered whole."""
    check_compact_args(tensors, keep, start)
    B, H, K = keep.shape
    if start is not None:
        used = _used_entries(keep, start)
        index = torch.where(used, keep.long(), torch.arange(K, device=keep.device).expand(B, H, K))
        for t in tensors:
            src = torch.gather(t, 2, index.unsqueeze(-1).expand(-1, -1, -1, t.shape[3]))
            t[:, :, :K] = src  # unused entries gathered their own slot: unchanged
        return
    idx_all = keep.long()
    # Same result either way: advanced indexing is ~2x faster than gather on CPU, gather ~2x faster on CUDA.
    rows = torch.arange(B, device=keep.device)[:, None, None]
    heads = torch.arange(H, device=keep.device)[None, :, None]
    for t in tensors:
        for j0 in range(0, K, chunk):
            idx = idx_all[:, :, j0:j0 + chunk]
            if t.is_cuda:
                src = torch.gather(t, 2, idx.unsqueeze(-1).expand(-1, -1, -1, t.shape[3]))
            else:
                src = t[rows, heads, idx]
            t[:, :, j0:j0 + idx.shape[2]] = src


def compact_(tensors: Sequence[torch.Tensor], keep: torch.Tensor, start: Optional[torch.Tensor] = None, *,
             backend: Optional[str] = None, validate_keep: bool = False) -> None:
    """Compact every storage tensor in place: ``t[b, h, j] = t_old[b, h, keep[b, h, j]]`` for ``start[b] <= j < K``.

    ``tensors``: [B, H, C, D] storages (fp16/bf16/fp32/int8, unit last stride for Triton); ``keep``: int32/int64
    [B, H, K], strictly ascending per (b, h) from ``start[b]`` on, values < C; ``start``: int [B] (``None``: 0).
    ``backend``: ``"triton"``, ``"torch"`` or ``None`` (Triton on CUDA when installed, PyTorch elsewhere).
    ``validate_keep`` checks ordering and range first (a device sync).
    """
    if validate_keep:
        check_compact_args(tensors, keep, start, validate_keep=True)
    if backend is None:
        backend = "triton" if HAS_TRITON and keep.is_cuda else "torch"
    if backend == "triton":
        compact_triton_(tensors, keep, start)
    elif backend == "torch":
        compact_reference_(tensors, keep, start)
    else:
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
