"""Split-KV (flash-decoding) attention of one query token over the cache's kept slots, and its PyTorch twin.

For query rows ``q`` [B, H_q, D] and keys / values [B, H_kv, S, D] / [B, H_kv, S, Dv] with
``H_q = G * H_kv`` (query head ``h`` reads KV head ``h // G``, transformers' ``repeat_kv`` order)::

    x[b, h, s]   = scale * <q[b, h], k[b, h // G, s]>
    x[b, h, s]   = softcap * tanh(x[b, h, s] / softcap)             (Gemma-2 soft-capping, when given)
    x[b, h, s]   = -inf  where not mask[b, s]
    out[b, h]    = softmax_s(x[b, h]) @ v[b, h // G]

``mask`` is bool [B, S] (True = attend): transformers' sdpa mask of one query token,
``mask4d[:, 0, 0, :]``, which carries left padding, the holes in front of a row's kept tokens and
sliding windows. A row without any valid slot outputs zeros (sdpa would give NaN). Masked slots
are never read, so holes may hold garbage (an arena made with ``torch.empty``).

Keys and values are either in the query's dtype or quantized (int8, or float8_e4m3fn) with one
float32 scale per (row, head, token): ``k = k_q * key_scale[..., None]`` (see ``quantize.py``).

Decoding reads every kept key and value once per step, so the kernel is memory-bound. Grid
``(num_splits, H_kv, B)``: a program walks one chunk of the slots in tiles of ``BLOCK_N`` and reads
each key / value tile once for all ``G`` query heads of its KV head (a ``[G_PAD, D]`` query tile
against the tile through ``tl.dot``, ``G_PAD = max(16, next_pow2(G))``), with an online softmax
in float32 (running max ``m``, sum ``l``, unnormalized ``acc``). Splitting S fills the GPU at
batch 1 (B * H_kv = 8 programs would leave 124 of 132 SMs idle); a second small kernel merges
the splits' ``(m, l, acc)`` with log-sum-exp weights. With one split the first kernel writes the
output itself.

``decode_attention`` is registered as the torch op ``hf_ropekv::decode_attention``
(``torch.library.triton_op``), so ``torch.compile`` traces through it without a graph break,
and it allocates its workspace with ``torch.empty`` and never syncs: it can be captured in a
CUDA graph. Benchmark (GPU): ``python -m hf_ropekv.kernels.attention --out results.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Optional

import torch

from ._triton import HAS_TRITON, tl, triton
from .quantize import QUANT_DTYPES, quantize_kv

__all__ = ["benchmark", "check_decode_args", "decode_attention", "decode_attention_reference"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OP_NAME = "hf_ropekv::decode_attention"


def check_decode_args(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the problem unless the arguments fit :func:`decode_attention`'s contract."""
    if query.dim() not in (3, 4) or (query.dim() == 4 and query.shape[2] != 1):
        raise ValueError(f"query must be [B, H_q, D] or [B, H_q, 1, D] (one token), got shape {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    if keys.dim() != 4 or values.dim() != 4:
        raise ValueError(
            f"keys and values must be [B, H_kv, S, D], got shapes {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    B, H_q, D = query.shape[0], query.shape[1], query.shape[-1]
    if tuple(keys.shape[:3]) != tuple(values.shape[:3]):
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in [B, H_kv, S]")
    B_kv, H_kv, S, D_k = keys.shape
    if B_kv != B:
        raise ValueError(f"keys batch {B_kv} does not match the query batch {B}")
    if D_k != D:
        raise ValueError(f"keys head_dim {D_k} does not match the query head_dim {D}")
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(f"query heads ({H_q}) must be a multiple of KV heads ({H_kv})")
    if keys.dtype != values.dtype:
        raise ValueError(f"keys ({keys.dtype}) and values ({values.dtype}) must share a dtype")
    devices = {t.device for t in (query, keys, values, mask, key_scale, value_scale, out) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if keys.dtype in QUANT_DTYPES:
        for name, s in (("key_scale", key_scale), ("value_scale", value_scale)):
            if s is None:
                raise ValueError(f"{keys.dtype} keys/values need {name} (float32 [B, H_kv, S])")
            if s.dtype != torch.float32 or tuple(s.shape) != (B, H_kv, S):
                raise ValueError(f"{name} must be float32 [{B}, {H_kv}, {S}], got {s.dtype} {tuple(s.shape)}")
    elif keys.dtype != query.dtype:
        raise ValueError(
            f"keys/values dtype {keys.dtype} must be the query's ({query.dtype}) or one of {list(QUANT_DTYPES)}"
        )
    elif key_scale is not None or value_scale is not None:
        raise ValueError(f"key_scale/value_scale are only for quantized keys/values, not {keys.dtype}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, S)):
        raise ValueError(f"mask must be bool [{B}, {S}] (True = attend), got {mask.dtype} {tuple(mask.shape)}")
    if out is not None:
        shape = (B, H_q, values.shape[3]) if query.dim() == 3 else (B, H_q, 1, values.shape[3])
        if tuple(out.shape) != shape or out.dtype != query.dtype:
            raise ValueError(f"out must be {query.dtype} {list(shape)}, got {out.dtype} {tuple(out.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


# --------------------------------------------------------------------------- Triton

if HAS_TRITON:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, mask_ptr, ws_ptr, out_ptr,
        S, CHUNK, ML_OFFSET, scale, softcap,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_ksb, stride_ksh, stride_kss,
        stride_vsb, stride_vsh, stride_vss,
        stride_mb, stride_ms,
        stride_ob, stride_oh, stride_od,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr,
        QUANT: tl.constexpr,
        SOFTCAP: tl.constexpr,
        F32_DOT: tl.constexpr,
        DIRECT: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        # One program: one batch row, one KV head, one chunk of CHUNK slots, all G query heads.
        split = tl.program_id(0)
        hkv = tl.program_id(1).to(tl.int64)  # int64: arenas may exceed 2**31 elements
        b = tl.program_id(2).to(tl.int64)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_g = offs_g < G
        mask_d = offs_d < D  # non-power-of-two head dims
        mask_dv = offs_dv < DV
        heads = hkv * G + offs_g  # repeat_kv order: query head h reads KV head h // G
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=mask_g[:, None] & mask_d[None, :], other=0.0,
        )  # padded rows are zeros: finite logits, never stored
        k_base = k_ptr + b * stride_kb + hkv * stride_kh
        v_base = v_ptr + b * stride_vb + hkv * stride_vh

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max, log2 units
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_DV], tl.float32)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, S)
        # Software-pipelined: the next tiles' loads are in flight while this one is used.
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            if HAS_MASK:
                keep = tl.load(mask_ptr + b * stride_mb + offs_n * stride_ms, mask=valid, other=0)
                valid = valid & (keep != 0)
            rows = offs_n.to(tl.int64)
            # Masked slots are not read (holes may hold NaN); zeros keep the dots finite.
            k = tl.load(
                k_base + rows[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                mask=valid[:, None] & mask_d[None, :], other=0.0,
            )
            v = tl.load(
                v_base + rows[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                mask=valid[:, None] & mask_dv[None, :], other=0.0,
            )
            if QUANT:  # int8 / fp8 values are exact in fp16 / bf16; via fp32 (the interpreter has no int8 -> bf16)
                k = k.to(tl.float32).to(q.dtype)
                v = v.to(tl.float32).to(q.dtype)
            if F32_DOT:
                qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:  # fp16 / bf16 tensor cores, fp32 accumulation
                qk = tl.dot(q, tl.trans(k))
            if QUANT:  # per-token scales factor out of the dot products
                ks = tl.load(ks_ptr + b * stride_ksb + hkv * stride_ksh + rows * stride_kss, mask=valid, other=0.0)
                qk = qk * ks[None, :]
            if SOFTCAP:
                x = qk * (scale / softcap)
                t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # tanh(|x|) = (1 - t) / (1 + t), t = e^(-2|x|)
                th = (1.0 - t) / (1.0 + t)
                qk = tl.where(x < 0, -th, th) * (softcap * 1.4426950408889634)
            else:
                qk = qk * (scale * 1.4426950408889634)  # log2(e): the softmax runs in base 2 (exp2)
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: exp2(-inf) = 0, not NaN
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if QUANT:
                vs = tl.load(vs_ptr + b * stride_vsb + hkv * stride_vsh + rows * stride_vss, mask=valid, other=0.0)
                p = p * vs[None, :]
            p = p.to(q.dtype)  # P in the input dtype, as flash attention does
            if F32_DOT:
                pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p, v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        store_mask = mask_g[:, None] & mask_dv[None, :]
        if DIRECT:  # one split: this program holds the whole softmax
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no valid slot: acc is 0, the row outputs zeros
            o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:  # workspace [B, H_q, num_splits, DV] then [B, H_q, num_splits, 2] (m, l)
            part = (b * (tl.num_programs(1) * G) + heads) * tl.num_programs(0) + split
            tl.store(ws_ptr + part[:, None] * DV + offs_dv[None, :], acc, mask=store_mask)
            tl.store(ws_ptr + ML_OFFSET + part * 2, m_i, mask=mask_g)
            tl.store(ws_ptr + ML_OFFSET + part * 2 + 1, l_i, mask=mask_g)

    @triton.jit
    def _decode_combine_kernel(
        ws_ptr, out_ptr,
        NUM_SPLITS, ML_OFFSET,
        stride_ob, stride_oh, stride_od,
        DV: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_SPLITS: tl.constexpr,
    ):
        # One program per (query head, row): merge its splits with log-sum-exp weights.
        h = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        first = (b * tl.num_programs(0) + h) * NUM_SPLITS
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < DV
        m_run = tl.max(tl.full([BLOCK_SPLITS], float("-inf"), tl.float32), 0)
        l_run = tl.sum(tl.zeros([BLOCK_SPLITS], tl.float32), 0)
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for s0 in range(0, NUM_SPLITS, BLOCK_SPLITS):
            offs_s = s0 + tl.arange(0, BLOCK_SPLITS)
            mask_s = offs_s < NUM_SPLITS
            part = first + offs_s
            m = tl.load(ws_ptr + ML_OFFSET + part * 2, mask=mask_s, other=float("-inf"))
            total = tl.load(ws_ptr + ML_OFFSET + part * 2 + 1, mask=mask_s, other=0.0)
            a = tl.load(ws_ptr + part[:, None] * DV + offs_dv[None, :], mask=mask_s[:, None] & mask_dv[None, :],
                        other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty splits (and empty rows) weigh 0
            alpha = tl.exp2(m_run - m_safe)
            w = tl.exp2(m - m_safe)
            l_run = l_run * alpha + tl.sum(w * total, 0)
            acc = acc * alpha + tl.sum(w[:, None] * a, 0)
            m_run = m_new
        o = acc / tl.where(l_run > 0, l_run, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_dv * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=mask_dv)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Plain helpers for the launcher: triton.cdiv / next_power_of_2 cost ~4 us a call from Python (Triton 3.9).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_n(block_d: int) -> int:
    """Slots per tile: 64 (16 KB bf16 K tiles at head_dim 128), 32 above head_dim 128 to bound shared memory."""
    return 64 if block_d <= 128 else 32


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached: a plain dict, which torch.compile traces without warnings)."""
    if device.type != "cuda":
        return 132  # the interpreter on the CPU: plan as for an H100 / H200
    count = _SM_COUNTS.get(device.index)
    if count is None:
        count = _SM_COUNTS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def _auto_splits(B: int, H_kv: int, n_blocks: int, sm_count: int) -> int:
    """Enough (row, KV head, split) programs for two waves over the SMs, each split at least one tile."""
    programs = B * H_kv
    target = 2 * sm_count
    if programs >= target or n_blocks <= 1:
        return 1  # the rows and heads alone fill the GPU: no combine pass
    per_split = max(1, n_blocks * programs // target)
    splits = _cdiv(n_blocks, per_split)
    return _cdiv(n_blocks, _cdiv(n_blocks, splits))  # balance the chunks: none empty


def _decode_impl(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045 - the op's schema is inferred from these; older torch knows Optional
    scale: float,
    softcap: Optional[float],  # noqa: UP045
    key_scale: Optional[torch.Tensor],  # noqa: UP045
    value_scale: Optional[torch.Tensor],  # noqa: UP045
    out: torch.Tensor,
    num_splits: int,
) -> None:
    """The op's body: checked 3-D ``query`` [B, H_q, D] and ``out`` [B, H_q, Dv]; writes ``out``."""
    B, H_q, D = query.shape
    _, H_kv, S, Dv = values.shape
    G = H_q // H_kv
    block_d = max(16, _next_pow2(D))
    block_dv = max(16, _next_pow2(Dv))
    block_n = _block_n(max(block_d, block_dv))
    chunk = _cdiv(_cdiv(S, block_n), num_splits) * block_n
    quant = keys.dtype != query.dtype
    direct = num_splits == 1
    if direct:
        ws, ml_offset = query, 0  # unused; not out, which torch.compile must see passed (and written) once
    else:
        parts = B * H_q * num_splits
        ws = torch.empty(parts * (Dv + 2), dtype=torch.float32, device=query.device)
        ml_offset = parts * Dv
    mask_u8 = query if mask is None else mask.view(torch.uint8)  # bool pointers as bytes
    ks = key_scale if quant else query
    vs = value_scale if quant else query
    ks_strides = ks.stride() if quant else (0, 0, 0)
    vs_strides = vs.stride() if quant else (0, 0, 0)
    m_strides = mask_u8.stride() if mask is not None else (0, 0)
    interpreted = _interpreting()
    split_kernel = _for_compile(_decode_split_kernel)
    split_kernel[(num_splits, H_kv, B)](
        query, keys, values, ks, vs, mask_u8, ws, out,
        S, chunk, ml_offset, scale, 1.0 if softcap is None else softcap,
        *query.stride(),
        *keys.stride(),
        *values.stride(),
        *ks_strides,
        *vs_strides,
        *m_strides,
        *out.stride(),
        G=G,
        G_PAD=max(16, _next_pow2(G)),
        D=D,
        DV=Dv,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        HAS_MASK=mask is not None,
        QUANT=quant,
        SOFTCAP=softcap is not None,
        # float32 dots (IEEE, not TF32) for float32 queries, and in the interpreter, whose tl.dot multiplies
        # bf16 bit patterns as integers (Triton 3.9); the products are the same: bf16 x bf16 is exact in fp32.
        F32_DOT=query.dtype == torch.float32 or interpreted,
        DIRECT=direct,
        NUM_STAGES=2,
        num_warps=4,
    )
    if not direct:
        combine_kernel = _for_compile(_decode_combine_kernel)
        combine_kernel[(H_q, B)](
            ws, out,
            num_splits, ml_offset,
            *out.stride(),
            DV=Dv,
            BLOCK_DV=block_dv,
            BLOCK_SPLITS=min(64, _next_pow2(num_splits)),
            num_warps=4,
        )


#: The torch op ``hf_ropekv::decode_attention``, once :func:`register_op` made it (registering imports inductor,
#: seconds a process that never compiles need not pay: eager steps and CUDA graphs call the implementation).
_OP = None


def register_op() -> None:
    """Register the kernel as a torch op so ``torch.compile`` traces through it (call it eagerly, before compiling)."""
    global _OP
    if _OP is None and HAS_TRITON and hasattr(torch.library, "triton_op"):
        _OP = torch.library.triton_op(OP_NAME, _decode_impl, mutates_args={"out"})


def _for_compile(kernel):
    """``kernel`` as torch.compile sees it inside the registered op (as it is elsewhere, and when interpreted)."""
    if _OP is None or _interpreting():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over ``keys`` / ``values``, with the Triton kernels.

    ``query`` [B, H_q, D] or [B, H_q, 1, D] (fp16/bf16/fp32); ``keys`` [B, H_kv, S, D] and ``values``
    [B, H_kv, S, Dv], any strides (views of a larger arena), in the query's dtype or int8 /
    float8_e4m3fn with float32 ``key_scale`` / ``value_scale`` [B, H_kv, S]; ``mask`` bool [B, S]
    (True = attend) or None (all valid); ``scale`` the softmax scale; ``softcap`` Gemma-2 logit
    soft-capping. Returns (or fills ``out``, any strides) [B, H_q, Dv] in the query's dtype, with
    the query's rank. Rows without a valid slot get zeros. ``num_splits`` (None: fill the GPU)
    sets how many chunks each (row, KV head) is cut into.

    Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``. No host syncs: capturable in a CUDA graph.
    """
    if not HAS_TRITON:
        raise RuntimeError("decode_attention needs Triton, which is not installed (use decode_attention_reference)")
    check_decode_args(query, keys, values, mask, key_scale, value_scale, out, softcap, num_splits)
    if not query.is_cuda and not _interpreting():
        raise RuntimeError("decode_attention needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    B, H_q, D = query.shape[0], query.shape[1], query.shape[-1]
    _, H_kv, S, Dv = values.shape
    if out is None:
        out = torch.empty((B, H_q, Dv) if query.dim() == 3 else (B, H_q, 1, Dv), dtype=query.dtype, device=query.device)
    if B == 0 or H_q == 0 or Dv == 0:
        return out
    if num_splits is None:
        block = _block_n(max(16, _next_pow2(max(D, Dv))))
        num_splits = _auto_splits(B, H_kv, _cdiv(S, block), _sm_count(query.device))
    squeeze = query.dim() == 4
    (_OP or _decode_impl)(
        query[:, :, 0] if squeeze else query, keys, values, mask, float(scale),
        None if softcap is None else float(softcap), key_scale, value_scale,
        out[:, :, 0] if squeeze else out, int(num_splits),
    )
    return out


# --------------------------------------------------------------------------- PyTorch twin


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    softcap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Pure-PyTorch twin of :func:`decode_attention` (float32 math; ``num_splits`` is accepted and ignored)."""
    check_decode_args(query, keys, values, mask, key_scale, value_scale, out, softcap, num_splits)
    B, H_q, D = query.shape[0], query.shape[1], query.shape[-1]
    _, H_kv, S, Dv = values.shape
    q = query.reshape(B, H_kv, H_q // H_kv, D).float()
    k, v = keys.float(), values.float()
    if key_scale is not None:
        k = k * key_scale[..., None]
        v = v * value_scale[..., None]
    if mask is not None:  # holes may hold garbage: zero them so 0 * NaN cannot reach the output
        hole = ~mask[:, None, :, None]
        k, v = k.masked_fill(hole, 0.0), v.masked_fill(hole, 0.0)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H_kv, G, S]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    if S == 0:
        result = q.new_zeros(B, H_kv, H_q // H_kv, Dv)
    else:
        m = logits.amax(dim=-1, keepdim=True)
        p = torch.exp(logits - torch.where(torch.isinf(m), 0.0, m))  # a fully masked row: p = 0
        total = p.sum(dim=-1, keepdim=True)
        result = torch.matmul(p, v) / torch.where(total > 0, total, 1.0)
    result = result.reshape(out.shape if out is not None else (B, H_q, Dv) if query.dim() == 3 else (B, H_q, 1, Dv))
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


# --------------------------------------------------------------------------- benchmark


def _sdpa_repeat_kv(query, keys, values, mask, scale):
    """What transformers' sdpa path runs today: ``repeat_kv`` copies of K/V and a boolean mask."""
    import torch.nn.functional as F

    B, H_kv, S, D = keys.shape
    G = query.shape[1] // H_kv
    keys = keys[:, :, None].expand(B, H_kv, G, S, D).reshape(B, H_kv * G, S, D)
    values = values[:, :, None].expand(B, H_kv, G, S, values.shape[3]).reshape(B, H_kv * G, S, values.shape[3])
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None, None, :], scale=scale)


def _sdpa_gqa(query, keys, values, scale):
    """sdpa with ``enable_gqa=True`` and no mask: no K/V copies (needs torch >= 2.5)."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)


def benchmark(
    batches: Sequence[int] = (1, 16, 32),
    seq: int = 2176,
    h_q: int = 32,
    h_kv: int = 8,
    head_dim: int = 128,
    capacity: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    sweep_splits: Sequence[int] = (1, 2, 4, 8, 16, 34, 68),
) -> list[dict]:
    """Time the kernel against masked sdpa (transformers' path) and mask-free ``enable_gqa`` sdpa on CUDA.

    Keys and values are ``[:, :, :seq]`` views of a ``capacity``-slot arena, as the cache holds them.
    Each row gives µs per call launched eagerly (``triton.testing.do_bench``: includes the host's launch
    cost) and replayed in a CUDA graph (``do_bench_cudagraph``: what a graphed decode step pays), and
    the bandwidth of the K/V bytes the kernel must read (scales included for int8) over the graph time.
    ``sweep_splits`` adds rows for fixed split counts at the first batch size. The Triton rows are
    checked against the reference first (a wrong kernel's timing is worthless).
    """
    from functools import partial

    from triton.testing import do_bench, do_bench_cudagraph

    rows = []
    scale = 1.0 / math.sqrt(head_dim)
    for B in batches:
        gen = torch.Generator(device="cuda").manual_seed(B)
        arena_k = torch.randn(B, h_kv, capacity, head_dim, device="cuda", generator=gen).to(dtype)
        arena_v = torch.randn(B, h_kv, capacity, head_dim, device="cuda", generator=gen).to(dtype)
        (kq, k_scale), (vq, v_scale) = quantize_kv(arena_k), quantize_kv(arena_v)
        k, v, kq, vq = (t[:, :, :seq] for t in (arena_k, arena_v, kq, vq))
        k_scale, v_scale = k_scale[:, :, :seq], v_scale[:, :, :seq]
        q = torch.randn(B, h_q, 1, head_dim, device="cuda", generator=gen).to(dtype)
        mask = torch.ones(B, seq, dtype=torch.bool, device="cuda")
        mask[B // 2:, : seq // 8] = False  # holes in front of the kept tokens in half the rows
        out = torch.empty(B, h_q, 1, head_dim, device="cuda", dtype=dtype)
        float_bytes = B * h_kv * seq * 2 * head_dim * k.element_size()
        int8_bytes = B * h_kv * seq * 2 * (head_dim + 4)
        attend = partial(decode_attention, q, scale=scale, out=out)
        int8_args = (kq, vq, mask)
        int8_kw = {"key_scale": k_scale, "value_scale": v_scale}
        cases = [  # name, K/V bytes, function, reference arguments (None: not checked)
            ("triton", float_bytes, partial(attend, k, v, mask), ((k, v, mask), {})),
            ("triton_int8", int8_bytes, partial(attend, *int8_args, **int8_kw), (int8_args, int8_kw)),
            ("sdpa_masked_repeat_kv", float_bytes, partial(_sdpa_repeat_kv, q, k, v, mask, scale), None),
            ("sdpa_gqa_nomask", float_bytes, partial(_sdpa_gqa, q, k, v, scale), None),
        ]
        if B == batches[0]:
            cases += [
                (f"triton_splits{n}", float_bytes, partial(attend, k, v, mask, num_splits=n), ((k, v, mask), {}))
                for n in sweep_splits
            ]
        for name, nbytes, fn, check in cases:
            if check is not None:
                out.fill_(float("nan"))
                fn()
                ref = decode_attention_reference(q, *check[0], scale=scale, **check[1])
                err = (out.float() - ref.float()).abs().max().item()
                if not err < 0.02:
                    raise AssertionError(f"{name} at B={B}: max error {err:.3g} against the reference")
            us = do_bench(fn) * 1e3
            graph_us = do_bench_cudagraph(fn) * 1e3
            rows.append({
                "name": name, "batch": B, "seq": seq, "h_q": h_q, "h_kv": h_kv, "head_dim": head_dim,
                "dtype": str(dtype), "us": round(us, 2), "graph_us": round(graph_us, 2),
                "gb_per_s": round(nbytes / graph_us / 1e3, 1), "bytes": nbytes,
            })
            print(f"{name:>24} B={B:<3} S={seq:<6} {us:9.2f} us eager  {graph_us:9.2f} us graphed  "
                  f"{rows[-1]['gb_per_s']:8.1f} GB/s  (x36 layers: {graph_us * 36 / 1e3:.3f} ms)")
    return rows


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark decode_attention against sdpa (needs a CUDA GPU).")
    parser.add_argument("--out", required=True, help="JSON file to write the numbers to")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--seq", type=int, default=2176, help="kept slots S")
    parser.add_argument("--h-q", type=int, default=32)
    parser.add_argument("--h-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m hf_ropekv.kernels.attention --out results.json``: run :func:`benchmark`, write JSON."""
    args = _parse_args(argv)
    if not (HAS_TRITON and torch.cuda.is_available()):
        raise SystemExit("the decode_attention benchmark needs Triton and a CUDA GPU")
    rows = benchmark(args.batch, args.seq, args.h_q, args.h_kv, args.head_dim)
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
