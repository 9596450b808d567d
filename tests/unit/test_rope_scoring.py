"""score_keys against a direct float64 evaluation of its formula (README, "How it works": the score), with an
explicit loop over offsets."""
from __future__ import annotations

import math

import pytest
import torch

from hf_ropekv.scorers.rope_scoring import DEFAULT_OFFSETS, query_weights, score_keys, score_keys_weighted

# Relative to the magnitude of the terms summed. Float32 accumulation lands near
# 2e-7; float32 phases at t = 1e6 land near 1e-3 (see test_float32_phases_would_fail).
TOL = 1e-5


def _fresh_gen() -> torch.Generator:
    gen = torch.Generator()
    gen.seed()  # fresh random inputs on every run
    return gen


def _stats(H_q: int, F: int, gen: torch.Generator):
    q_mean = torch.complex(torch.randn(H_q, F, generator=gen), torch.randn(H_q, F, generator=gen))
    # Some pairs with A < |q_mean| so the clamp matters.
    q_abs = q_mean.abs() * (0.5 + torch.rand(H_q, F, generator=gen))
    return q_mean, q_abs.float()


def _inv_freq(F: int, theta: float = 10000.0, rotary_dim: int | None = None) -> torch.Tensor:
    rotary_dim = rotary_dim or 2 * F
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def key_pairs(keys: torch.Tensor, F: int, layout: str) -> torch.Tensor:
    """Complex k_f [..., F] built by hand from each layout's definition (hf_ropekv.model.layouts: which two dims
    form pair f)."""
    k = keys.double()
    if layout == "rotate_half":  # pair f = (f, f + F)
        return torch.complex(k[..., :F], k[..., F:2 * F])
    assert layout == "interleaved"  # pair f = (2f, 2f + 1)
    real = torch.stack([k[..., 2 * f] for f in range(F)], dim=-1)
    imag = torch.stack([k[..., 2 * f + 1] for f in range(F)], dim=-1)
    return torch.complex(real, imag)


