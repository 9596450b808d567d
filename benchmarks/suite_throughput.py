"""Suite part b: decode throughput against context length, and capacity under a memory cap.

Tokens/s at each context and batch (ratio to DynamicCache), then the largest batch of 32K-token sequences that
fits the cap, searched with ``_probe`` (estimate, gallop, bisect), and the total tokens/s at that batch.
"""

from __future__ import annotations

import traceback

from common import GIB, MIB, is_oom
from suite_harness import DYNAMIC, GATHER, QUANT, ROPE, Bench, decode_point, mib_text

MAX_BATCH = 2048  # the capacity search stops here


def _probe(bench: Bench, kind: str, budget: int | None, batch: int, context: int) -> tuple[bool, int | None]:
    """Does a batch of ``batch`` rows fill to ``context`` tokens and decode (compacting, if budgeted) under the cap?"""
    base = bench.base()
    cache = nxt = None
    ok = True
    try:
        cache = bench.new_cache(kind, budget)
        nxt = bench.decode(cache, bench.fill(cache, kind, batch, context), 2)
        if kind in (ROPE, GATHER):
            bench.refill_to_full(cache, budget, batch)
            nxt = bench.decode(cache, nxt, 1)
        used = bench.mem.peak_allocated()
        used = bench.cache_bytes(cache) if used is None else used - base
    except (RuntimeError, MemoryError) as err:
        if not is_oom(err):
            raise
        ok, used = False, None
    cache = nxt = None
    bench.mem.clean()
    return ok, used


