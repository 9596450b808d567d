"""Triton scoring kernel == PyTorch reference, run by Triton's interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

from hf_ropekv.kernels import score as kscore
from hf_ropekv.scorers.rope_scoring import query_weights, score_keys, score_keys_weighted

# The kernel runs under Triton's interpreter on CPU tensors, also on a CUDA host (conftest.triton_interpreter).
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _gen() -> torch.Generator:
    gen = torch.Generator()
    print("seed", gen.seed())  # fresh random inputs on every run; pytest shows the seed of a failure
    return gen


def _weights(B_w: int, H_q: int, F: int, gen: torch.Generator):
    w = torch.randn(B_w, H_q, 2 * F, generator=gen)
    c = torch.rand(H_q, F, generator=gen)
    c[:, ::3] = 0.0  # clamped pairs, as real statistics have
    return w, c


def _check(keys, w, c, pair_stride=None, imag_offset=None, **kw):
    layout = dict(pair_stride=pair_stride, imag_offset=imag_offset)
    out = torch.full((keys.shape[0], c.shape[-2], keys.shape[2]), float("nan"))  # poison
    got = kscore.score_keys_triton(keys, w, c, out=out, **layout, **kw)
    assert got is out
    assert torch.isfinite(out).all(), "kernel left elements unwritten"
    ref = kscore.score_keys_reference(keys, w, c, out=torch.full_like(out, float("nan")), **layout)
    assert torch.isfinite(ref).all(), "the PyTorch twin left elements unwritten"
    scale = kscore.score_keys_reference(keys.abs(), w.abs(), c, **layout)  # size of the summed terms
    err = ((out - ref).abs() / scale.clamp_min(1e-20)).max().item()
    assert err < 1e-5, f"max relative error {err:.3g}"


CASES = [
    # H_q, H_kv, D, rotary_dim, dtype
    (4, 2, 64, 64, torch.float16),
    (4, 2, 64, 64, torch.bfloat16),
    (4, 2, 64, 64, torch.float32),
    (8, 2, 128, 128, torch.float16),
    (8, 2, 128, 128, torch.bfloat16),
    (6, 2, 128, 128, torch.float32),  # GQA 3
    (2, 2, 128, 64, torch.bfloat16),  # partial rotary: dims >= 2F not scored
    (2, 1, 256, 256, torch.bfloat16),
]


@pytest.mark.parametrize("H_q,H_kv,D,rotary_dim,dtype", CASES)
def test_kernel_matches_reference(H_q, H_kv, D, rotary_dim, dtype):
    gen = _gen()
    B, S = 2, 45  # S not a multiple of the slot block
    keys = torch.randn(B, H_kv, S, D, generator=gen).to(dtype)
    w, c = _weights(B, H_q, rotary_dim // 2, gen)
    _check(keys, w, c, block_s=16)
    _check(keys, w, c, block_s=16, blocks_per_program=2)  # a loop per program, last block out of range


def _per_row_oracle(keys, w, c, pair_stride, imag_offset):
    """Loop over rows, heads and pairs straight from the kernel's definition (float64)."""
    B, H_kv, S, _ = keys.shape
    H_q, F = c.shape[-2:]
    G = H_q // H_kv
    out = torch.zeros(B, H_q, S, dtype=torch.float64)
    k = keys.double()
    for b in range(B):
        wb, cb = w[b % w.shape[0]].double(), c[b % c.shape[0]].double()
        for h in range(H_q):
            for f in range(F):
                x = k[b, h // G, :, f * pair_stride]
                y = k[b, h // G, :, f * pair_stride + imag_offset]
                out[b, h] += x * wb[h, f] + y * wb[h, F + f] + cb[h, f] * torch.sqrt(x * x + y * y)
    return out


@pytest.mark.parametrize("layout", [(1, None), (2, 1)], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("B_w,B_c", [(3, 3), (1, 3), (3, 1)])
@pytest.mark.parametrize("D,rotary_dim", [(64, 64), (64, 40)])
def test_per_row_statistics_and_layouts(layout, B_w, B_c, D, rotary_dim):
    """c [B, H_q, F]: each row its own set; both pair layouts, partial rotary; poisoned out, oracle loop."""
    gen = _gen()
    F = rotary_dim // 2
    pair_stride, imag_offset = layout[0], (F if layout[1] is None else layout[1])
    keys = torch.randn(3, 2, 37, D, generator=gen).to(torch.bfloat16)
    w = torch.randn(B_w, 4, 2 * F, generator=gen)
    c = torch.rand(B_c, 4, F, generator=gen)
    out = torch.full((3, 4, 37), float("nan"))
    kscore.score_keys_triton(keys, w, c, out=out, pair_stride=pair_stride, imag_offset=imag_offset, block_s=16)
    ref_out = torch.full((3, 4, 37), float("nan"))
    kscore.score_keys_reference(keys, w, c, out=ref_out, pair_stride=pair_stride, imag_offset=imag_offset, chunk=8)
    oracle = _per_row_oracle(keys, w, c, pair_stride, imag_offset)
    scale = _per_row_oracle(keys.abs(), w.abs(), c, pair_stride, imag_offset)
    for got in (out, ref_out):
        assert torch.isfinite(got).all()
        assert ((got.double() - oracle).abs() / scale.clamp_min(1e-20)).max() < 1e-5
    # Rows really use their own c: sharing row 0's set changes the other rows.
    if B_c == 3:
        shared = kscore.score_keys_reference(keys, w, c[:1], pair_stride=pair_stride, imag_offset=imag_offset)
        assert torch.allclose(shared[0], out[0], rtol=1e-5, atol=1e-4)
        assert not torch.allclose(shared[1:], out[1:], rtol=1e-3, atol=1e-3)


def test_layout_and_batch_errors():
    gen = _gen()
    keys = torch.randn(2, 1, 5, 64, generator=gen)
    w, c = _weights(1, 2, 32, gen)
    with pytest.raises(ValueError, match="c batch"):
        kscore.score_keys_reference(keys, w, c.expand(3, -1, -1))
    kscore.score_keys_reference(keys, w, c, pair_stride=2, imag_offset=1)  # 32 interleaved pairs fill 64 dims
    for layout in ((2, 1), (1, 32)):
        with pytest.raises(ValueError, match="beyond head_dim"):
            kscore.score_keys_reference(keys[..., :63], w, c, pair_stride=layout[0], imag_offset=layout[1])


def test_strided_views_and_shared_weights():
    gen = _gen()
    B, H_kv, H_q, D, C, S = 2, 2, 4, 64, 80, 50
    # [B, C, H, D] storage viewed as [B, H, S, D]; one weight row shared by the batch.
    storage = torch.randn(B, C, H_kv, D, generator=gen).to(torch.bfloat16)
    keys = storage.transpose(1, 2)[:, :, :S]
    w, c = _weights(1, H_q, D // 2, gen)
    _check(keys, w, c, block_s=32)
    # Non-unit last stride as well (every other element of a wider head).
    wide = torch.randn(B, H_kv, S, 2 * D, generator=gen).to(torch.float16)
    _check(wide[..., ::2], w, c, block_s=32)


def test_default_launch_parameters_and_dispatch():
    gen = _gen()
    keys = torch.randn(1, 2, 70, 128, generator=gen).to(torch.bfloat16)
    q_mean = torch.complex(torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen))
    q_abs = q_mean.abs() * 1.2
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, 128, 2) / 128)
    w, c = query_weights(q_mean, q_abs, inv_freq, 123_456)
    _check(keys, w, c)
    fast = score_keys(keys, q_mean, q_abs, inv_freq, 123_456, backend="triton")
    slow = score_keys(keys, q_mean, q_abs, inv_freq, 123_456, backend="torch")
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-4)
    assert torch.equal(score_keys_weighted(keys, w, c, backend="triton"), fast)


def test_empty_and_bad_out():
    gen = _gen()
    w, c = _weights(1, 2, 32, gen)
    empty = kscore.score_keys_triton(torch.randn(1, 1, 0, 64), w, c)
    assert empty.shape == (1, 2, 0)
    with pytest.raises(ValueError, match="out must be"):
        kscore.score_keys_triton(torch.randn(1, 1, 5, 64), w, c, out=torch.empty(1, 2, 4))