def direct_scores(keys, q_mean, q_abs, inv_freq, positions, offsets, layout="rotate_half"):
    """float64 evaluation straight from the definition; returns (score, scale) [B, H_q, S].

    ``q_mean`` / ``q_abs`` are [H_q, F] (shared) or [B, H_q, F] (row b uses its own set)."""
    B, H_kv, S, _ = keys.shape
    H_q, F = q_mean.shape[-2:]
    G = H_q // H_kv
    kc = key_pairs(keys, F, layout)
    omega = inv_freq.double()
    score = torch.zeros(B, H_q, S, dtype=torch.float64)
    scale = torch.zeros(B, H_q, S, dtype=torch.float64)
    for b in range(B):
        t = int(positions[b])
        q = (q_mean[b] if q_mean.dim() == 3 else q_mean).to(torch.complex128)
        A = (q_abs[b] if q_abs.dim() == 3 else q_abs).double()
        for h in range(H_q):
            kh = kc[b, h // G]  # [S, F]
            trig = torch.zeros(S, dtype=torch.float64)
            rot_mean = torch.zeros(F, dtype=torch.complex128)
            for d in offsets:
                phase = omega * float(t + d)
                rot = torch.complex(torch.cos(phase), torch.sin(phase))
                trig += (q[h] * rot * kh.conj()).real.sum(-1)
                rot_mean += rot / len(offsets)
            trig /= len(offsets)
            norm = ((A[h] - q[h].abs()).clamp_min(0) * kh.abs()).sum(-1)
            score[b, h] = trig + norm
            # Size of the terms summed: the error yardstick (scores can be ~0).
            scale[b, h] = ((q[h] * rot_mean).abs() * kh.abs()).sum(-1) + norm
    return score, scale


def _assert_matches(got, keys, q_mean, q_abs, inv_freq, positions, offsets, layout="rotate_half"):
    assert got.dtype == torch.float32
    ref, scale = direct_scores(keys, q_mean, q_abs, inv_freq, positions, offsets, layout)
    assert got.shape == ref.shape
    assert torch.isfinite(got).all()
    rel = ((got.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert rel < TOL, f"max relative error {rel:.3g}"


CASES = [
    # H_q, H_kv, D, rotary_dim, dtype, position
    (4, 4, 64, 64, torch.float32, 0),  # MHA
    (8, 4, 128, 128, torch.float32, 137),  # GQA 2
    (8, 2, 128, 128, torch.float32, 10**5),  # GQA 4
    (9, 3, 64, 64, torch.float32, 10**6),  # SmolLM2: GQA 3
    (4, 1, 256, 256, torch.float32, 10**6),  # head_dim 256
    (4, 2, 128, 64, torch.float32, 137),  # partial rotary: 2F = 64 < D = 128
    (6, 2, 256, 64, torch.float32, 10**5),  # partial rotary, quarter of the head
    (8, 2, 128, 128, torch.bfloat16, 10**6),
    (4, 2, 64, 64, torch.float16, 137),
]


@pytest.mark.parametrize("H_q,H_kv,D,rotary_dim,dtype,position", CASES)
def test_score_keys_matches_formula(H_q, H_kv, D, rotary_dim, dtype, position):
    gen = _fresh_gen()
    F = rotary_dim // 2
    B, S = 2, 37
    keys = torch.randn(B, H_kv, S, D, generator=gen).to(dtype)
    q_mean, q_abs = _stats(H_q, F, gen)
    inv_freq = _inv_freq(F, theta=1e6 if D >= 128 else 1e4, rotary_dim=rotary_dim)
    got = score_keys(keys, q_mean, q_abs, inv_freq, position)
    _assert_matches(got, keys, q_mean, q_abs, inv_freq, [position] * B, DEFAULT_OFFSETS)


def _backend_device(backend: str) -> str:
    """Where a backend runs: the compiled Triton kernel needs CUDA tensors (the interpreter takes CPU ones)."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "H_q,H_kv,D,rotary_dim,position",
    [(8, 2, 64, 64, 137), (4, 2, 128, 64, 10**5), (6, 3, 96, 24, 10**6), (4, 4, 32, 16, 3)],  # full and partial
)
def test_each_layout_matches_formula(layout, backend, H_q, H_kv, D, rotary_dim, position):
    """The oracle builds k_f from the layout's definition; partial rotary leaves dims >= rotary_dim out."""
    pytest.importorskip("triton") if backend == "triton" else None
    gen = _fresh_gen()
    F = rotary_dim // 2
    keys = torch.randn(2, H_kv, 29, D, generator=gen)
    q_mean, q_abs = _stats(H_q, F, gen)
    inv_freq = _inv_freq(F, rotary_dim=rotary_dim)
    device = _backend_device(backend)

    def score(k, layout):
        return score_keys(k.to(device), q_mean.to(device), q_abs.to(device), inv_freq, position, layout=layout,
                          backend=backend).cpu()

    got = score(keys, layout)
    _assert_matches(got, keys, q_mean, q_abs, inv_freq, [position] * 2, DEFAULT_OFFSETS, layout)
    # Non-rotary dims do not matter; rotary dims outside the layout's pairs would.
    changed = keys.clone()
    changed[..., rotary_dim:] = torch.randn(changed[..., rotary_dim:].shape, generator=gen)
    assert torch.equal(score(changed, layout), got)
    other = "interleaved" if layout == "rotate_half" else "rotate_half"
    wrong = score(keys, other)
    assert not torch.allclose(wrong, got, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_row_statistics_match_formula(layout, backend):
    """Statistics [B, H_q, F]: row b is scored with its own set (here with per-row positions too)."""
    pytest.importorskip("triton") if backend == "triton" else None
    gen = _fresh_gen()
    B, H_kv, H_q, D, F, S = 3, 2, 4, 64, 24, 33  # partial rotary: 2F = 48 < 64
    keys = torch.randn(B, H_kv, S, D, generator=gen)
    rows = [_stats(H_q, F, gen) for _ in range(B)]
    q_mean = torch.stack([r[0] for r in rows])
    q_abs = torch.stack([r[1] for r in rows])
    inv_freq = _inv_freq(F, rotary_dim=2 * F)
    positions = torch.tensor([40, 7_000, 123_457])
    device = _backend_device(backend)
    on = dict(layout=layout, backend=backend)
    got = score_keys(keys.to(device), q_mean.to(device), q_abs.to(device), inv_freq, positions, **on).cpu()
    _assert_matches(got, keys, q_mean, q_abs, inv_freq, positions.tolist(), DEFAULT_OFFSETS, layout)
    # Each row equals scoring that row alone with its own shared statistics.
    for b in range(B):
        alone = score_keys(keys[b:b + 1], q_mean[b], q_abs[b], inv_freq, int(positions[b]), layout=layout)
        assert torch.allclose(got[b], alone[0], rtol=1e-5, atol=1e-5)
    # One position for every row also works with per-row statistics.
    same_t = score_keys(keys.to(device), q_mean.to(device), q_abs.to(device), inv_freq, 500, **on).cpu()
    _assert_matches(same_t, keys, q_mean, q_abs, inv_freq, [500] * B, DEFAULT_OFFSETS, layout)


def test_per_row_statistics_shape_errors():
    gen = _fresh_gen()
    keys = torch.randn(2, 2, 10, 64, generator=gen)
    q_mean = torch.complex(torch.randn(3, 4, 32, generator=gen), torch.randn(3, 4, 32, generator=gen))
    with pytest.raises(ValueError, match="rows"):
        score_keys(keys, q_mean, q_mean.abs(), _inv_freq(32), 5)
    with pytest.raises(ValueError, match="layout"):
        score_keys(keys, q_mean[:2], q_mean[:2].abs(), _inv_freq(32), 5, layout="neox")


def test_per_row_positions_custom_offsets_strided_view():
    gen = _fresh_gen()
    B, H_kv, H_q, D, F, S, C = 3, 2, 6, 128, 64, 41, 64
    # Storage laid out [B, C, H, D] (slot-major) and sliced: keys have odd strides.
    storage = torch.randn(B, C, H_kv, D, generator=gen)
    keys = storage.transpose(1, 2)[:, :, :S]
    assert not keys.is_contiguous()
    q_mean, q_abs = _stats(H_q, F, gen)
    inv_freq = _inv_freq(F, theta=1e6)
    positions = torch.tensor([5, 70_000, 999_983])
    offsets = (1, 3, 10, 1000, 40_000)
    got = score_keys(keys, q_mean, q_abs, inv_freq, positions, offsets=offsets)
    _assert_matches(got, keys, q_mean, q_abs, inv_freq, positions.tolist(), offsets)
    # Rows really use their own position: the same keys at another position score differently.
    other = score_keys(keys, q_mean, q_abs, inv_freq, 5, offsets=offsets)
    assert torch.allclose(got[0], other[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[2], other[2], rtol=1e-3, atol=1e-3)


def test_float32_phases_would_fail():
    """The test is sharp enough to see float32 phases at t = 1e6 (the bug §2 warns of)."""
    gen = _fresh_gen()
    H_q, F, t = 8, 64, 10**6
    keys = torch.randn(1, 2, 64, 2 * F, generator=gen)
    q_mean, _ = _stats(H_q, F, gen)
    q_abs = torch.zeros(H_q, F)  # no norm term: compare trig alone
    inv_freq = _inv_freq(F)
    phase32 = inv_freq[None, :] * (torch.tensor(DEFAULT_OFFSETS, dtype=torch.float32)[:, None] + t)
    rot = torch.complex(torch.cos(phase32), torch.sin(phase32)).mean(0)
    q_eff = q_mean * rot
    w = torch.cat([q_eff.real, q_eff.imag], -1)[None]
    c = (q_abs - q_mean.abs()).clamp_min(0)
    bad = score_keys_weighted(keys, w, c)
    ref, scale = direct_scores(keys, q_mean, q_abs, inv_freq, [t], DEFAULT_OFFSETS)
    assert ((bad.double() - ref).abs() / scale).max() > 10 * TOL
    good = score_keys(keys, q_mean, q_abs, inv_freq, t)
    assert ((good.double() - ref).abs() / scale).max() < TOL


def test_query_weights_shapes_and_dtypes():
    gen = _fresh_gen()
    q_mean, q_abs = _stats(6, 32, gen)
    inv_freq = _inv_freq(32)
    w, c = query_weights(q_mean, q_abs, inv_freq, 12)
    assert w.shape == (1, 6, 64) and w.dtype == torch.float32
    assert c.shape == (1, 6, 32) and c.dtype == torch.float32 and (c >= 0).all()
    w3, _ = query_weights(q_mean, q_abs, inv_freq, torch.tensor([12, 13, 14]))
    assert w3.shape == (3, 6, 64)
    assert torch.equal(w3[0], w[0])
    # Position 0 with the single offset 0: q_eff is q_mean itself.
    w0, _ = query_weights(q_mean, q_abs, inv_freq, 0, offsets=[0])
    assert torch.allclose(w0[0], torch.cat([q_mean.real, q_mean.imag], -1))


def test_reference_writes_every_element():
    gen = _fresh_gen()
    keys = torch.randn(2, 2, 50, 64, generator=gen)
    q_mean, q_abs = _stats(4, 32, gen)
    w, c = query_weights(q_mean, q_abs, _inv_freq(32), 77)
    from hf_ropekv.kernels.score import score_keys_reference

    out = torch.full((2, 4, 50), float("nan"))
    score_keys_reference(keys, w, c, out=out, chunk=16)  # several chunks, last one partial
    assert torch.isfinite(out).all()
    assert torch.allclose(out, score_keys_weighted(keys, w, c, backend="torch"), rtol=1e-5, atol=1e-5)


def _good():
    gen = torch.Generator().manual_seed(0)
    q_mean, q_abs = _stats(8, 32, gen)
    return torch.randn(1, 4, 10, 64), q_mean, q_abs, _inv_freq(32)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda k, q, a, f, p: (k, q[:6], a[:6], f, p), "multiple of KV heads"),
        (lambda k, q, a, f, p: (k[..., :48], q, a, f, p), "exceed head_dim"),
        (lambda k, q, a, f, p: (k, q.real, a, f, p), "complex"),
        (lambda k, q, a, f, p: (k, q, a[:, :16], f, p), "q_abs_mean shape"),
        (lambda k, q, a, f, p: (k, q, a, f[:16], p), "inv_freq"),
        (lambda k, q, a, f, p: (k[0], q, a, f, p), "4-D"),
        (lambda k, q, a, f, p: (k.to(torch.int32), q, a, f, p), "dtype"),
        (lambda k, q, a, f, p: (k, q, a, f, torch.tensor([1.5])), "integers"),
        (lambda k, q, a, f, p: (k, q, a, f, torch.tensor([1, 2, 3])), "batch"),
        (lambda k, q, a, f, p: (k, q, a, f, "7"), "position"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, match):
    args = mutate(*_good(), 5)
    with pytest.raises(ValueError, match=match):
        score_keys(*args)


def test_bad_offsets_and_backend():
    keys, q_mean, q_abs, inv_freq = _good()
    with pytest.raises(ValueError, match="offsets"):
        score_keys(keys, q_mean, q_abs, inv_freq, 3, offsets=[])
    w, c = query_weights(q_mean, q_abs, inv_freq, 3)
    with pytest.raises(ValueError, match="backend"):
        score_keys_weighted(keys, w, c, backend="cuda")
    with pytest.raises(ValueError, match="w batch"):
        score_keys_weighted(keys, w.expand(2, -1, -1), c)


def test_default_offsets():
    assert DEFAULT_OFFSETS == tuple(2**i for i in range(17))
    assert DEFAULT_OFFSETS[-1] == 65536 and len(DEFAULT_OFFSETS) == 17
    assert math.isclose(sum(DEFAULT_OFFSETS), 2**17 - 1)


def test_frequency_scorer_passes_per_row_statistics_through():
    """``stats.for_layer`` may return [B, H_q, F]: row b is scored with its own set, in the stats' layout."""
    from hf_ropekv.scorers.base import ScoreContext
    from hf_ropekv.scorers.frequency import FrequencyScorer

    gen = _fresh_gen()
    B, H_kv, H_q, F, S = 2, 2, 4, 16, 21
    keys = torch.randn(B, H_kv, S, 2 * F, generator=gen)
    rows = [_stats(H_q, F, gen) for _ in range(B)]
    inv_freq = _inv_freq(F)

    class PerRowStats:
        metadata = {"inv_freq": inv_freq.tolist(), "rotary_layout": "interleaved"}

        def for_layer(self, layer_idx):
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    class SharedStats(PerRowStats):
        def __init__(self, row):
            self.row = row

        def for_layer(self, layer_idx):
            return rows[self.row]

    ctx = ScoreContext(layer_idx=0, position=torch.tensor([30, 31]), tokens_seen=31,
                       slot_positions=torch.arange(S).expand(B, H_kv, S),
                       candidates=torch.ones(B, H_kv, S, dtype=torch.bool))
    got = FrequencyScorer(PerRowStats()).score(keys, ctx)
    for b in range(B):
        alone = FrequencyScorer(SharedStats(b)).score(keys, ctx)
        assert torch.allclose(got[b], alone[b], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[0], FrequencyScorer(SharedStats(1)).score(keys, ctx)[0], rtol=1e-3, atol=1e-3)
