"""In-place compaction: Triton (interpreter, CPU) == PyTorch reference == naive out-of-place gather."""
from __future__ import annotations

import pytest
import torch

from hf_ropekv.kernels.compact import compact_, compact_reference_, compact_triton_


@pytest.fixture(params=["triton", "torch"])
def backend(request) -> str:
    """Each test runs the Triton kernel (under the interpreter, on CPU tensors) and its PyTorch twin."""
    if request.param == "triton":
        request.getfixturevalue("triton_interpreter")
    return request.param


def _gen() -> torch.Generator:
    gen = torch.Generator()
    print("seed", gen.seed())  # fresh random inputs on every run; pytest shows the seed of a failure
    return gen


def _poison_evicted(tensors, keep: torch.Tensor) -> None:
    """NaN in every slot ``keep`` drops (per row and head), so a kernel that copies a wrong slot shows it.

    Integer tensors get -1 instead."""
    B, H, C = tensors[0].shape[:3]
    dropped = torch.ones(B, H, C, dtype=torch.bool).scatter_(2, keep.long().clamp_min(0), False)
    for t in tensors:
        t.masked_fill_(dropped[..., None], float("nan") if t.is_floating_point() else -1)


def _keep_sets(B: int, H: int, C: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Random strictly ascending keep sets, a different one per (b, h)."""
    rows = []
    for _ in range(B * H):
        if kind == "sparse":
            idx = torch.randperm(C, generator=gen)[: C // 5]
        elif kind == "dense":  # drop one slot near the front: nearly everything shifts by one
            drop = int(torch.randint(0, 4, (1,), generator=gen))
            idx = torch.cat([torch.arange(drop), torch.arange(drop + 1, C)])
        elif kind == "evict_block":  # the usual round: drop a scattered 1/8
            idx = torch.randperm(C, generator=gen)[: C - C // 8]
        else:
            raise AssertionError(kind)
        rows.append(torch.sort(idx).values)
    K = len(rows[0])
    assert all(len(r) == K for r in rows)
    return torch.stack(rows).view(B, H, K)


def _run(backend: str, tensors, keep, start=None, block: int = 16) -> None:
    """Compact in place with ``backend``; the Triton kernel must also match its PyTorch twin bit for bit, on the
    whole tensor (NaN where both left poison in place)."""
    if backend == "triton":
        twins = [t.clone() for t in tensors]
        compact_reference_(twins, keep, start)  # default chunk: a different walk than the kernel's blocks
        compact_triton_(tensors, keep, start, block_k=block)  # several blocks per row
        for t, twin in zip(tensors, twins):
            torch.testing.assert_close(t, twin, rtol=0, atol=0, equal_nan=True)
    else:
        compact_reference_(tensors, keep, start, chunk=block)


def _expected(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.gather(t, 2, keep.long().unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))


@pytest.mark.parametrize(
    "dtype,D,kind",
    [
        (torch.float16, 64, "sparse"),
        (torch.bfloat16, 128, "dense"),
        (torch.float32, 64, "evict_block"),
        (torch.bfloat16, 256, "sparse"),
        (torch.float16, 128, "evict_block"),
        (torch.float32, 128, "dense"),
    ],
)
def test_compact_matches_gather(backend, dtype, D, kind):
    gen = _gen()
    B, H, C = 2, 3, 70
    keep = _keep_sets(B, H, C, kind, gen)
    ts = [torch.randn(B, H, C, D, generator=gen).to(dtype) for _ in range(2)]
    _compact_and_check(backend, ts, keep)


def _compact_and_check(backend, ts, keep) -> None:
    """Poison the evicted slots, compact, and compare the survivors with the plain gather."""
    _poison_evicted(ts, keep)
    want = [_expected(t, keep) for t in ts]
    _run(backend, ts, keep)
    K = keep.shape[2]
    for t, w in zip(ts, want):
        assert not t[:, :, :K].isnan().any(), "a survivor was read from an evicted slot"
        assert torch.equal(t[:, :, :K], w)


def test_mixed_tensors_int32_keep_and_strided_storage(backend):
    """K and V of several layers at once: mixed dtypes and head dims, [B, C, H, D] storage, int32 keep."""
    gen = _gen()
    B, H, C = 2, 2, 50
    keep = _keep_sets(B, H, C, "evict_block", gen).to(torch.int32)
    slot_major = torch.randn(B, C, H, 64, generator=gen).to(torch.bfloat16).transpose(1, 2)  # stride(-1) == 1
    ts = [
        torch.randn(B, H, C, 64, generator=gen).to(torch.bfloat16),
        torch.randn(B, H, C, 64, generator=gen).to(torch.bfloat16),
        torch.randn(B, H, C, 128, generator=gen).to(torch.float16),
        slot_major,
    ]
    _compact_and_check(backend, ts, keep)


def test_reference_and_triton_agree_and_empty_keep(backend):
    gen = _gen()
    B, H, C, D = 1, 2, 40, 64
    t = torch.randn(B, H, C, D, generator=gen).to(torch.float16)
    before = t.clone()
    _run(backend, [t], torch.empty(B, H, 0, dtype=torch.int64))  # K = 0: no-op
    assert torch.equal(t, before)
    keep = _keep_sets(B, H, C, "sparse", gen)
    other = t.clone()
    _run(backend, [t], keep)
    compact_reference_([other], keep)  # default chunk size
    K = keep.shape[2]
    assert torch.equal(t[:, :, :K], other[:, :, :K])
    # Keeping the whole prefix moves nothing.
    t2 = before.clone()
    _run(backend, [t2], torch.arange(C).expand(B, H, C))
    assert torch.equal(t2, before)


def test_dispatch_on_cpu_and_errors():
    gen = _gen()
    B, H, C, D = 1, 2, 30, 64
    t = torch.randn(B, H, C, D, generator=gen)
    keep = _keep_sets(B, H, C, "sparse", gen)
    want = _expected(t, keep)
    compact_([t], keep)  # CPU: PyTorch reference
    assert torch.equal(t[:, :, : keep.shape[2]], want)
    with pytest.raises(ValueError, match="ascending"):
        compact_([t], keep.flip(-1), validate_keep=True)
    with pytest.raises(ValueError, match="outside"):
        compact_([t], keep + C, validate_keep=True)
    with pytest.raises(ValueError, match="twice"):
        compact_([t, t], keep)
    with pytest.raises(ValueError, match="does not match"):
        compact_([t[:, :1]], keep)
    with pytest.raises(ValueError, match="int32 or int64"):
        compact_([t], keep.float())
    with pytest.raises(ValueError, match="slots"):
        compact_([t[:, :, :2]], keep)
    with pytest.raises(ValueError, match="backend"):
        compact_([t], keep, backend="cuda")


def _right_aligned_keep(B: int, H: int, C: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows keeping different numbers of slots, right-aligned in [start, K) behind holes (the cache's layout).

    Each row keeps n_b <= K slots, a different random ascending set per head; row 0 keeps its first slots, so
    all of them move right (the hazard of an ascending walk); the others mix left and right movers.
    """
    counts = [K] + [int(torch.randint(1, K + 1, (1,), generator=gen)) for _ in range(B - 1)]
    counts[1 % B] = max(1, K // 3)
    keep = torch.full((B, H, K), -7, dtype=torch.int64)  # entries before start are ignored: poison them
    for b, n in enumerate(counts):
        for h in range(H):
            idx = torch.arange(n) if b == 0 and n < K else torch.sort(torch.randperm(C, generator=gen)[:n]).values
            keep[b, h, K - n :] = idx
    counts[0] = K if counts[0] == K else counts[0]
    start = torch.tensor([K - n for n in counts], dtype=torch.int64)
    return keep, start


def test_compact_with_row_starts_right_aligns_survivors(backend):
    """``start``: row b's survivors land in [start_b, K); slots before start_b are untouched."""
    gen = _gen()
    B, H, C, K, D = 4, 2, 60, 37, 32
    keep, start = _right_aligned_keep(B, H, C, K, gen)
    keep[0, :, :] = torch.arange(K)  # row 0: first K slots ...
    start[0] = 9
    keep[0, :, 9:] = torch.arange(K - 9)  # ... shifted right by 9: every move goes right
    ts = [torch.randn(B, H, C, D, generator=gen) for _ in range(2)]
    before = [t.clone() for t in ts]
    want = []
    for t in ts:
        w = t[:, :, :K].clone()
        for b in range(B):
            s = int(start[b])
            w[b, :, s:] = torch.gather(t[b], 1, keep[b, :, s:].unsqueeze(-1).expand(-1, -1, D))
        want.append(w)
    _run(backend, ts, keep, start, block=8)
    for t, w, b0 in zip(ts, want, before):
        assert torch.equal(t[:, :, :K], w)
        assert torch.equal(t[:, :, K:], b0[:, :, K:])  # slots >= K untouched


def test_row_start_validation():
    gen = _gen()
    B, H, C, K = 2, 1, 20, 8
    keep, start = _right_aligned_keep(B, H, C, K, gen)
    t = torch.randn(B, H, C, 4, generator=gen)
    compact_([t], keep, start, validate_keep=True)  # poisoned entries before start are not checked
    with pytest.raises(ValueError, match=r"start must be \[B\]"):
        compact_([t], keep, start[:1])
    bad = keep.clone()
    bad[1, 0, -1] = bad[1, 0, -2]
    with pytest.raises(ValueError, match="ascending"):
        compact_([t], bad, start, validate_keep=True)
