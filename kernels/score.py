"""Key scoring kernel (TriAttention; docs/how-it-works.md, "The score") and its PyTorch twin.

Both compute, for every query head ``h`` and cached slot ``s``, with ``k = keys[b, h // G, s]`` (``G = H_q / H_kv``)::

    x_f = k[f * PAIR_STRIDE],  y_f = k[f * PAIR_STRIDE + IMAG_OFFSET]      (pair f of the key)
    score[b, h, s] = sum_f (x_f w[b, h, f] + y_f w[b, h, F + f] + c[b, h, f] sqrt(x_f^2 + y_f^2))

``w = [Re q_eff, Im q_eff]`` and ``c = clamp(A - |q_mean|, 0)`` come from ``hf_ropekv.scorers.rope_scoring``, one row
per batch row or one shared by all. Pairs are HF's ``rotate_half`` (``PAIR_STRIDE, IMAG_OFFSET = 1, F``) or
interleaved (``2, 1``; see ``hf_ropekv.model.layouts``); dims outside the pairs (partial rotary) are never read.
Scoring is memory-bound: the kernel reads a tile of keys once and scores it for all query heads of its GQA group.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import FLOAT_DTYPES, HAS_TRITON, check_device, tl, triton

__all__ = ["score_keys_triton", "score_keys_reference", "check_score_args", "HAS_TRITON"]


def check_score_args(keys: torch.Tensor, w: torch.Tensor, c: torch.Tensor, pair_stride: int | None = None,
                     imag_offset: int | None = None) -> tuple[torch.Tensor, int, int]:
    """Check keys [B, H_kv, S, D], w [B or 1, H_q, 2F], c [B or 1, H_q, F] (or [H_q, F]) and the pair layout;
    raise ``ValueError`` naming a mismatch. Returns ``(c as 3-D, pair_stride, imag_offset)`` (None: ``rotate_half``,
    1 and F)."""
    if keys.dim() != 4:
        raise ValueError(f"keys must be 4-D [B, H_kv, S, D], got shape {tuple(keys.shape)}")
    if keys.dtype not in FLOAT_DTYPES:
        raise ValueError(f"keys dtype must be float16, bfloat16 or float32, got {keys.dtype}")
    if c.dim() == 2:
        c = c.unsqueeze(0)  # one set shared by every row
    if w.dim() != 3 or c.dim() != 3:
        raise ValueError(f"w must be [B, H_q, 2F] and c [B, H_q, F] or [H_q, F], got {tuple(w.shape)} and "
                         f"{tuple(c.shape)}")
    B, H_kv, _, D = keys.shape
    H_q, F = c.shape[1:]
    if tuple(w.shape[1:]) != (H_q, 2 * F):
        raise ValueError(f"w shape {tuple(w.shape)} does not match c shape {tuple(c.shape)} "
                         f"(expected [B, {H_q}, {2 * F}])")
    for name, t in (("w", w), ("c", c)):
        if t.shape[0] not in (1, B):
            raise ValueError(f"{name} batch {t.shape[0]} must be 1 or the keys batch {B}")
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(f"query heads ({H_q}) must be a multiple of KV heads ({H_kv})")
    if F == 0:
        raise ValueError("need at least one rotary pair (F > 0)")
    pair_stride = 1 if pair_stride is None else int(pair_stride)
    imag_offset = F if imag_offset is None else int(imag_offset)
    if pair_stride < 1 or imag_offset < 1:
        raise ValueError(f"pair_stride and imag_offset must be >= 1, got {pair_stride} and {imag_offset}")
    last = pair_stride * (F - 1) + imag_offset  # the last pair's imaginary dim
    if last >= D:
        raise ValueError(f"{F} rotary pairs with pair_stride {pair_stride} and imag_offset {imag_offset} reach dim "
                         f"{last}, beyond head_dim {D} (2F rotary dims exceed head_dim?)")
    if w.dtype != torch.float32 or c.dtype != torch.float32:
        raise ValueError(f"w and c must be float32, got {w.dtype} and {c.dtype}")
    if w.device != keys.device or c.device != keys.device:
        raise ValueError(f"keys ({keys.device}), w ({w.device}) and c ({c.device}) must be on one device")
    return c, pair_stride, imag_offset


# --------------------------------------------------------------------------- Triton

if HAS_TRITON:

    @triton.jit
    def _score_kernel(
        k_ptr, w_ptr, c_ptr, out_ptr, S,
        stride_kb, stride_kh, stride_ks, stride_kd, stride_wb, stride_wh, stride_cb, stride_ch, stride_ob, stride_oh,
        F: tl.constexpr, PAIR_STRIDE: tl.constexpr, IMAG_OFFSET: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr, BLOCKS_PER_PROG: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        # One program: one batch row, one KV head, BLOCKS_PER_PROG consecutive blocks of BLOCK_S slots, scored for
        # all GROUP query heads of the KV head.
        pid_s = tl.program_id(0)
        hkv = tl.program_id(1).to(tl.int64)  # int64: storages may exceed 2**31 elements
        b = tl.program_id(2).to(tl.int64)
        offs_f = tl.arange(0, BLOCK_F)
        mask_f = offs_f < F  # partial rotary / non-power-of-two F
        k_base = k_ptr + b * stride_kb + hkv * stride_kh

        # Software-pipelined: the next tiles' loads are in flight while this one is scored.
        for i in tl.range(0, BLOCKS_PER_PROG, num_stages=NUM_STAGES):
            offs_s = (pid_s * BLOCKS_PER_PROG + i) * BLOCK_S + tl.arange(0, BLOCK_S)
            mask_s = offs_s < S
            mask = mask_s[:, None] & mask_f[None, :]
            # Real parts k[f * PAIR_STRIDE], imaginary parts IMAG_OFFSET further; other dims are never read.
            rows = k_base + offs_s[:, None].to(tl.int64) * stride_ks
            real_d = offs_f[None, :] * PAIR_STRIDE
            x = tl.load(rows + real_d * stride_kd, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(rows + (real_d + IMAG_OFFSET) * stride_kd, mask=mask, other=0.0).to(tl.float32)
            mag = tl.sqrt(x * x + y * y)
            for g in tl.static_range(GROUP):
                h = hkv * GROUP + g
                w_row = w_ptr + b * stride_wb + h * stride_wh
                wr = tl.load(w_row + offs_f, mask=mask_f, other=0.0)
                wi = tl.load(w_row + F + offs_f, mask=mask_f, other=0.0)
                cc = tl.load(c_ptr + b * stride_cb + h * stride_ch + offs_f, mask=mask_f, other=0.0)
                s = tl.sum(x * wr[None, :] + y * wi[None, :] + mag * cc[None, :], axis=1)
                tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_s, s, mask=mask_s)


def score_keys_triton(keys: torch.Tensor, w: torch.Tensor, c: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                      pair_stride: Optional[int] = None, imag_offset: Optional[int] = None,
                      block_s: Optional[int] = None, blocks_per_program: Optional[int] = None,
                      num_warps: Optional[int] = None, num_stages: Optional[int] = None) -> torch.Tensor:
    """Score ``keys`` [B, H_kv, S, D] (any strides) with the Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    ``w`` [B or 1, H_q, 2F] and ``c`` [B or 1, H_q, F] (or [H_q, F]) are float32; ``pair_stride`` / ``imag_offset``
    give the pair layout (default ``rotate_half``: 1, F). Returns (or fills ``out``) float32 [B, H_q, S]. The launch
    defaults measured best on an H200 with bf16 keys (~2.9 TB/s of keys read at head_dim 128).
    """
    c, pair_stride, imag_offset = check_score_args(keys, w, c, pair_stride, imag_offset)
    check_device("score_keys_triton", keys)
    B, H_kv, S, _ = keys.shape
    H_q, F = c.shape[1:]
    if out is None:
        out = torch.empty((B, H_q, S), dtype=torch.float32, device=keys.device)
    elif out.shape != (B, H_q, S) or out.dtype != torch.float32 or out.stride(-1) != 1 or out.device != keys.device:
        raise ValueError(f"out must be float32 [{B}, {H_q}, {S}] on {keys.device} with unit last stride")
    if B == 0 or S == 0:
        return out
    w, c = w.contiguous(), c.contiguous()
    stride_wb = 0 if w.shape[0] == 1 else w.stride(0)  # one weight set shared by all rows
    stride_cb = 0 if c.shape[0] == 1 else c.stride(0)

    block_f = triton.next_power_of_2(F)
    # 32 slots per tile; a warp covers F <= 64 pairs per row, two warps above (larger tiles spill registers).
    block_s = 32 if block_s is None else block_s
    if num_warps is None:
        num_warps = 1 if block_f <= 64 else 2
    num_stages = 3 if num_stages is None else num_stages
    n_blocks = triton.cdiv(S, block_s)
    if blocks_per_program is None:
        # Long loops amortise the pipeline prologue, but keep >= ~2K programs (~16 one-warp programs per SM).
        blocks_per_program = max(1, min(32, 1 << (max(B * H_kv * n_blocks // 2048, 1).bit_length() - 1)))
    grid = (triton.cdiv(n_blocks, blocks_per_program), H_kv, B)
    _score_kernel[grid](
        keys, w, c, out, S,
        *keys.stride(), stride_wb, w.stride(1), stride_cb, c.stride(1), out.stride(0), out.stride(1),
        F=F, PAIR_STRIDE=pair_stride, IMAG_OFFSET=imag_offset, GROUP=H_q // H_kv, BLOCK_S=block_s,
        BLOCK_F=block_f, BLOCKS_PER_PROG=blocks_per_program, NUM_STAGES=num_stages, num_warps=num_warps)
    return out


# --------------------------------------------------------------------------- PyTorch twin


def score_keys_reference(keys: torch.Tensor, w: torch.Tensor, c: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                         pair_stride: Optional[int] = None, imag_offset: Optional[int] = None,
                         chunk: int = 4096) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`score_keys_triton` (float32 accumulation), by chunks of ``chunk`` slots."""
    c, pair_stride, imag_offset = check_score_args(keys, w, c, pair_stride, imag_offset)
    B, H_kv, S, _ = keys.shape
    H_q, F = c.shape[1:]
    G = H_q // H_kv
    if out is None:
        out = torch.empty((B, H_q, S), dtype=torch.float32, device=keys.device)
    elif out.shape != (B, H_q, S) or out.dtype != torch.float32 or out.device != keys.device:
        raise ValueError(f"out must be float32 [{B}, {H_q}, {S}] on {keys.device}")
    # One [3F, G] weight matrix per (row, KV head): [Re w; Im w; c] against [x; y; |k|].
    Bw = max(w.shape[0], c.shape[0])
    wr = w[..., :F].reshape(-1, H_kv, G, F).expand(Bw, H_kv, G, F)
    wi = w[..., F:].reshape(-1, H_kv, G, F).expand(Bw, H_kv, G, F)
    cc = c.reshape(-1, H_kv, G, F).expand(Bw, H_kv, G, F)
    wmat = torch.cat([wr, wi, cc], dim=-1).transpose(-1, -2)  # [Bw, H_kv, 3F, G]
    real_end = pair_stride * F
    out_v = out.view(B, H_kv, G, S)
    for s0 in range(0, S, chunk):
        k = keys[:, :, s0:s0 + chunk]
        x = k[..., 0:real_end:pair_stride].float()
        y = k[..., imag_offset:imag_offset + real_end:pair_stride].float()
        feats = torch.cat([x, y, torch.sqrt(x * x + y * y)], dim=-1)  # [B, H_kv, s, 3F]
        out_v[..., s0:s0 + chunk] = torch.matmul(feats, wmat).transpose(-1, -2)
    return out