def largest_batch(bench: Bench, kind: str, budget: int | None, cap_bytes: int, base_bytes: int) -> dict:
    """Largest batch that passes ``_probe`` under the cap: estimate from batches 1 and 2, gallop, bisect.

    Budgeted caches are searched with a short fill (``prompt + budget + 3 compress_every``: the steady state, with
    compactions, is reached; their footprint no longer grows with the context), then the answer is verified at
    the full context by the timed run that follows.
    """
    s = bench.s
    context = s.capacity_context if kind in (DYNAMIC, QUANT) else min(
        s.capacity_context, s.prompt + 1 + budget + 3 * s.compress_every
    )
    probes: list[tuple[int, bool]] = []

    def fits(batch: int) -> bool:
        ok, _ = _probe(bench, kind, budget, batch, context)
        probes.append((batch, ok))
        bench.log(f"[b]   capacity {bench.label(kind, budget)} batch {batch}: {'fits' if ok else 'OOM'}")
        return ok

    ok1, used1 = _probe(bench, kind, budget, 1, context)
    probes.append((1, ok1))
    if not ok1:
        return dict(max_batch=0, probes=probes, search_context=context)
    ok2, used2 = _probe(bench, kind, budget, 2, context)
    probes.append((2, ok2))
    if not ok2:
        return dict(max_batch=1, probes=probes, search_context=context)
    per_row = max(1, (used2 or 0) - (used1 or 0))
    fixed = max(0, (used1 or 0) - per_row)
    estimate = max(2, int((cap_bytes - base_bytes - fixed) // per_row))
    bench.log(
        f"[b]   capacity {bench.label(kind, budget)}: ~{per_row / MIB:.1f} MiB per row -> estimate {estimate} rows"
    )
    lo, hi = 2, None
    step = max(1, estimate // 32)
    if estimate >= MAX_BATCH:
        estimate = MAX_BATCH
    if fits(estimate):
        lo = estimate
        while hi is None:
            if lo >= MAX_BATCH:
                hi = lo + 1  # enough: report the limit
            elif fits(min(lo + step, MAX_BATCH)):
                lo = min(lo + step, MAX_BATCH)
                step *= 2
            else:
                hi = min(lo + step, MAX_BATCH)
    else:
        hi = estimate
        while True:
            candidate = max(lo, hi - step)
            if candidate <= lo:
                break
            if fits(candidate):
                lo = candidate
                break
            hi = candidate
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return dict(max_batch=lo, probes=probes, search_context=context, per_row_bytes=per_row)


def part_b(bench: Bench, out: dict, with_d: bool) -> None:
    s, log = bench.s, bench.log
    rows: list[dict] = []
    out["rows"] = rows
    caches = [(DYNAMIC, None), (ROPE, s.budget), (GATHER, s.budget)]
    for batch in s.batches:
        for context in s.contexts:
            for kind, budget in caches:
                label = bench.label(kind, budget)
                if log.out_of_time():
                    out["skipped"].append(f"{label} batch {batch} T={context}: --max-minutes reached")
                    continue
                instrument = with_d and kind == ROPE and context == max(s.contexts)
                try:
                    row = decode_point(bench, kind, budget, batch, context, instrument=instrument)
                except Exception as err:  # noqa: BLE001
                    out["errors"].append(f"{label} batch {batch} T={context}: {type(err).__name__}: {err}")
                    log(f"[b] {label} batch {batch} T={context} FAILED: {type(err).__name__}: {err}")
                    traceback.print_exc()
                    continue
                rows.append(row)
                log(
                    f"[b] {label:34} batch {batch:>3} T={row['seen']:>6}: plain {row['plain_step_ms']:.2f} ms"
                    + (f", compaction step {row['compaction_step_ms']:.2f} ms" if row["compaction_step_ms"] else "")
                    + f", {row['tokens_per_s']:.1f} tok/s, peak+ {mib_text(row['peak_growth_bytes'])}"
                    + f" (host {row['plain_host_ms']:.2f} ms"
                    + (f", cudaMalloc/step {row['device_allocs_per_step']:.1f})" if row["device_allocs_per_step"] is not None else ")")
                )
    for row in rows:
        ref = next(
            (r for r in rows if r["kind"] == DYNAMIC and r["batch"] == row["batch"] and r["context"] == row["context"]),
            None,
        )
        row["ratio_to_dynamic"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref else None

    # ---- capacity under a cap
    cap_bytes = int(s.cap_gib * GIB)
    capacity: list[dict] = []
    out["capacity"] = dict(cap_bytes=cap_bytes, context=s.capacity_context, rows=capacity)
    base_bytes = bench.base()
    bench.mem.set_cap(cap_bytes)
    log(f"[b] capacity at {s.capacity_context} tokens under a cap of {s.cap_gib:g} GiB (weights {mib_text(base_bytes)})")
    try:
        for kind in s.capacity_caches:
            budget = s.budget if kind in (ROPE, GATHER) else None
            label = bench.label(kind, budget)
            if log.out_of_time():
                out["skipped"].append(f"capacity {label}: --max-minutes reached")
                continue
            try:
                found = largest_batch(bench, kind, budget, cap_bytes, base_bytes)
                batch = found["max_batch"]
                timed = None
                while batch > 0 and timed is None:
                    try:
                        timed = decode_point(bench, kind, budget, batch, s.capacity_context)
                    except (RuntimeError, MemoryError) as err:
                        if not is_oom(err):
                            raise
                        log(f"[b]   {label}: batch {batch} does not fit at the full context; trying fewer")
                        batch -= max(1, batch // 50)
                        bench.mem.clean()
                capacity.append(
                    dict(
                        cache=label,
                        kind=kind,
                        budget=budget,
                        max_batch=batch,
                        search=found,
                        tokens_per_s=timed["tokens_per_s"] if timed else None,
                        amortized_step_ms=timed["amortized_step_ms"] if timed else None,
                        peak_growth_bytes=timed["peak_growth_bytes"] if timed else None,
                    )
                )
                log(
                    f"[b] capacity {label}: max batch {batch}"
                    + (f", {timed['tokens_per_s']:.1f} tok/s total" if timed else "")
                )
            except Exception as err:  # noqa: BLE001
                out["errors"].append(f"capacity {label}: {type(err).__name__}: {err}")
                log(f"[b] capacity {label} FAILED: {type(err).__name__}: {err}")
                traceback.print_exc()
    finally:
        bench.mem.set_cap(None)
    ref = next((r for r in capacity if r["kind"] == DYNAMIC), None)
    for row in capacity:
        row["batch_ratio"] = row["max_batch"] / ref["max_batch"] if ref and ref["max_batch"] else None
        row["tokens_per_s_ratio"] = (
            row["tokens_per_s"] / ref["tokens_per_s"] if ref and ref["tokens_per_s"] and row["tokens_per_s"] else None
        )
