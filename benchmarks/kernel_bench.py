#!/usr/bin/env python
"""The decode attention kernel (``hf_ropekv.kernels.attention``) against sdpa, on one CUDA GPU.

Qwen3-8B decode shape (32 query heads, 8 KV heads, head_dim 128), B = 1, 16, 32, S = 2176 kept slots: the kernel in
bf16 and int8 against masked sdpa with ``repeat_kv`` (transformers' path) and unmasked ``enable_gqa`` sdpa, each
launched eagerly and replayed in a CUDA graph. Writes JSON: date, device, torch / triton versions, rows.

    python benchmarks/kernel_bench.py --out FILE [--batch 1 16 32] [--seq 2176]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from common import import_hf_ropekv  # first: sets the hub defaults before anything imports transformers

import_hf_ropekv()
from hf_ropekv.kernels import HAS_TRITON  # noqa: E402
from hf_ropekv.kernels.attention import decode_attention, decode_attention_reference  # noqa: E402
from hf_ropekv.kernels.quantize import quantize_kv  # noqa: E402


def _sdpa_repeat_kv(query, keys, values, mask, scale):
    """What transformers' sdpa path runs: ``repeat_kv`` copies of K/V and a boolean mask."""
    B, H_kv, S, D = keys.shape
    G = query.shape[1] // H_kv
    keys = keys[:, :, None].expand(B, H_kv, G, S, D).reshape(B, H_kv * G, S, D)
    values = values[:, :, None].expand(B, H_kv, G, S, values.shape[3]).reshape(B, H_kv * G, S, values.shape[3])
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None, None, :], scale=scale)


def _sdpa_gqa(query, keys, values, scale):
    """sdpa with ``enable_gqa=True`` and no mask: no K/V copies (needs torch >= 2.5)."""
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
    """Run :func:`benchmark` and write its rows, with the date, device and versions, to ``--out`` as JSON."""
    args = _parse_args(argv)
    if not (HAS_TRITON and torch.cuda.is_available()):
        raise SystemExit("the decode_attention benchmark needs Triton and a CUDA GPU")
    import triton

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
