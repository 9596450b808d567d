#!/usr/bin/env python
"""Benchmark one KV compression round (score + select + compact) at Qwen3-8B shape.

On CUDA it:
  1. checks the Triton scoring and compaction kernels against their PyTorch
     twins on random data (a GPU correctness pass; compaction is compared
     exactly, repeated, so that a race would show);
  2. measures the device copy bandwidth (large device-to-device copy, bytes
     read + written, median);
  3. times a full compression round for each (batch, cached tokens S):
     score every layer, select (z-score per query head, max over the GQA
     group, mean over layers, seeded 1e-6 noise, top-``budget`` with
     ``budget = S - compress_every``, sorted ascending) and compact K and V of
     every layer in place, with the Triton kernels and with the plain-PyTorch
     references; plus each stage alone.

Prints progress and a final Markdown table; writes JSON and Markdown under ``--out``.
``--dry-run`` runs tiny shapes on the CPU with the PyTorch paths only (a
syntax and logic check that takes seconds).

    python benchmarks/bench_compression_round.py --out bench_out
    python benchmarks/bench_compression_round.py --dry-run --out /tmp/bench_dry
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]


def _import_library():
    """Import the kernels and ``query_weights``; from the source tree if the package is not installed."""
    try:
        from hf_ropekv.kernels import compact as kc
        from hf_ropekv.kernels import score as ks
        from hf_ropekv.scorers.rope_scoring import query_weights
    except ImportError:
        # Source checkout without `pip install -e .`: map kernels/ to hf_ropekv.kernels
        # by hand, without running the package __init__ (it needs the whole library).
        for name in [m for m in sys.modules if m == "hf_ropekv" or m.startswith("hf_ropekv.")]:
            del sys.modules[name]
        pkg = types.ModuleType("hf_ropekv")
        pkg.__path__ = [str(REPO / "hf_ropekv")]
        sys.modules["hf_ropekv"] = pkg
        spec = importlib.util.spec_from_file_location(
            "hf_ropekv.kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")]
        )
        kernels = importlib.util.module_from_spec(spec)
        sys.modules["hf_ropekv.kernels"] = kernels
        spec.loader.exec_module(kernels)
        from hf_ropekv.kernels import compact as kc
        from hf_ropekv.kernels import score as ks
        from hf_ropekv.scorers.rope_scoring import query_weights
    return ks, kc, query_weights


ks, kc, query_weights = _import_library()


# --------------------------------------------------------------------------- timing


def bench(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device, warmup=3, reps=reps)
    return 2 * nbytes / (ms * 1e-3)


# --------------------------------------------------------------------------- correctness


def rel_err(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    return ((got - ref).abs() / scale.clamp_min(1e-20)).max().item()


def check_score(device: torch.device, fast: Callable, log: Callable, S: int = 1000) -> List[Dict]:
    rows = []
    gen = torch.Generator(device=device)
    gen.seed()
    for dtype in (torch.float16, torch.bfloat16):
        for D, rot, H_q, H_kv in ((64, 64, 9, 3), (128, 128, 32, 8), (256, 256, 8, 2), (128, 64, 16, 4)):
            B, C = 3, S + 100
            storage = torch.randn(B, H_kv, C, D, device=device, generator=gen).to(dtype)
            keys = storage[:, :, :S]  # a slice view, as the cache scores it
            F = rot // 2
            w = torch.randn(B, H_q, 2 * F, device=device, generator=gen)
            c = torch.rand(H_q, F, device=device, generator=gen)
            out = torch.full((B, H_q, S), float("nan"), device=device)  # poisoned
            fast(keys, w, c, out=out)
            ref = ks.score_keys_reference(keys, w, c)
            scale = ks.score_keys_reference(keys.abs(), w.abs(), c)
            err = rel_err(out, ref, scale)
            ok = bool(torch.isfinite(out).all()) and err < 1e-5
            rows.append({"dtype": str(dtype).replace("torch.", ""), "D": D, "2F": rot, "H_q": H_q, "H_kv": H_kv,
                         "max_rel_err": err, "ok": ok})
            log(f"  score {rows[-1]['dtype']:8s} D={D:3d} 2F={rot:3d} H_q={H_q:2d} H_kv={H_kv}: "
                f"max rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    return rows


def check_compact(device: torch.device, fast: Callable, log: Callable, C: int = 4096, reps: int = 2,
                  n_tensors: int = 4) -> List[Dict]:
    rows = []
    gen = torch.Generator(device="cpu")
    gen.seed()
    B, H = 2, 8
    for dtype, D in ((torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 256)):
        for kind in ("drop_one_near_front", "evict_1_of_8", "sparse"):
            for rep in range(reps):  # a race would show as a run-to-run difference
                keeps = []
                for _ in range(B * H):
                    if kind == "drop_one_near_front":
                        drop = int(torch.randint(0, 8, (1,), generator=gen))
                        idx = torch.cat([torch.arange(drop), torch.arange(drop + 1, C)])
                    elif kind == "evict_1_of_8":
                        idx = torch.sort(torch.randperm(C, generator=gen)[: C - C // 8]).values
                    else:
                        idx = torch.sort(torch.randperm(C, generator=gen)[: C // 10]).values
                    keeps.append(idx)
                keep = torch.stack(keeps).view(B, H, -1).to(device)
                if rep:
                    keep = keep.to(torch.int32)
                ts = [torch.randn(B, H, C, D, device=device).to(dtype) for _ in range(n_tensors)]
                want = [torch.gather(t, 2, keep.long().unsqueeze(-1).expand(-1, -1, -1, D)) for t in ts]
                refs = [t.clone() for t in ts]
                fast(ts, keep)
                kc.compact_reference_(refs, keep)
                K = keep.shape[2]
                ok = all(torch.equal(t[:, :, :K], w) and torch.equal(r[:, :, :K], w) for t, r, w in zip(ts, refs, want))
                n_bad = sum(int((t[:, :, :K] != w).any(-1).sum()) for t, w in zip(ts, want))
                rows.append({"dtype": str(dtype).replace("torch.", ""), "D": D, "keep": kind, "K": K,
                             "keep_dtype": str(keep.dtype).replace("torch.", ""), "bad_slots": n_bad, "ok": ok})
                log(f"  compact {rows[-1]['dtype']:8s} D={D:3d} {kind:20s} K={K:4d} {rows[-1]['keep_dtype']}: "
                    f"{'exact' if ok else f'FAIL ({n_bad} wrong slots)'}")
    return rows


# --------------------------------------------------------------------------- the round


class Cache:
    """K and V storage of every layer [B, H_kv, C, D], plus per-layer scoring weights."""

    def __init__(self, args, B: int, S: int, device: torch.device):
        L, H_q, H_kv, D = args.layers, args.q_heads, args.kv_heads, args.head_dim
        C = S + args.compress_every  # append headroom: the scored keys are a slice view
        dtype = getattr(torch, args.dtype)
        self.K = [torch.randn(B, H_kv, C, D, device=device, dtype=dtype) for _ in range(L)]
        self.V = [torch.randn(B, H_kv, C, D, device=device, dtype=dtype) for _ in range(L)]
        F = D // 2
        inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
        pos = torch.full((B,), S, dtype=torch.int64)
        self.w, self.c = [], []
        for _ in range(L):  # weights are built once per round by the cache; not timed here
            q_mean = torch.complex(torch.randn(H_q, F), torch.randn(H_q, F))
            w, c = query_weights(q_mean, q_mean.abs() * 1.3, inv_freq, pos)
            self.w.append(w.to(device))
            self.c.append(c.to(device))
        gen = torch.Generator(device="cpu").manual_seed(0)  # seeded tie-breaking noise
        self.noise = (1e-6 * torch.randn(B, H_kv, S, generator=gen)).to(device)
        self.B, self.S, self.L, self.H_q, self.H_kv = B, S, L, H_q, H_kv
        self.budget = S - args.compress_every
        self.raw = torch.randn(B, H_q, S, device=device)  # score buffer; random until first scored

    def keys(self, layer: int) -> torch.Tensor:
        return self.K[layer][:, :, : self.S]

    def score_all(self, score_fn: Callable) -> None:
        for layer in range(self.L):
            score_fn(self.keys(layer), self.w[layer], self.c[layer], out=self.raw)

    def select(self, raws: Sequence[torch.Tensor]) -> torch.Tensor:
        """Shared ranking: z-score per q head, max over the GQA group, mean over layers, top budget."""
        acc = None
        for raw in raws:
            acc = self._accumulate(acc, raw)
        return self._keep(acc)

    def _accumulate(self, acc, raw: torch.Tensor) -> torch.Tensor:
        std, mean = torch.std_mean(raw, dim=-1, correction=0, keepdim=True)
        z = (raw - mean) / std.clamp_min(1e-12)
        g = z.view(self.B, self.H_kv, self.H_q // self.H_kv, self.S).amax(dim=2)
        return g if acc is None else acc.add_(g)

    def _keep(self, acc: torch.Tensor) -> torch.Tensor:
        ranking = acc / self.L + self.noise
        return ranking.topk(self.budget, dim=-1, sorted=False).indices.sort(dim=-1).values

    def round(self, score_fn: Callable, compact_fn: Callable) -> torch.Tensor:
        acc = None
        for layer in range(self.L):
            acc = self._accumulate(acc, score_fn(self.keys(layer), self.w[layer], self.c[layer], out=self.raw))
        keep = self._keep(acc)
        compact_fn(self.K + self.V, keep)
        return keep


def graph_round_ms(cache: "Cache", path: Dict[str, Callable], device, args, log) -> float:
    """The Triton round replayed from a CUDA graph: what is left once launch overhead is gone."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (compilation, caches)
            cache.round(path["score"], path["compact"])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.round(path["score"], path["compact"])
        ms = bench(graph.replay, device, args.warmup, args.reps)
        log(f"  triton round as a CUDA graph: {ms:.3f} ms")
        return ms
    except Exception as exc:  # report, do not abort the benchmark
        log(f"  CUDA graph capture failed: {exc!r}")
        return float("nan")


