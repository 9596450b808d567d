"""Split-KV (flash-decoding) attention of one query token over the cache's kept slots, and its PyTorch twin.

For ``q`` [B, H_q, D], keys / values [B, H_kv, S, D] / [B, H_kv, S, Dv] with ``H_q = G * H_kv`` (query head ``h``
reads KV head ``h // G``, transformers' ``repeat_kv`` order) and ``mask`` bool [B, S] (True = attend: sdpa's
``mask4d[:, 0, 0, :]`` of one query token, with left padding, holes and sliding windows)::

    x[b, h, s]   = scale * <q[b, h], k[b, h // G, s]>
    x[b, h, s]   = softcap * tanh(x[b, h, s] / softcap)             (Gemma-2 soft-capping, when given)
    x[b, h, s]   = -inf  where not mask[b, s]
    out[b, h]    = softmax_s(x[b, h]) @ v[b, h // G]

A row without any valid slot outputs zeros (sdpa would give NaN). Masked slots are never read, so holes may hold
garbage. Keys and values are in the query's dtype, or int8 / float8_e4m3fn with one float32 scale per (row, head,
token): ``k = k_q * key_scale[..., None]`` (``quantize.py``).

Decoding is memory-bound. Grid ``(num_splits, H_kv, B)``: a program walks one chunk of the slots in tiles of
``BLOCK_N`` and reads each tile once for all ``G`` query heads of its KV head (a ``[G_PAD, D]`` query tile through
``tl.dot``), with an online softmax in float32 (running max ``m``, sum ``l``, unnormalized ``acc``). Splitting S
fills the GPU at batch 1 (B * H_kv = 8 programs would leave 124 of 132 SMs idle); a second kernel merges the splits'
``(m, l, acc)`` with log-sum-exp weights. With one split the first kernel writes the output itself. Splits are
``SPLIT_TILES`` tiles long whatever the batch and arena, so the result of a row is the same bits in any batch and
over any arena holding the same live slots.

It is the torch op ``hf_ropekv::decode_attention`` once :func:`register_op` ran (``torch.compile`` traces through
it), and never syncs (CUDA-graph capturable). Benchmark: ``benchmarks/kernel_bench.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._triton import FLOAT_DTYPES, HAS_TRITON, check_device, interpreting, tl, triton
from .quantize import QUANT_DTYPES

__all__ = ["check_decode_args", "decode_attention", "decode_attention_reference", "register_op"]


def check_decode_args(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
                      key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, softcap: float | None = None,
                      num_splits: int | None = None) -> None:
    """Raise ``ValueError`` naming the problem unless the arguments fit :func:`decode_attention`'s contract."""
    if query.dim() not in (3, 4) or (query.dim() == 4 and query.shape[2] != 1):
        raise ValueError(f"query must be [B, H_q, D] or [B, H_q, 1, D] (one token), got shape {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    if keys.dim() != 4 or values.dim() != 4:
        raise ValueError(f"keys and values must be [B, H_kv, S, D], got shapes {tuple(keys.shape)} and "
                         f"{tuple(values.shape)}")
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
        raise ValueError(f"keys/values dtype {keys.dtype} must be the query's ({query.dtype}) or one of "
                         f"{list(QUANT_DTYPES)}")
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
    def _attention_split_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, mask_ptr, ws_ptr, out_ptr,
        S, CHUNK, ML_OFFSET, scale, softcap,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd, stride_ksb, stride_ksh, stride_kss,
        stride_vsb, stride_vsh, stride_vss, stride_mb, stride_ms, stride_ob, stride_oh, stride_od,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_MASK: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
        F32_DOT: tl.constexpr, DIRECT: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        # One program: one batch row, one KV head, one chunk of CHUNK slots, all G query heads.
        # float32 scalars: under torch.compile inductor passes Python floats as fp64, which would promote m_i.
        scale = tl.cast(scale, tl.float32)
        softcap = tl.cast(softcap, tl.float32)
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
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # padded rows: zeros, never stored
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
            k = tl.load(k_base + rows[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
            v = tl.load(v_base + rows[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                        mask=valid[:, None] & mask_dv[None, :], other=0.0)
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
    def _attention_combine_kernel(
        ws_ptr, out_ptr, NUM_SPLITS, ML_OFFSET, stride_ob, stride_oh, stride_od,
        DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
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


# Plain helpers for the launcher: triton.cdiv / next_power_of_2 cost ~4 us a call from Python (Triton 3.9).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_n(D: int, Dv: int) -> int:
    """Slots per tile for head dims ``D`` / ``Dv``: 64 (16 KB bf16 K tiles at head_dim 128), 32 above head_dim 128 to
    bound shared memory."""
    return 64 if _next_pow2(max(D, Dv)) <= 128 else 32


#: Tiles per split when the caller names no split count. Fixed, so a row's result depends on neither the batch size
#: nor the arena's length: splits past the live slots are empty and merge as exact zeros, so a growing cache's live
#: view, a static cache's longer arena and any batch give each row the same bits. Two tiles: 17 splits of a
#: 2,176-slot arena, 136 programs per KV head count at batch 1 (one wave on 132 SMs).
SPLIT_TILES = 2
#: Splits the combine kernel merges per pass, fixed for the same reason (a reduction's shape sets its rounding).
COMBINE_SPLITS = 32


# The op's schema is inferred from these annotations: Optional, which older torch knows (not ``X | None``).
def _decode_impl(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor],
                 scale: float, softcap: Optional[float], key_scale: Optional[torch.Tensor],
                 value_scale: Optional[torch.Tensor], out: torch.Tensor, num_splits: int) -> None:
    """The op's body: checked 3-D ``query`` [B, H_q, D] and ``out`` [B, H_q, Dv]; writes ``out``."""
    B, H_q, D = query.shape
    _, H_kv, S, Dv = values.shape
    G = H_q // H_kv
    block_d = max(16, _next_pow2(D))
    block_dv = max(16, _next_pow2(Dv))
    block_n = _block_n(D, Dv)
    chunk = _cdiv(_cdiv(S, block_n), num_splits) * block_n
    quant = keys.dtype != query.dtype
    direct = num_splits == 1
    if direct:
        ws, ml_offset = query, 0  # unused; not out, which torch.compile must see passed (and written) once
    else:
        parts = B * H_q * num_splits
        ws = torch.empty(parts * (Dv + 2), dtype=torch.float32, device=query.device)
        ml_offset = parts * Dv
    # The bool mask goes in as it is (Triton loads ``*i1``): a ``view(torch.uint8)`` is a dtype view that
    # inductor cannot lower, so the compiled step failed on it.
    mask_arg = query if mask is None else mask
    ks, vs = (key_scale, value_scale) if quant else (query, query)  # unused pointers when not quantized
    ks_strides, vs_strides = (ks.stride(), vs.stride()) if quant else ((0, 0, 0), (0, 0, 0))
    m_strides = mask_arg.stride() if mask is not None else (0, 0)
    _for_compile(_attention_split_kernel)[(num_splits, H_kv, B)](
        query, keys, values, ks, vs, mask_arg, ws, out,
        S, chunk, ml_offset, scale, 1.0 if softcap is None else softcap,
        *query.stride(), *keys.stride(), *values.stride(), *ks_strides, *vs_strides, *m_strides, *out.stride(),
        G=G, G_PAD=max(16, _next_pow2(G)), D=D, DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=block_n,
        HAS_MASK=mask is not None, QUANT=quant, SOFTCAP=softcap is not None,
        # float32 dots (IEEE, not TF32) for float32 queries, and in the interpreter, whose tl.dot multiplies
        # bf16 bit patterns as integers (Triton 3.9); the products are the same: bf16 x bf16 is exact in fp32.
        F32_DOT=query.dtype == torch.float32 or interpreting(),
        DIRECT=direct, NUM_STAGES=2, num_warps=4)
    if not direct:
        _for_compile(_attention_combine_kernel)[(H_q, B)](
            ws, out, num_splits, ml_offset, *out.stride(),
            DV=Dv, BLOCK_DV=block_dv, BLOCK_SPLITS=COMBINE_SPLITS, num_warps=4)


#: The torch op ``hf_ropekv::decode_attention``, once :func:`register_op` made it (registering imports inductor,
#: seconds a process that never compiles need not pay: eager steps and CUDA graphs call the implementation).
_OP = None


def register_op() -> None:
    """Register the kernel as a torch op so ``torch.compile`` traces through it (call it eagerly, before compiling)."""
    global _OP
    if _OP is None and HAS_TRITON and hasattr(torch.library, "triton_op"):
        _OP = torch.library.triton_op("hf_ropekv::decode_attention", _decode_impl, mutates_args={"out"})


def _for_compile(kernel):
    """``kernel`` as torch.compile sees it inside the registered op (as it is elsewhere, and when interpreted)."""
    if _OP is None or interpreting():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
                     *, scale: float, softcap: float | None = None, key_scale: torch.Tensor | None = None,
                     value_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """Attention of one query token per row over ``keys`` / ``values`` with the Triton kernels (see the module).

    ``query`` [B, H_q, D] or [B, H_q, 1, D] (fp16/bf16/fp32); ``keys`` / ``values`` any strides (views of a larger
    arena); ``key_scale`` / ``value_scale`` float32 [B, H_kv, S] for quantized ones; ``mask`` None: all valid.
    Returns (or fills ``out``, any strides) [B, H_q, Dv] in the query's dtype and rank. ``num_splits`` (None: chunks
    of ``SPLIT_TILES`` tiles) is the chunks per (row, KV head). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
    """
    check_decode_args(query, keys, values, mask, key_scale, value_scale, out, softcap, num_splits)
    check_device("decode_attention", query)
    B, H_q, D = query.shape[0], query.shape[1], query.shape[-1]
    _, H_kv, S, Dv = values.shape
    if out is None:
        out = torch.empty((B, H_q, Dv) if query.dim() == 3 else (B, H_q, 1, Dv), dtype=query.dtype, device=query.device)
    if B == 0 or H_q == 0 or Dv == 0:
        return out
    if num_splits is None:
        num_splits = max(1, _cdiv(_cdiv(S, _block_n(D, Dv)), SPLIT_TILES))
    squeeze = query.dim() == 4
    (_OP or _decode_impl)(
        query[:, :, 0] if squeeze else query, keys, values, mask, float(scale),
        None if softcap is None else float(softcap), key_scale, value_scale,
        out[:, :, 0] if squeeze else out, int(num_splits))
    return out


# --------------------------------------------------------------------------- PyTorch twin


def decode_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               mask: torch.Tensor | None = None, *, scale: float, softcap: float | None = None,
                               key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None,
                               out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
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
    return result.to(query.dtype) if out is None else out.copy_(result)
