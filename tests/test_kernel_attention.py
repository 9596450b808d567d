"""Split-KV decode attention: Triton kernel == PyTorch reference == masked sdpa, and int8 / fp8 K/V.

The first set runs the kernels under Triton's interpreter on CPU tensors (also on a CUDA host); the
``gpu`` set runs them compiled at Qwen3-8B sizes, in a CUDA graph and under ``torch.compile``.

Tolerances (inputs ~ N(0, 1), so outputs are averages of unit-scale values, |out| < ~4):
float32 ``1e-5``; float16 ``2e-3`` and bfloat16 ``1.6e-2`` absolute plus the same relative: the
kernel rounds its output to the query dtype (half a unit in the last place: 2**-9 and 2**-7 of the
magnitude at [2, 4) for fp16 / bf16) and, like flash attention, rounds the softmax weights P to
that dtype before the P @ V product (another half unit, relative, per weight).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hf_ropekv.kernels import attention as kattn
from hf_ropekv.kernels.quantize import QUANT_DTYPES, dequantize_kv, quantize_kv

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
BLOCK_N = 64  # the kernel's slot tile for head_dim <= 128: the S below are not multiples of it


@pytest.fixture
def interpreted(triton_interpreter, monkeypatch):
    """conftest's ``triton_interpreter`` plus interpreted twins of this module's kernels (on CUDA hosts)."""
    from triton.runtime.interpreter import InterpretedFunction

    for name in ("_attention_split_kernel", "_attention_combine_kernel"):
        function = getattr(kattn, name)
        if not isinstance(function, InterpretedFunction):
            monkeypatch.setattr(kattn, name, InterpretedFunction(function.fn))


def _gen(device: str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    print("seed", gen.seed())  # fresh random inputs on every run; pytest shows the seed of a failure
    return gen


def _arena_view(shape, dtype, gen, layout: str = "bhsd", capacity: int | None = None, device: str = "cpu"):
    """A [B, H, S, D] view ``[:, :, :S]`` of a larger arena; slots past S hold NaN (must never be read).

    ``layout`` is the storage order: ``bhsd`` (the cache's), ``hbsd`` (batch stride below head stride)
    or ``bshd`` (token-major, like transformers' projections).
    """
    B, H, S, D = shape
    C = capacity or S + 19
    order = {"bhsd": (B, H, C, D), "hbsd": (H, B, C, D), "bshd": (B, C, H, D)}[layout]
    arena = torch.full(order, float("nan"), dtype=torch.float32, device=device)
    if layout == "hbsd":
        arena = arena.transpose(0, 1)
    elif layout == "bshd":
        arena = arena.transpose(1, 2)
    arena[:, :, :S] = torch.randn(B, H, S, D, generator=gen, device=device)
    return arena.to(dtype)[:, :, :S] if dtype != torch.float32 else arena[:, :, :S]


def _mask(B: int, S: int, kind: str | None, gen, device: str = "cpu"):
    """bool [B, S] (a view with row stride > S) of one kind; None for ``kind=None``."""
    if kind is None:
        return None
    j = torch.arange(S, device=device)
    lead = torch.randint(0, S // 2 + 1, (B, 1), generator=gen, device=device)
    lead[0] = 0  # one row without holes in front
    mask = j[None, :] >= lead  # left padding / holes in front of each row's kept tokens
    if kind == "holes":
        mask &= torch.rand(B, S, generator=gen, device=device) > 0.3
    elif kind == "band":  # a sliding window ending before S on some rows
        width = torch.randint(8, S // 2 + 8, (B, 1), generator=gen, device=device)
        end = S - torch.randint(0, 16, (B, 1), generator=gen, device=device)
        mask = (j[None, :] < end) & (j[None, :] >= end - width)
    elif kind == "empty_row":
        mask[-1] = False
    wide = torch.zeros(B, S + 7, dtype=torch.bool, device=device)
    wide[:, 3:3 + S] = mask
    return wide[:, 3:3 + S]


def _poison_holes(t: torch.Tensor, mask) -> None:
    """NaN (or for int8 storage, nothing) in masked slots: the kernel must not read them."""
    if mask is not None and t.is_floating_point():
        t.masked_fill_(~mask[:, None, :, None], float("nan"))


def _sdpa(q, k, v, mask, scale):
    """Independent float32 oracle: transformers' path (repeat_kv + boolean mask + sdpa), NaN rows where none is
    valid."""
    G = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(G, dim=1)
    v = v.float().repeat_interleave(G, dim=1)
    attn_mask = None
    if mask is not None:  # holes hold NaN here: sdpa adds -inf to NaN logits, so clear them first
        hole = ~mask[:, None, :, None]
        k, v = k.masked_fill(hole, 0.0), v.masked_fill(hole, 0.0)
        attn_mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=attn_mask, scale=scale)
    return out[:, :, 0]


def _assert_close(got, want, dtype, what):
    tol = TOL[dtype]
    err = (got.float() - want.float()).abs()
    bound = tol + tol * want.float().abs()
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3g} (tolerance {tol:g} abs + rel)"
    return err.max().item()


def _run(q, k, v, mask, *, scale, strided_out=False, **kw):
    """The kernel into a NaN-poisoned ``out`` (optionally a strided view), checked to write exactly ``out``."""
    B, H_q, Dv = q.shape[0], q.shape[1], v.shape[-1]
    if strided_out:  # [B, H_q, Dv] inside a wider buffer, heads outermost
        wide = torch.full((H_q, B, Dv + 5), float("nan"), dtype=q.dtype)
        out = wide.transpose(0, 1)[..., :Dv]
    else:
        out = torch.full((B, H_q, Dv), float("nan"), dtype=q.dtype)
    if q.dim() == 4:
        out = out[:, :, None]
    got = kattn.decode_attention(q, k, v, mask, scale=scale, out=out, **kw)
    assert got is out
    assert torch.isfinite(out).all(), "kernel left elements of out unwritten"
    if strided_out:
        assert torch.isnan(wide[..., Dv:]).all(), "kernel wrote outside out"
    return out


CASES = [
    # H_q, H_kv, D, Dv, dtype, S, num_splits, mask kind, layout
    (2, 2, 64, 64, torch.float32, 77, None, "left", "bhsd"),  # MHA (G=1)
    (8, 2, 128, 128, torch.bfloat16, 150, 1, "holes", "bshd"),  # GQA 4, one program per (row, head)
    (8, 2, 128, 128, torch.float16, 150, 3, "band", "hbsd"),  # split 3 ways
    (7, 1, 80, 80, torch.bfloat16, 100, 8, "left", "bhsd"),  # G=7, D=80; 8 splits over 2 tiles: 6 empty
    (8, 1, 64, 64, torch.float16, 33, None, None, "bhsd"),  # MQA with G=8, no mask, one partial tile
    (4, 2, 80, 48, torch.float32, 129, 2, "holes", "hbsd"),  # non-power D and Dv, different
    (10, 2, 64, 64, torch.bfloat16, 200, 4, "band", "bshd"),  # G=5
    (16, 1, 64, 64, torch.bfloat16, 128, None, "empty_row", "bhsd"),  # G=16, S a multiple of the tile
    (12, 2, 96, 96, torch.float32, 65, 2, "empty_row", "bshd"),  # G=6, D=96; a row without valid slots
]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("H_q,H_kv,D,Dv,dtype,S,num_splits,mask_kind,layout", CASES)
def test_kernel_matches_reference_and_sdpa(H_q, H_kv, D, Dv, dtype, S, num_splits, mask_kind, layout):
    gen = _gen()
    B = 3
    q = torch.randn(B, H_q, D, generator=gen).to(dtype)
    k = _arena_view((B, H_kv, S, D), dtype, gen, layout)
    v = _arena_view((B, H_kv, S, Dv), dtype, gen, layout)
    mask = _mask(B, S, mask_kind, gen)
    _poison_holes(k, mask)
    _poison_holes(v, mask)
    scale = 1.0 / math.sqrt(D)
    out = _run(q, k, v, mask, scale=scale, num_splits=num_splits, strided_out=layout == "hbsd")
    ref = kattn.decode_attention_reference(q, k, v, mask, scale=scale)
    err = _assert_close(out, ref, dtype, "kernel vs reference")
    sdpa = _sdpa(q, k, v, mask, scale)
    rows = mask.any(dim=1) if mask is not None else torch.ones(B, dtype=torch.bool)
    err_sdpa = _assert_close(out[rows], sdpa[rows], dtype, "kernel vs sdpa")
    assert (out[~rows] == 0).all(), "a row without valid slots must output zeros"
    print(f"max error vs reference {err:.3g}, vs sdpa {err_sdpa:.3g}")


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(dtype):
    gen = _gen()
    B, H_q, H_kv, S, D = 2, 4, 2, 90, 64
    q = (3 * torch.randn(B, H_q, 1, D, generator=gen)).to(dtype)  # large logits: the cap matters
    k = _arena_view((B, H_kv, S, D), dtype, gen)
    v = _arena_view((B, H_kv, S, D), dtype, gen)
    mask = _mask(B, S, "holes", gen)
    _poison_holes(k, mask)
    out = _run(q, k, v, mask, scale=D**-0.5, softcap=2.0, num_splits=2)  # 4-D query and out
    ref = kattn.decode_attention_reference(q, k, v, mask, scale=D**-0.5, softcap=2.0)
    err = _assert_close(out, ref, dtype, "kernel vs reference")
    uncapped = kattn.decode_attention_reference(q, k, v, mask, scale=D**-0.5)
    assert (uncapped.float() - ref.float()).abs().max() > 10 * TOL[dtype], "softcap did not change the result"
    print(f"softcap max error {err:.3g}")


QUANT_CASES = [
    # H_q, H_kv, D, query dtype, storage dtype, S, num_splits
    (8, 2, 128, torch.bfloat16, torch.int8, 150, 3),
    (12, 2, 64, torch.float32, torch.int8, 70, None),
    (8, 8, 64, torch.float16, torch.int8, 40, 1),
]
if hasattr(torch, "float8_e4m3fn"):
    QUANT_CASES.append((8, 2, 128, torch.bfloat16, torch.float8_e4m3fn, 100, 2))


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("H_q,H_kv,D,dtype,qdtype,S,num_splits", QUANT_CASES)
def test_quantized_kv(H_q, H_kv, D, dtype, qdtype, S, num_splits):
    gen = _gen()
    B = 2
    q = torch.randn(B, H_q, D, generator=gen).to(dtype)
    mask = _mask(B, S, "holes", gen)
    # Quantize whole arenas, then take the [:, :, :S] views, as a cache would hold them.
    kq, ks = quantize_kv(torch.randn(B, H_kv, S + 9, D, generator=gen), qdtype)
    vq, vs = quantize_kv(torch.randn(B, H_kv, S + 9, D, generator=gen), qdtype)
    for scales in (ks, vs):
        scales[:, :, S:] = float("nan")  # past S and in holes: never read
        scales[:, :, :S].masked_fill_(~mask[:, None, :], float("nan"))
    kq, vq, ks, vs = kq[:, :, :S], vq[:, :, :S], ks[:, :, :S], vs[:, :, :S]
    scale = D**-0.5
    out = _run(q, kq, vq, mask, scale=scale, key_scale=ks, value_scale=vs, num_splits=num_splits)
    ref = kattn.decode_attention_reference(q, kq, vq, mask, scale=scale, key_scale=ks, value_scale=vs)
    err = _assert_close(out, ref, dtype, "kernel vs reference")
    # Independently: plain float32 attention on the dequantized tensors.
    k32 = dequantize_kv(kq, torch.nan_to_num(ks))
    v32 = dequantize_kv(vq, torch.nan_to_num(vs))
    deq = kattn.decode_attention_reference(q.float(), k32, v32, mask, scale=scale)
    _assert_close(out, deq, dtype, "kernel vs reference on dequantized K/V")
    _assert_close(out, _sdpa(q, k32, v32, mask, scale), dtype, "kernel vs sdpa on dequantized K/V")
    print(f"{qdtype} max error {err:.3g}")


@pytest.mark.parametrize("qdtype", list(QUANT_DTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip(qdtype, dtype):
    gen = _gen()
    x = (torch.randn(2, 3, 50, 80, generator=gen) * torch.rand(2, 3, 50, 1, generator=gen) * 5).to(dtype)
    x[0, 0, 7] = 0.0  # an all-zero vector quantizes to zeros
    q, scale = quantize_kv(x, qdtype)
    assert q.dtype == qdtype and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:3] and (scale > 0).all()
    back = dequantize_kv(q, scale, torch.float32)
    err = (back - x.float()).abs()
    if qdtype == torch.int8:
        assert q.abs().max() == 127  # absmax maps to +-127
        # scale / 2, plus the float32 rounding of x / scale and q * scale (a few units of x's last place)
        assert (err <= scale[..., None] / 2 + x.float().abs() * 2**-21).all(), "int8 round trip beyond scale / 2"
    else:  # 3 mantissa bits: relative 2**-4, or half the smallest subnormal step (2**-10 of the scale)
        assert (err <= x.float().abs() * 2**-4 + scale[..., None] * 2**-10).all()
    assert (back[0, 0, 7] == 0).all()
    assert dequantize_kv(q, scale, dtype).dtype == dtype


@pytest.mark.usefixtures("interpreted")
def test_edge_shapes():
    gen = _gen()
    q = torch.randn(2, 4, 64, generator=gen)
    empty = torch.randn(2, 2, 0, 64)
    out = _run(q, empty, empty, torch.zeros(2, 0, dtype=torch.bool), scale=0.125, num_splits=1)
    assert (out == 0).all()
    assert kattn.decode_attention(q[:0], empty[:0], empty[:0], scale=0.125).shape == (0, 4, 64)
    assert kattn._block_n(128, 128) == BLOCK_N  # the S above are chosen against this tile


@pytest.mark.usefixtures("interpreted")
def test_a_rows_bits_depend_on_neither_the_batch_nor_the_arena_length():
    """With the default splits, row 0 alone, in a batch of 6, and over an arena 8x longer (the extra slots masked and
    holding NaN) gets the same bits: a growing cache's live view and a static cache's arena must give one token."""
    gen = _gen()
    B, H_q, H_kv, D, S = 6, 8, 4, 64, 3 * BLOCK_N + 17
    q = torch.randn(B, H_q, D, generator=gen)
    k, v = torch.randn(2, B, H_kv, S, D, generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.2
    batch = _run(q, k, v, mask, scale=D**-0.5)
    alone = _run(q[:1], k[:1], v[:1], mask[:1], scale=D**-0.5)
    long_k, long_v = torch.full((2, B, H_kv, 8 * S, D), float("nan"))
    long_k[:, :, :S], long_v[:, :, :S] = k, v
    long_mask = torch.zeros(B, 8 * S, dtype=torch.bool)
    long_mask[:, :S] = mask
    longer = _run(q, long_k, long_v, long_mask, scale=D**-0.5)
    assert torch.equal(alone[0], batch[0]) and torch.equal(longer, batch)


def test_argument_errors():
    q = torch.randn(2, 4, 64)
    k = torch.randn(2, 2, 10, 64)
    ref = kattn.decode_attention_reference
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ref(torch.randn(2, 3, 64), k, k, scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        ref(q, k[..., :32], k[..., :32], scale=1.0)
    with pytest.raises(ValueError, match="one token"):
        ref(q[:, :, None].expand(2, 4, 2, 64), k, k, scale=1.0)
    with pytest.raises(ValueError, match="need key_scale"):
        ref(q, k.to(torch.int8), k.to(torch.int8), scale=1.0)
    with pytest.raises(ValueError, match="must be the query's"):
        ref(q, k.half(), k.half(), scale=1.0)
    with pytest.raises(ValueError, match="mask must be bool"):
        ref(q, k, k, torch.ones(2, 10), scale=1.0)
    with pytest.raises(ValueError, match="out must be"):
        ref(q, k, k, scale=1.0, out=torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="softcap"):
        ref(q, k, k, scale=1.0, softcap=0.0)
    with pytest.raises(ValueError, match="key_scale/value_scale are only"):
        ref(q, k, k, scale=1.0, key_scale=torch.ones(2, 2, 10))


# --------------------------------------------------------------------------- GPU (compiled kernels)

GPU_SHAPE = {"H_q": 32, "H_kv": 8, "D": 128}  # Qwen3-8B


def _gpu_inputs(B, S, gen, storage="bf16", device="cuda"):
    """Qwen3-8B-shaped inputs: arena views, NaN past S and in the holes, the last row fully masked (B > 1)."""
    H_q, H_kv, D = GPU_SHAPE["H_q"], GPU_SHAPE["H_kv"], GPU_SHAPE["D"]
    q = torch.randn(B, H_q, 1, D, generator=gen, device=device).bfloat16()
    k = _arena_view((B, H_kv, S, D), torch.bfloat16, gen, capacity=2304, device=device)
    v = _arena_view((B, H_kv, S, D), torch.bfloat16, gen, capacity=2304, device=device)
    mask = _mask(B, S, "holes" if B == 1 else "empty_row", gen, device=device)
    extra = {}
    if storage != "bf16":
        qdtype = torch.int8 if storage == "int8" else torch.float8_e4m3fn
        (k, ks), (v, vs) = quantize_kv(k, qdtype), quantize_kv(v, qdtype)
        extra = {"key_scale": ks, "value_scale": vs}
    else:
        _poison_holes(k, mask)
        _poison_holes(v, mask)
    return q, k, v, mask, extra


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("S", [2176, 33])
@pytest.mark.parametrize("B", [1, 4, 32])
def test_gpu_matches_reference(B, S, storage):
    gen = _gen("cuda")
    q, k, v, mask, extra = _gpu_inputs(B, S, gen, storage)
    scale = GPU_SHAPE["D"] ** -0.5
    ref = kattn.decode_attention_reference(q, k, v, mask, scale=scale, **extra)
    for num_splits in (None, 1, 7):
        out = torch.full_like(ref, float("nan"))
        kattn.decode_attention(q, k, v, mask, scale=scale, out=out, num_splits=num_splits, **extra)
        err = _assert_close(out, ref, torch.bfloat16, f"num_splits={num_splits}")
        print(f"B={B} S={S} {storage} num_splits={num_splits}: max error {err:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_gpu_cuda_graph_replay(storage):
    gen = _gen("cuda")
    B, S = 4, 2176
    q, k, v, mask, extra = _gpu_inputs(B, S, gen, storage)
    scale = GPU_SHAPE["D"] ** -0.5
    out = torch.empty(B, GPU_SHAPE["H_q"], 1, GPU_SHAPE["D"], device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels before capture
        kattn.decode_attention(q, k, v, mask, scale=scale, out=out, **extra)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kattn.decode_attention(q, k, v, mask, scale=scale, out=out, **extra)
    # New values in the same buffers: the replay must compute the new result.
    q2, k2, v2, mask2, extra2 = _gpu_inputs(B, S, gen, storage)
    for dst, src in [(q, q2), (k, k2), (v, v2), (mask, mask2)] + [(extra[n], extra2[n]) for n in extra]:
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = kattn.decode_attention_reference(q, k, v, mask, scale=scale, **extra)
    _assert_close(out, ref, torch.bfloat16, "graph replay")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph(fresh_dynamo):
    gen = _gen("cuda")
    q, k, v, mask, _ = _gpu_inputs(2, 300, gen)

    def step(q, k, v, mask):
        return kattn.decode_attention(q * 1.0, k, v, mask, scale=0.088) + 1.0

    kattn.register_op()  # what a static cache that compiles does, eagerly, before generate compiles
    compiled = torch.compile(step, fullgraph=True)  # fails on a graph break
    _assert_close(compiled(q, k, v, mask), step(q, k, v, mask), torch.bfloat16, "compiled vs eager")


@pytest.mark.parametrize("balanced", [False, True], ids=["plain", "balanced"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_into_matches_quantize_kv_at_the_index(dtype, balanced, triton_interpreter, monkeypatch):
    """The fused write of a static int8 arena gives quantize_kv's codes and scales (of ``x / balance`` with a
    balance), at exactly the given slots."""
    from triton.runtime.interpreter import InterpretedFunction

    from hf_ropekv.kernels import quantize as kq

    if not isinstance(kq._quantize_into_kernel, InterpretedFunction):
        monkeypatch.setattr(kq, "_quantize_into_kernel", InterpretedFunction(kq._quantize_into_kernel.fn))
    gen = _gen()
    x = (torch.randn(2, 3, 5, 80, generator=gen) * 4).to(dtype)
    x[0, 1, 2] = 0  # a token-head of zeros: codes 0, the smallest scale
    index = torch.randperm(12, generator=gen)[:5]
    codes = torch.full((2, 3, 12, 80), 99, dtype=torch.int8)  # poison
    scale = torch.full((2, 3, 12, 1), float("nan"))
    balance = torch.rand(2, 3, 1, 80, generator=gen) + 1e-3 if balanced else None
    B, H, q, D = x.shape
    flat = scale.view(2, 3, 12)
    kq._quantize_into_kernel[(q, H, B)](x, codes, flat, index, x if balance is None else balance, *x.stride()[:3],
                                        *((0, 0) if balance is None else balance.stride()[:2]), *codes.stride()[:3],
                                        *flat.stride(), D=D, BLOCK_D=128, HAS_BALANCE=balanced, num_warps=1)
    want_codes, want_scale = quantize_kv(x if balance is None else x.float() / balance)
    assert torch.equal(codes[:, :, index], want_codes) and torch.equal(flat[:, :, index], want_scale)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[index] = False
    assert (codes[:, :, untouched] == 99).all() and flat[:, :, untouched].isnan().all()