def run_shapes(args, device, paths: Dict[str, Dict[str, Callable]], copy_bw: float, log) -> List[Dict]:
    rows = []
    for B in args.batch:
        for S in args.seq:
            log(f"[round] B={B} S={S}: allocating {2 * args.layers} x {B}x{args.kv_heads}x{S + args.compress_every}"
                f"x{args.head_dim} {args.dtype}")
            cache = Cache(args, B, S, device)
            key_bytes = args.layers * B * args.kv_heads * S * args.head_dim * cache.K[0].element_size()
            row = {"B": B, "S": S, "budget": cache.budget, "layers": args.layers, "key_bytes_scored": key_bytes}
            # The selection alone, from stored raw scores of every layer.
            raws = [paths["triton" if "triton" in paths else "torch"]["score"](
                cache.keys(layer), cache.w[layer], cache.c[layer]) for layer in range(args.layers)]
            row["select_ms"] = bench(lambda: cache.select(raws), device, args.warmup, args.reps)
            raws = None  # free before the timed rounds
            keep = cache.select([cache.raw])  # a valid keep set for timing compaction alone
            for name, p in paths.items():
                reps = args.reps if name == "triton" else args.torch_reps
                row[f"{name}_score_ms"] = bench(lambda: cache.score_all(p["score"]), device, args.warmup, reps)
                row[f"{name}_compact_ms"] = bench(lambda: p["compact"](cache.K + cache.V, keep), device,
                                                  args.warmup, reps)
                row[f"{name}_round_ms"] = bench(lambda: cache.round(p["score"], p["compact"]), device,
                                                args.warmup, reps)
                bw = key_bytes / (row[f"{name}_score_ms"] * 1e-3)
                row[f"{name}_score_GBps"] = bw / 1e9
                row[f"{name}_score_pct_copy_bw"] = 100 * bw / copy_bw if copy_bw else float("nan")
                log(f"  {name:6s}: round {row[f'{name}_round_ms']:9.3f} ms | score {row[f'{name}_score_ms']:8.3f} ms "
                    f"({row[f'{name}_score_GBps']:7.1f} GB/s, {row[f'{name}_score_pct_copy_bw']:5.1f} % of copy) | "
                    f"compact {row[f'{name}_compact_ms']:8.3f} ms | select {row['select_ms']:.3f} ms")
            if "triton" in paths and device.type == "cuda":
                row["triton_round_graph_ms"] = graph_round_ms(cache, paths["triton"], device, args, log)
            if "triton" in paths and "torch" in paths:
                row["speedup_round"] = row["torch_round_ms"] / row["triton_round_ms"]
            rows.append(row)
            cache = keep = None  # free this shape's storage before the next
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def sweep(args, device, log) -> List[Dict]:
    """Launch-parameter sweep of both kernels (to pick defaults), on data several times the L2."""
    rows = []
    B, S, L = 8, 32768, 8
    for D, H_q, H_kv in ((64, 9, 3), (128, 32, 8), (256, 8, 2)):
        F = D // 2
        keys = [torch.randn(B, H_kv, S + 128, D, device=device, dtype=torch.bfloat16)[:, :, :S] for _ in range(L)]
        w = torch.randn(B, H_q, 2 * F, device=device)
        c = torch.rand(H_q, F, device=device)
        out = torch.empty(B, H_q, S, device=device)
        key_bytes = L * B * H_kv * S * D * 2

        for block_s in (16, 32, 64):
            for nw in (1, 2):
                for st in (3, 4):
                    def fn(block_s=block_s, nw=nw, st=st):
                        for k in keys:
                            ks.score_keys_triton(k, w, c, out=out, block_s=block_s, num_warps=nw, num_stages=st)
                    ms = bench(fn, device, args.warmup, args.reps)
                    rows.append({"kernel": f"score D={D} G={H_q // H_kv}", "block": block_s, "num_warps": nw,
                                 "stages": st, "ms": ms, "GBps": key_bytes / (ms * 1e-3) / 1e9})
                    log(f"  sweep score D={D} block_s={block_s:3d} warps={nw} stages={st}: {ms:7.3f} ms "
                        f"{rows[-1]['GBps']:7.1f} GB/s")

        def default():
            for k in keys:
                ks.score_keys_triton(k, w, c, out=out)

        ms = bench(default, device, args.warmup, args.reps)
        rows.append({"kernel": f"score D={D} G={H_q // H_kv}", "block": "default", "num_warps": "default",
                     "stages": "default", "ms": ms, "GBps": key_bytes / (ms * 1e-3) / 1e9})
        log(f"  sweep score D={D} library defaults: {ms:7.3f} ms {rows[-1]['GBps']:7.1f} GB/s")
        keys = None
    cache = Cache(args, max(args.batch), max(args.seq), device)
    key_bytes = args.layers * cache.B * args.kv_heads * cache.S * args.head_dim * cache.K[0].element_size()
    keep = cache.select([cache.raw])
    moved = 2 * 2 * key_bytes  # K and V, read + written (upper bound: the kept prefix does not move)
    for block_k in (32, 64, 128):
        for nw in (4, 8):
            ms = bench(lambda: kc.compact_triton_(cache.K + cache.V, keep, block_k=block_k, num_warps=nw),
                       device, args.warmup, args.reps)
            rows.append({"kernel": "compact", "block": block_k, "num_warps": nw, "stages": None, "ms": ms,
                         "GBps": moved / (ms * 1e-3) / 1e9})
            log(f"  sweep compact block_k={block_k:3d} warps={nw}: {ms:8.3f} ms {rows[-1]['GBps']:7.1f} GB/s (<=)")
    return rows


