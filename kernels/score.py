"""Key scoring kernel (TriAttention, DESIGN.md §2) and its PyTorch twin.

Both functions compute, for every query head ``h`` and cached slot ``s``::

    score[b, h, s] = k[:2F] . w[b, h] + sum_f c[h, f] * sqrt(k[f]^2 + k[f+F]^2)

with ``k = keys[b, h // G, s]`` (``G = H_q / H_kv``, the GQA group size),
``w = [Re q_eff, Im q_eff]`` and ``c = clamp(A - |q_mean|, 0)`` built by
``hf_ropekv.scoring.query_weights``.  Dimensions ``>= 2F`` (non-rotary part of
partial-rotary heads) do not enter the score and are never read.

Scoring is memory-bound (one read of the keys), so the Triton kernel reads a
tile of keys once and scores it for every query head of its GQA group.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ._triton import HAS_TRITON, tl, triton

__all__ = ["score_keys_triton", "score_keys_reference", "check_score_args", "HAS_TRITON"]

KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_score_args(keys: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> None:
    """Raise ``ValueError`` unless keys [B, H_kv, S, D], w [B or 1, H_q, 2F], c [H_q, F] fit."""
    if keys.dim() != 4:
        raise ValueError(f"keys must be 4-D [B, H_kv, S, D], got shape {tuple(keys.shape)}")
    if keys.dtype not in KEY_DTYPES:
        raise ValueError(f"keys dtype must be float16, bfloat16 or float32, got {keys.dtype}")
    if w.dim() != 3 or c.dim() not in (2, 3):
        raise ValueError(f"w must be [B, H_q, 2F] and c [H_q, F] or [B, H_q, F], got {tuple(w.shape)} and {tuple(c.shape)}")
    B, H_kv, _, D = keys.shape
    H_q, F = c.shape[-2:]
    if tuple(w.shape[1:]) != (H_q, 2 * F):
        raise ValueError(
            f"w shape {tuple(w.shape)} does not match c shape {tuple(c.shape)} (expected [B, {H_q}, {2 * F}])"
        )
    if w.shape[0] not in (1, B):
        raise ValueError(f"w batch {w.shape[0]} must be 1 or the keys batch {B}")
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(f"query heads ({H_q}) must be a multiple of KV heads ({H_kv})")
    if F == 0 or 2 * F > D:
        raise ValueError(f"need 0 < 2F <= head_dim, got F={F}, head_dim={D}")
    if w.dtype != torch.float32 or c.dtype != torch.float32:
        raise ValueError(f"w and c must be float32, got {w.dtype} and {c.dtype}")
    if w.device != keys.device or c.device != keys.device:
        raise ValueError(f"keys ({keys.device}), w ({w.device}) and c ({c.device}) must be on one device")


# --------------------------------------------------------------------------- Triton

if HAS_TRITON:

    @triton.jit
    def _score_kernel(
        k_ptr, w_ptr, c_ptr, out_ptr,
        S,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_wb, stride_wh,
        stride_ch,
        stride_ob, stride_oh,
        F: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_F: tl.constexpr,
        BLOCKS_PER_PROG: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        # One program: one batch row, one KV head, BLOCKS_PER_PROG consecutive
        # blocks of BLOCK_S slots; every key tile is read once and scored for
        # all GROUP query heads of the KV head.
        pid_s = tl.program_id(0)
        hkv = tl.program_id(1).to(tl.int64)  # int64: storages may exceed 2**31 elements
        b = tl.program_id(2).to(tl.int64)
        offs_f = tl.arange(0, BLOCK_F)
        mask_f = offs_f < F  # partial rotary / non-power-of-two F
        k_base = k_ptr + b * stride_kb + hkv * stride_kh

        # Software-pipelined (NUM_STAGES): the next tiles' loads are in flight
        # while this one is scored; that is what makes the kernel memory-bound.
        for i in tl.range(0, BLOCKS_PER_PROG, num_stages=NUM_STAGES):
            offs_s = (pid_s * BLOCKS_PER_PROG + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            mask_s = offs_s < S
            mask = mask_s[:, None] & mask_f[None, :]
            # Real parts k[f] and imaginary parts k[f+F]; dims >= 2F are never read.
            rows = k_base + offs_s[:, None].to(tl.int64) * stride_ks
            x = tl.load(rows + offs_f[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(rows + (offs_f[None, :] + F) * stride_kd, mask=mask, other=0.0).to(tl.float32)
            mag = tl.sqrt(x * x + y * y)
            for g in tl.static_range(GROUP):
                h = hkv * GROUP + g
                w_row = w_ptr + b * stride_wb + h * stride_wh
                wr = tl.load(w_row + offs_f, mask=mask_f, other=0.0)
                wi = tl.load(w_row + F + offs_f, mask=mask_f, other=0.0)
                cc = tl.load(c_ptr + h * stride_ch + offs_f, mask=mask_f, other=0.0)
                s = tl.sum(x * wr[None, :] + y * wi[None, :] + mag * cc[None, :], axis=1)
                tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_s, s, mask=mask_s)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def score_keys_triton(
    keys: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    block_s: Optional[int] = None,
    blocks_per_program: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Score ``keys`` [B, H_kv, S, D] (any strides) with the Triton kernel.

    ``w`` [B or 1, H_q, 2F] and ``c`` [H_q, F] are float32. Returns (or fills
    ``out``) float32 [B, H_q, S]. Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
    Launch parameters default to what measured best on an H200 with bf16 keys
    (Triton 3.6): ~2.9 TB/s of keys read at head_dim 128 (68 % of the 4.2 TB/s
    copy bandwidth), 2.1-2.6 TB/s at head_dim 64 and 256. Small launches are
    bound by Triton's host-side launch cost (~40 us), not by the GPU.
    """
    if not HAS_TRITON:
        raise RuntimeError("score_keys_triton needs Triton, which is not installed")
    check_score_args(keys, w, c)
    if not keys.is_cuda and not _interpreting():
        raise RuntimeError("score_keys_triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    B, H_kv, S, _ = keys.shape
    H_q, F = c.shape
    if out is None:
        out = torch.empty((B, H_q, S), dtype=torch.float32, device=keys.device)
    elif out.shape != (B, H_q, S) or out.dtype != torch.float32 or out.stride(-1) != 1 or out.device != keys.device:
        raise ValueError(f"out must be float32 [{B}, {H_q}, {S}] on {keys.device} with unit last stride")
    if B == 0 or S == 0:
        return out
    w = w.contiguous()
    c = c.contiguous()
    stride_wb = 0 if w.shape[0] == 1 else w.stride(0)  # one weight set shared by all rows

    block_f = triton.next_power_of_2(F)
    # 32 slots per tile; a warp covers F <= 64 pairs per row, two warps above
    # (larger tiles per thread spill registers and collapse to ~0.5 TB/s).
    block_s = 32 if block_s is None else block_s
    if num_warps is None:
        num_warps = 1 if block_f <= 64 else 2
    num_stages = 3 if num_stages is None else num_stages
    n_blocks = triton.cdiv(S, block_s)
    if blocks_per_program is None:
        # Long loops amortise the pipeline prologue, but keep >= ~2K programs
        # (about 16 one-warp programs per SM on a 132-SM GPU).
        blocks_per_program = max(1, min(32, _prev_pow2(B * H_kv * n_blocks // 2048)))
    grid = (triton.cdiv(n_blocks, blocks_per_program), H_kv, B)
    _score_kernel[grid](
        keys, w, c, out,
        S,
        keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
        stride_wb, w.stride(1),
        c.stride(0),
        out.stride(0), out.stride(1),
        F=F,
        GROUP=H_q // H_kv,
        BLOCK_S=block_s,
        BLOCK_F=block_f,
        BLOCKS_PER_PROG=blocks_per_program,
        NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
    return out


# --------------------------------------------------------------------------- PyTorch twin


def score_keys_reference(
    keys: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    chunk: int = 4096,
) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`score_keys_triton` (float32 accumulation).

    Works slot-chunk by slot-chunk so the float32 temporaries stay small.
    """
    check_score_args(keys, w, c)
    B, H_kv, S, _ = keys.shape
    H_q, F = c.shape[-2:]
    G = H_q // H_kv
    if out is None:
        out = torch.empty((B, H_q, S), dtype=torch.float32, device=keys.device)
    elif out.shape != (B, H_q, S) or out.dtype != torch.float32 or out.device != keys.device:
        raise ValueError(f"out must be float32 [{B}, {H_q}, {S}] on {keys.device}")
    # One [3F, G] weight matrix per (row, KV head): [Re w; Im w; c] against [x; y; |k|].
    Bw = w.shape[0]
    wr = w[..., :F].reshape(Bw, H_kv, G, F)
    wi = w[..., F:].reshape(Bw, H_kv, G, F)
    cc = c.reshape(-1, H_kv, G, F).expand(max(Bw, c.shape[0] if c.dim() == 3 else 1), H_kv, G, F)
    if cc.shape[0] != Bw:  # per-row c with shared w
        wr, wi = wr.expand_as(cc), wi.expand_as(cc)
        Bw = cc.shape[0]
    wmat = torch.cat([wr, wi, cc], dim=-1).transpose(-1, -2)  # [Bw, H_kv, 3F, G]
    out_v = out.view(B, H_kv, G, S)
    for s0 in range(0, S, chunk):
        k = keys[:, :, s0:s0 + chunk]
        x = k[..., :F].float()
        y = k[..., F:2 * F].float()
        feats = torch.cat([x, y, torch.sqrt(x * x + y * y)], dim=-1)  # [B, H_kv, s, 3F]
        out_v[..., s0:s0 + chunk] = torch.matmul(feats, wmat).transpose(-1, -2)
    return out
