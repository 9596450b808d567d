"""Suite part a: memory over a long generation (batch 1, short pinned prompt, up to 32K tokens).

Cache bytes, peak allocated beyond the weights and reserved memory at each checkpoint, for DynamicCache,
RopeKVCache at three budgets, gather-and-rebind and transformers' QuantizedCache (quanto int4) where installed.
"""

from __future__ import annotations

import time
import traceback

import baselines
from common import MIB, median
from suite_harness import DYNAMIC, GATHER, QUANT, ROPE, Bench, mib_text


def part_a(bench: Bench, out: dict) -> None:
    s, log = bench.s, bench.log
    variants: list[tuple[str, int | None]] = [(DYNAMIC, None)] + [(ROPE, b) for b in s.budgets] + [(GATHER, s.budget)]
    if baselines.quanto_available():
        variants.append((QUANT, None))
    else:
        out["notes"].append("QuantizedCache skipped: optimum-quanto is not installed")
    rows: list[dict] = []
    out["rows"] = rows
    for kind, budget in variants:
        if bench.log.out_of_time():
            out["skipped"].append(f"{bench.label(kind, budget)}: --max-minutes reached")
            continue
        label = bench.label(kind, budget)
        chunk = s.dynamic_fill_chunk if kind == DYNAMIC else s.compress_every
        if s.a_fill == "direct" and kind == DYNAMIC:
            chunk = s.dynamic_direct_chunk
        log(
            f"[a] {label}: prompt {s.prompt}, then {'model chunks' if s.a_fill == 'model' else 'K/V writes'} "
            f"of {chunk} tokens up to {max(s.mem_points)} tokens"
        )
        base = bench.base()
        cache = bench.new_cache(kind, budget)
        try:
            nxt = bench.start(cache, 1)
            running_peak = 0
            t0 = time.perf_counter()
            for point in s.mem_points:
                if s.a_fill == "model":
                    bench.feed_model(cache, point - bench.seen(cache), chunk, 1)
                else:
                    bench.feed_direct(cache, point - bench.seen(cache), chunk, 1)
                fill_peak = bench.growth(bench.mem.peak_allocated(), base)
                at_rest = bench.growth(bench.mem.allocated(), base)
                seen, kept, cbytes = bench.seen(cache), bench.kept(cache), bench.cache_bytes(cache)
                bench.mem.reset_peak()
                times = []
                for _ in range(s.mem_decode_steps):
                    nxt, ms = bench.timed_step(cache, nxt)
                    times.append(ms)
                decode_peak = bench.growth(bench.mem.peak_allocated(), base)
                if fill_peak is not None:
                    running_peak = max(running_peak, fill_peak, decode_peak)
                rows.append(
                    dict(
                        cache=label,
                        kind=kind,
                        budget=budget,
                        tokens=seen,
                        kept=kept,
                        cache_bytes=cbytes,
                        full_cache_bytes=seen * bench.bpt,
                        resident_bytes=at_rest,
                        decode_peak_bytes=decode_peak,
                        peak_so_far_bytes=running_peak if fill_peak is not None else None,
                        reserved_bytes=bench.mem.reserved(),
                        max_reserved_bytes=bench.mem.peak_reserved(),
                        step_ms=median(times),
                        compactions=bench.compactions(cache),
                    )
                )
                bench.mem.reset_peak()
                log(
                    f"[a]   {label} T={seen:>6} kept={kept:>6} cache={cbytes / MIB:9.1f} MiB "
                    f"peak+={mib_text(running_peak if fill_peak is not None else None)} "
                    f"reserved={mib_text(bench.mem.reserved())} step={median(times):.1f} ms "
                    f"({time.perf_counter() - t0:.0f}s)"
                )
        except Exception as err:  # noqa: BLE001 - one variant failing must not lose the others
            out["errors"].append(f"{label}: {type(err).__name__}: {err}")
            log(f"[a]   {label} FAILED: {type(err).__name__}: {err}")
            traceback.print_exc()
        finally:
            cache = nxt = None
            bench.mem.clean()

    # The reclamation target (issue 4): at budget 2048, cache bytes and peak growth <= 1.1 x (budget + ce) x bpt.
    limit = int(1.1 * (s.budget + s.compress_every) * bench.bpt)
    main = [r for r in rows if r["kind"] == ROPE and r["budget"] == s.budget]
    gather = [r for r in rows if r["kind"] == GATHER]
    if main:
        cache_max = max(r["cache_bytes"] for r in main)
        peaks = [r["peak_so_far_bytes"] for r in main if r["peak_so_far_bytes"] is not None]
        decode_peaks = [r["decode_peak_bytes"] for r in main if r["decode_peak_bytes"] is not None]
        out["reclamation"] = dict(
            budget=s.budget,
            compress_every=s.compress_every,
            limit_bytes=limit,
            max_cache_bytes=cache_max,
            max_peak_growth_bytes=max(peaks) if peaks else None,
            max_decode_peak_growth_bytes=max(decode_peaks) if decode_peaks else None,
            gather_max_peak_growth_bytes=max(
                (r["peak_so_far_bytes"] for r in gather if r["peak_so_far_bytes"] is not None), default=None
            ),
            gather_max_cache_bytes=max((r["cache_bytes"] for r in gather), default=None),
            tokens=max(r["tokens"] for r in main),
        )