def markdown(meta: Dict, rounds: List[Dict], sweep_rows: List[Dict]) -> str:
    lines = [f"# Compression round: {meta['shape']}", "",
             f"device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"copy bandwidth {meta['copy_bw_GBps']:.0f} GB/s (read + write)", ""]
    has_t = any("triton_round_ms" in r for r in rounds)
    has_p = any("torch_round_ms" in r for r in rounds)
    head = ["B", "S", "budget"]
    if has_t:
        head += ["round Triton ms", "round Triton graph ms", "score Triton ms", "score GB/s", "% copy BW",
                 "compact Triton ms"]
    if has_p:
        head += ["round PyTorch ms", "score PyTorch ms", "compact PyTorch ms"]
    head += ["select ms"] + (["speed-up"] if has_t and has_p else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rounds:
        cells = [str(r["B"]), str(r["S"]), str(r["budget"])]
        if has_t:
            cells += [f"{r['triton_round_ms']:.3f}", f"{r.get('triton_round_graph_ms', float('nan')):.3f}",
                      f"{r['triton_score_ms']:.3f}", f"{r['triton_score_GBps']:.0f}",
                      f"{r['triton_score_pct_copy_bw']:.0f}", f"{r['triton_compact_ms']:.3f}"]
        if has_p:
            cells += [f"{r['torch_round_ms']:.3f}", f"{r['torch_score_ms']:.3f}", f"{r['torch_compact_ms']:.3f}"]
        cells += [f"{r['select_ms']:.3f}"] + ([f"{r['speedup_round']:.1f}x"] if has_t and has_p else [])
        lines.append("| " + " | ".join(cells) + " |")
    if sweep_rows:
        lines += ["", "| kernel | block | warps | stages | ms | GB/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['block']} | {r['num_warps']} | {r['stages']} | {r['ms']:.3f} "
                  f"| {r['GBps']:.0f} |" for r in sweep_rows]
    lines += ["", "Scoring GB/s counts key bytes read (all layers); the copy bandwidth counts read + written. "
              "A round = score every layer + select + compact K and V of every layer in place; "
              "building the per-layer query weights is not included."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for the JSON and Markdown results")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, PyTorch paths only")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768], help="cached tokens S")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--compress-every", type=int, default=128, help="budget = S - compress_every")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--torch-reps", type=int, default=3, help="repetitions of the (slow) PyTorch path")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--no-check", action="store_true", help="skip the correctness pass")
    p.add_argument("--sweep", action="store_true", help="also sweep the kernels' launch parameters")
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    args = p.parse_args(argv)

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    if args.dry_run:
        device = torch.device("cpu")
        args.layers, args.q_heads, args.kv_heads, args.head_dim = 2, 4, 2, 64
        args.seq, args.batch, args.compress_every = [128, 256], [1, 2], 32
        args.warmup, args.reps, args.torch_reps, args.copy_bytes = 1, 1, 1, 1 << 22
    elif not torch.cuda.is_available():
        print("CUDA is not available: use --dry-run for a CPU logic check", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        if not ks.HAS_TRITON:
            print("Triton is not installed", file=sys.stderr)
            return 2

    torch_path = {"score": ks.score_keys_reference, "compact": kc.compact_reference_}
    if args.dry_run:  # the references stand in for the kernels: logic check only
        paths = {"torch": torch_path}
        fast_score, fast_compact = ks.score_keys_reference, kc.compact_reference_
    else:
        paths = {"triton": {"score": ks.score_keys_triton, "compact": kc.compact_triton_}}
        if not args.no_torch:
            paths["torch"] = torch_path
        fast_score, fast_compact = ks.score_keys_triton, kc.compact_triton_

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__, "triton": triton_version,
        "shape": f"{args.layers} layers, {args.q_heads} q / {args.kv_heads} kv heads, head_dim {args.head_dim}, "
                 f"{args.dtype}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    log(f"device {meta['device']}, torch {meta['torch']}, triton {triton_version}; {meta['shape']}")

    checks = {}
    if not args.no_check:
        log("[check] scoring kernel vs reference")
        checks["score"] = check_score(device, fast_score, log, S=64 if args.dry_run else 1000)
        log("[check] compaction kernel vs reference vs gather")
        small = dict(C=64, reps=1, n_tensors=2) if args.dry_run else {}
        checks["compact"] = check_compact(device, fast_compact, log, **small)
    checks_ok = all(r["ok"] for rows in checks.values() for r in rows)

    copy_bw = copy_bandwidth(device, args.copy_bytes, reps=args.reps)
    meta["copy_bw_GBps"] = copy_bw / 1e9
    log(f"[copy] device copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write, {args.copy_bytes >> 20} MiB buffer)")

    rounds = run_shapes(args, device, paths, copy_bw, log)
    sweep_rows = sweep(args, device, log) if args.sweep and device.type == "cuda" else []

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "checks": checks, "checks_ok": checks_ok, "rounds": rounds, "sweep": sweep_rows}
    (args.out / "bench_compression_round.json").write_text(json.dumps(result, indent=2))
    md = markdown(meta, rounds, sweep_rows)
    if checks:
        md += f"\nCorrectness pass: {'all ok' if checks_ok else 'FAILURES (see JSON)'}\n"
    (args.out / "bench_compression_round.md").write_text(md)
    log(f"wrote {args.out}/bench_compression_round.json and .md")
    print()
    print(md)
    return 0 if checks_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
