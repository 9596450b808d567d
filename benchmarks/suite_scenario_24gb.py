"""Suite part c: the 24 GB scenario (Qwen3-32B shape, int4 weights with optimum-quanto, process capped at 24 GiB).

Where DynamicCache runs out of memory, and RopeKVCache(budget=2048) completing 32K tokens under the same cap.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

import baselines
import models
from common import GIB, Memory, Progress, forward, is_oom, median
from suite_harness import DYNAMIC, ROPE, Bench, Settings, mib_text

from hf_ropekv._compat import cache_kwarg  # after suite_harness, which imports hf_ropekv from the checkout


def _crop_dynamic(cache, length: int) -> None:
    """Cut every layer of a DynamicCache back to ``length`` tokens (undo a forward that ran out of memory)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.ndim == 4 and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
        if getattr(layer, "values", None) is not None and layer.values.ndim == 4 and layer.values.shape[-2] > length:
            layer.values = layer.values[..., :length, :]


def _trace_point(bench: Bench, cache) -> dict:
    """Tokens seen, allocated and peak memory, and cache bytes: one point of a part-c memory trace."""
    return dict(
        tokens=bench.seen(cache),
        allocated=bench.mem.allocated(),
        peak=bench.mem.peak_allocated(),
        cache=bench.cache_bytes(cache),
    )


def part_c(s: Settings, device: torch.device, log: Progress, mem: Memory, out: dict) -> None:
    if not baselines.quanto_available():
        out["errors"].append("optimum-quanto is not installed: run benchmarks/fetch_wheels.sh and carry .whl")
        log("[c] optimum-quanto missing: part c skipped")
        return
    redirected = baselines.use_quanto_python_unpack()
    cap_bytes = int(s.c_cap_gib * GIB)
    mem.clean()
    out["allocated_before_build"] = mem.allocated()
    fraction = mem.set_cap(cap_bytes)
    out.update(cap_bytes=cap_bytes, cap_fraction=fraction, quanto_python_unpack=redirected)
    config = models.make_config(s.shape_c)
    out["shape"] = dict(name=s.shape_c, **models.shape_summary(config))
    log(f"[c] building {s.shape_c} int4 (optimum-quanto, layer by layer) under a cap of {s.c_cap_gib:g} GiB")
    t0 = time.perf_counter()
    model = None
    try:
        groupings = [s.c_int4] + (["per-channel"] if s.c_int4 == "auto" else [])
        for grouping in groupings:
            try:
                model = models.build_random_model(
                    config,
                    dtype=getattr(torch, s.c_dtype),
                    device=device,
                    quantize="int4",
                    int4_grouping=grouping,
                    log=log,
                )
                # A sanity forward: quanto's int4 kernels must run on this torch / GPU.
                forward(model, torch.zeros(1, 4, dtype=torch.long, device=device), DynamicCache(config=config),
                        cache_kwarg(model))
                out["int4_grouping"] = grouping
                break
            except Exception as err:  # noqa: BLE001
                if is_oom(err) or grouping == groupings[-1]:
                    raise
                out["notes"].append(f"int4 grouping {grouping!r} failed ({type(err).__name__}: {err}); "
                                    "falling back to per-channel int4 (quanto's generic kernels)")
                log(f"[c] int4 {grouping} failed: {type(err).__name__}: {err}; trying per-channel")
                model = None
                mem.clean()
        bench = Bench(model, s, device, log, mem)
        weights = bench.base()
        qweight = model.get_decoder().layers[0].mlp.down_proj.weight
        out.update(
            build_s=time.perf_counter() - t0,
            weights_bytes=weights or models.weight_bytes(model),
            weight_tensor=type(qweight).__name__,
            bytes_per_token=bench.bpt,
        )
        log(f"[c] built in {out['build_s']:.0f}s: weights {mib_text(out['weights_bytes'])} ({type(qweight).__name__})")

        # ---- DynamicCache until it runs out of memory
        trace: list[dict] = []
        out["dynamic_trace"] = trace
        cache = bench.new_cache(DYNAMIC)
        nxt = bench.start(cache, 1)
        oom_at = None
        t1 = time.perf_counter()
        for chunk in s.c_stages:
            failed = False
            oom_at = None
            while bench.seen(cache) < s.c_target:
                good = bench.seen(cache)
                try:
                    if chunk == 1:
                        nxt = bench.step(cache, nxt)
                    else:
                        bench.step(cache, bench.random_ids(1, min(chunk, s.c_target - good)))
                except (RuntimeError, MemoryError) as err:
                    if not is_oom(err):
                        raise
                    failed = True
                if failed:
                    _crop_dynamic(cache, good)
                    mem.clean()
                    oom_at = good
                    log(f"[c] DynamicCache: out of memory after {good} tokens (chunk {chunk})")
                    break
                trace.append(_trace_point(bench, cache))
            if not failed:
                break
        if oom_at is None:
            log(f"[c] DynamicCache reached {bench.seen(cache)} tokens without running out of memory")
        out["dynamic"] = dict(
            completed=oom_at is None,
            tokens_reached=bench.seen(cache),
            oom_after_tokens=oom_at,
            peak_bytes=mem.peak_allocated(),
            cache_bytes=bench.cache_bytes(cache),
            seconds=time.perf_counter() - t1,
        )
        cache = nxt = None
        mem.clean()

        # ---- RopeKVCache(budget) to the target
        base = bench.base()
        trace = []
        out["ropekv_trace"] = trace
        cache = bench.new_cache(ROPE, s.budget)
        t1 = time.perf_counter()
        nxt = bench.start(cache, 1)
        total = s.c_target - bench.seen(cache)
        report_every = max(1, (total // s.compress_every) // 8)

        def on_chunk(index: int) -> None:
            trace.append(_trace_point(bench, cache))
            if index % report_every == 0:
                log(
                    f"[c] RopeKVCache: {bench.seen(cache)} tokens, kept {bench.kept(cache)}, "
                    f"peak {mib_text(mem.peak_allocated())} ({time.perf_counter() - t1:.0f}s)"
                )

        bench.feed_model(cache, total, s.compress_every, 1, on_chunk)
        times = []
        for _ in range(s.c_decode_steps):
            nxt, ms = bench.timed_step(cache, nxt)
            times.append(ms)
        out["ropekv"] = dict(
            completed=bench.seen(cache) >= s.c_target,
            tokens_reached=bench.seen(cache),
            kept=bench.kept(cache),
            compactions=bench.compactions(cache),
            peak_bytes=mem.peak_allocated(),
            peak_growth_bytes=bench.growth(mem.peak_allocated(), base),
            cache_bytes=bench.cache_bytes(cache),
            decode_step_ms=median(times),
            seconds=time.perf_counter() - t1,
        )
        log(
            f"[c] RopeKVCache(budget={s.budget}): {bench.seen(cache)} tokens, kept {bench.kept(cache)}, "
            f"peak {mib_text(mem.peak_allocated())}, decode step {median(times):.1f} ms"
        )
        cache = nxt = None
    finally:
        model = None
        mem.clean()
        mem.set_cap(None)
