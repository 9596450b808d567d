#!/usr/bin/env python
"""hf_ropekv benchmark suite (GitHub issue 4): memory, decode speed, capacity, the 24 GB scenario, overhead, fp16.

    python benchmarks/suite.py --out bench_out --commit $(git rev-parse HEAD)          # everything (~7-8 min H200)
    python benchmarks/suite.py --parts a,b,d --out out1 --commit SHA --max-minutes 8    # split in two calls
    python benchmarks/suite.py --parts c,e --out out2 --commit SHA --max-minutes 8
    python benchmarks/suite.py --dry-run --out /tmp/bench_dry                            # tiny shapes, CPU, < 1 min
    python benchmarks/report.py out1/results.json out2/results.json --out merged         # one report from two runs

Parts (benchmarks/README.md has the details and how the steady state is emulated):

a. memory over a long generation (batch 1, short pinned prompt, up to 32K tokens): cache bytes, peak allocated
   beyond the weights and reserved memory, for DynamicCache, RopeKVCache at three budgets, a gather-and-rebind
   eviction baseline and transformers' QuantizedCache (quanto int4) where optimum-quanto is installed;
b. decode throughput against context length at batch 1 and 16 (ratio to DynamicCache), and the largest batch of
   32K-token sequences that fits a fixed memory cap, with the total decode tokens/s at that batch;
c. the 24 GB scenario: Qwen3-32B shape, int4 weights (optimum-quanto), process capped at 24 GiB: where
   DynamicCache runs out of memory, and RopeKVCache(budget=2048) completing 32K tokens;
d. overhead: share of decode time spent scoring and compacting (budget 2048);
e. the fp16 path (what a T4 runs) at a smaller shape: kernels against their references, exactness, eviction.

Writes ``results.json`` (after every part), ``results.md`` and PNG plots into ``--out``; prints progress and the
final Markdown table. Every result records date, device, library versions, commit, dtype and shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (  # noqa: E402
    GIB,
    MIB,
    Memory,
    Progress,
    StepTimer,
    add_run_args,
    apply_run_args,
    cache_tensor_bytes,
    forward,
    import_hf_ropekv,
    is_oom,
    median,
    run_metadata,
)

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RecencyScorer, RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import baselines  # noqa: E402
import models  # noqa: E402
import report  # noqa: E402

PARTS = ("a", "b", "c", "d", "e")
MAX_BATCH = 2048  # the capacity search stops here
DYNAMIC, ROPE, GATHER, QUANT = "dynamic", "ropekv", "gather", "quantized"


# ============================================================================================== settings
@dataclasses.dataclass
class Settings:
    shape: str = "qwen3-8b"
    shape_c: str = "qwen3-32b"
    shape_e: str = "qwen3-1.7b"
    dtype: str = "bfloat16"  # parts a, b, d
    c_dtype: str = "bfloat16"  # part c (quanto's int4 "tinygemm" kernels take bf16 activations)
    budgets: tuple[int, ...] = (1024, 2048, 4096)
    budget: int = 2048  # the headline budget (parts b, c, d)
    compress_every: int = 128
    page_size: int = 64
    prompt: int = 64  # the short pinned prompt
    # part a
    mem_points: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    mem_decode_steps: int = 4
    a_fill: str = "model"  # model: chunks through the model; direct: random K/V through cache.update (faster)
    dynamic_fill_chunk: int = 512
    dynamic_direct_chunk: int = 4096  # K/V written per pass when filling a DynamicCache directly (parts b, d)
    # part b
    contexts: tuple[int, ...] = (2176, 8192, 32768)
    batches: tuple[int, ...] = (1, 16)
    warmup: int = 2
    timed_steps: int = 8
    compact_samples: int = 3
    cap_gib: float = 80.0
    capacity_context: int = 32768
    capacity_caches: tuple[str, ...] = (DYNAMIC, ROPE, GATHER)
    # part c
    c_cap_gib: float = 24.0
    c_target: int = 32768
    # No single-token stage: on the H200, quanto int4 decode steps of the 32B model past the OOM point took
    # the rest of a 10-minute call (2026-11-29); 64 tokens is fine resolution for where memory runs out.
    c_stages: tuple[int, ...] = (512, 64)
    c_decode_steps: int = 8
    c_int4: str = "auto"  # quanto int4 grouping: auto (groups of 128, tinygemm) or per-channel (generic kernels)
    # part e
    e_budget: int = 512
    e_context: int = 4096
    e_batch: int = 4
    e_gen_budget: int = 64
    e_gen_compress_every: int = 16
    e_gen_tokens: int = 100
    dry_run: bool = False
    scorer: str = "frequency"

    @classmethod
    def dry(cls) -> "Settings":
        # Every code path of the full run, at shapes a CPU gets through quickly. The CPU has no allocator to hit:
        # the caps are simulated on the caches' bytes (see common.Memory).
        return cls(
            shape="tiny",
            shape_c="tiny-int4",
            shape_e="tiny",
            dtype="float32",
            budgets=(32, 64, 96),
            budget=64,
            compress_every=16,
            page_size=16,
            prompt=8,
            mem_points=(64, 160),
            mem_decode_steps=2,
            dynamic_fill_chunk=64,
            dynamic_direct_chunk=64,
            contexts=(96, 200),
            batches=(1, 3),
            warmup=1,
            timed_steps=2,
            compact_samples=1,
            cap_gib=0.5 / 1024,  # 512 KiB of cache
            capacity_context=200,
            c_cap_gib=0.125 / 1024,  # 128 KiB of cache
            c_target=320,
            c_stages=(32, 8, 1),
            c_decode_steps=2,
            e_budget=32,
            e_context=128,
            e_batch=2,
            e_gen_budget=16,
            e_gen_compress_every=8,
            e_gen_tokens=24,
            dry_run=True,
        )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


# ============================================================================================== bench core
class Bench:
    """One model on one device, and the primitives every part is made of."""

    def __init__(self, model, settings: Settings, device: torch.device, log: Progress, mem: Memory) -> None:
        self.model = model
        self.s = settings
        self.device = device
        self.log = log
        self.mem = mem
        self.timer = StepTimer(device)
        self.kwarg = cache_kwarg(model)
        self.config = model.config
        self.dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        self.bpt = models.kv_bytes_per_token(model.config, self.dtype)
        self.gen = torch.Generator(device=device).manual_seed(1234)
        self._stats = None

    # ------------------------------------------------------------------------------ caches
    def scorer_kwargs(self) -> dict:
        if self.s.scorer == "recency":
            return {"scorer": RecencyScorer()}
        if self.s.scorer == "online":
            return {}
        if self._stats is None:
            try:
                self._stats = models.random_frequency_stats(self.model)
            except Exception as err:  # noqa: BLE001 - hf_ropekv internals moved: the product default still works
                self.log(f"random statistics unavailable ({type(err).__name__}: {err}); using online statistics")
                self.s.scorer = "online"
                return {}
        return {"stats": self._stats}

    def new_cache(self, kind: str, budget: int | None = None, compress_every: int | None = None):
        ce = compress_every or self.s.compress_every
        if kind == DYNAMIC:
            return DynamicCache(config=self.config)
        if kind == ROPE:
            return RopeKVCache(
                self.model, budget=budget, compress_every=ce, page_size=self.s.page_size, **self.scorer_kwargs()
            )
        if kind == GATHER:
            return baselines.GatherRebindCache(self.config, budget=budget, compress_every=ce)
        if kind == QUANT:
            return baselines.make_quantized_cache(self.config, nbits=4)
        raise ValueError(kind)

    @staticmethod
    def label(kind: str, budget: int | None = None) -> str:
        return {
            DYNAMIC: "DynamicCache",
            ROPE: f"RopeKVCache(budget={budget})",
            GATHER: f"gather-and-rebind(budget={budget})",
            QUANT: "QuantizedCache(quanto int4)",
        }[kind]

    @staticmethod
    def seen(cache) -> int:
        return int(cache.get_seq_length())

    @staticmethod
    def kept(cache) -> int:
        if isinstance(cache, (RopeKVCache, baselines.GatherRebindCache)):
            return int(cache.tokens_kept)
        return int(cache.get_seq_length())

    @staticmethod
    def compactions(cache) -> int:
        if isinstance(cache, RopeKVCache):
            return cache.num_compactions
        if isinstance(cache, baselines.GatherRebindCache):
            return cache.num_evictions
        return 0

    @staticmethod
    def cache_bytes(cache) -> int:
        return int(cache.bytes_held) if isinstance(cache, RopeKVCache) else cache_tensor_bytes(cache)

    # ------------------------------------------------------------------------------ token feeding
    def random_ids(self, batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, self.config.vocab_size, (batch, length), device=self.device, generator=self.gen)

    def step(self, cache, ids: torch.Tensor) -> torch.Tensor:
        out = forward(self.model, ids, cache, self.kwarg)
        self.check_cap(cache)
        return out

    def check_cap(self, cache) -> None:
        """CPU dry runs only: raise an out-of-memory error past the simulated cap (no allocator to hit there)."""
        if self.mem.cpu_cap_bytes is not None:
            self.mem.check_cpu_cap(self.cache_bytes(cache))

    def start(self, cache, batch: int) -> torch.Tensor:
        """The short prompt, then one decode step: from then on the prompt is pinned and the rest is "generated"."""
        nxt = self.step(cache, self.random_ids(batch, self.s.prompt))
        return self.step(cache, nxt)

    def feed_model(
        self, cache, tokens: int, chunk: int, batch: int, on_chunk: Callable[[int], None] | None = None
    ) -> None:
        """Run ``tokens`` random tokens through the model in chunks of ``chunk`` (what decoding does to a cache,
        ``chunk`` tokens at a time)."""
        done = 0
        index = 0
        while done < tokens:
            q = min(chunk, tokens - done)
            self.step(cache, self.random_ids(batch, q))
            done += q
            index += 1
            if on_chunk is not None:
                on_chunk(index)

    def feed_direct(self, cache, tokens: int, chunk: int, batch: int) -> None:
        """Write ``tokens`` random K/V into every layer through ``cache.update`` (the call a forward makes), ``chunk``
        tokens per pass over the layers, layers in order. Budgeted caches compact exactly as in a forward."""
        if tokens <= 0:
            return
        heads, dim = self.config.num_key_value_heads, self.config.head_dim
        width = min(chunk, tokens)

        def randn() -> torch.Tensor:
            return torch.randn(batch, heads, width, dim, device=self.device, dtype=self.dtype, generator=self.gen)

        pool = [(randn(), randn()) for _ in range(2 if tokens > width else 1)]
        done = 0
        index = 0
        while done < tokens:
            q = min(width, tokens - done)
            keys, values = pool[index % len(pool)]
            for layer_idx in range(self.config.num_hidden_layers):
                cache.update(keys[:, :, :q], values[:, :, :q], layer_idx)
            done += q
            index += 1
            self.check_cap(cache)
        del pool

    def refill_to_full(self, cache, budget: int, batch: int) -> None:
        """Top a budgeted cache up to ``budget + compress_every`` kept tokens: the next decode step compacts."""
        need = budget + self.s.compress_every - self.kept(cache)
        self.feed_direct(cache, need, max(need, 1), batch)

    def warm_up(self, cache, kind: str, budget: int | None, batch: int, context: int) -> torch.Tensor:
        """Bring a fresh cache to ``context`` tokens in steady state: the prompt and a decode step through the
        model, random K/V for the rest, one compaction for budgeted caches, then ``warmup`` decode steps.
        Returns the next input token."""
        nxt = self.fill(cache, kind, batch, context)
        if kind in (ROPE, GATHER):
            self.refill_to_full(cache, budget, batch)
            nxt = self.decode(cache, nxt, 1)  # compacts: a warm-up for the kernels at this shape
        return self.decode(cache, nxt, self.s.warmup)

    def fill(self, cache, kind: str, batch: int, context: int) -> torch.Tensor:
        """The prompt and a decode step through the model, then random K/V up to ``context`` tokens
        (``feed_direct``). Returns the next input token."""
        nxt = self.start(cache, batch)
        chunk = self.s.dynamic_direct_chunk if kind == DYNAMIC else self.s.compress_every
        self.feed_direct(cache, context - self.seen(cache), chunk, batch)
        return nxt

    def decode(self, cache, nxt: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            nxt = self.step(cache, nxt)
        return nxt

    def timed_step(self, cache, nxt: torch.Tensor) -> tuple[torch.Tensor, float]:
        return self.timer(lambda: self.step(cache, nxt))

    # ------------------------------------------------------------------------------ memory readings
    def base(self) -> int:
        self.mem.clean()
        self.mem.reset_peak()
        return self.mem.allocated() or 0

    def growth(self, value: int | None, base: int) -> int | None:
        return None if value is None else value - base


# ============================================================================================== part a
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
                    f"peak+={_mib(running_peak if fill_peak is not None else None)} "
                    f"reserved={_mib(bench.mem.reserved())} step={median(times):.1f} ms "
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


# ============================================================================================== parts b and d
@contextlib.contextmanager
def instrument_compaction(cache, timer: StepTimer):
    """Time the cache's selection (scoring all layers + top-k) and in-place compaction calls, synchronising
    around each (benchmark-only instrumentation of RopeKVCache internals)."""
    record: dict[str, list[float]] = {"select_ms": [], "compact_ms": []}
    restore: list[Callable[[], None]] = []

    def wrap(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            timer.sync()
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            timer.sync()
            record[key].append(1e3 * (time.perf_counter() - t0))
            return result

        setattr(owner, name, timed)
        if isinstance(owner, types.ModuleType):
            restore.append(lambda: setattr(owner, name, original))
        else:  # an instance attribute shadowing the class's method: drop it
            restore.append(lambda: delattr(owner, name))

    available = hasattr(cache, "_select") and hasattr(cache, "_full_layers")
    if available:
        import hf_ropekv.cache as cache_module

        wrap(cache, "_select", "select_ms")
        # Global selection compacts every layer in one call of cache.py's compact_arenas; per-layer selection
        # calls each storage's compact instead (which reaches the kernel through storage.py's own name).
        wrap(cache_module, "compact_arenas", "compact_ms")
        for layer in cache._full_layers:
            wrap(layer.storage, "compact", "compact_ms")
    try:
        yield record if available else None
    finally:
        for undo in reversed(restore):
            with contextlib.suppress(AttributeError):
                undo()


def decode_point(
    bench: Bench, kind: str, budget: int | None, batch: int, context: int, *, instrument: bool = False
) -> dict:
    """Fill a cache to ``context`` tokens (random K/V written through ``cache.update``), then time decode steps.

    Budgeted caches: the plain steps are timed between compactions, and compaction steps separately (the cache
    topped up to ``budget + compress_every`` before each); the amortised step is
    ``((ce - 1) * plain + compaction) / ce``, what decoding ``ce`` tokens costs.
    """
    s = bench.s
    budgeted = kind in (ROPE, GATHER)
    base = bench.base()
    cache = bench.new_cache(kind, budget)
    try:
        nxt = bench.warm_up(cache, kind, budget, batch, context)
        seen_at_start, kept_at_start = bench.seen(cache), bench.kept(cache)
        bench.mem.reset_peak()
        plain, host, allocs = [], [], []
        for _ in range(s.timed_steps):
            before = bench.compactions(cache)
            nxt, ms = bench.timed_step(cache, nxt)
            if bench.compactions(cache) != before:
                raise RuntimeError("a timed plain step compacted: raise budget or lower --timed-steps")
            plain.append(ms)
            host.append(bench.timer.last_host_ms)
            allocs.append(bench.timer.last_device_allocs)
        compact: list[float] = []
        breakdown = None
        if budgeted:
            for _ in range(s.compact_samples):
                bench.refill_to_full(cache, budget, batch)
                before = bench.compactions(cache)
                nxt, ms = bench.timed_step(cache, nxt)
                if bench.compactions(cache) != before + 1:
                    raise RuntimeError("the compaction step did not compact")
                compact.append(ms)
            if instrument and kind == ROPE:
                with instrument_compaction(cache, bench.timer) as record:
                    steps = []
                    for _ in range(s.compact_samples):
                        bench.refill_to_full(cache, budget, batch)
                        nxt, ms = bench.timed_step(cache, nxt)
                        steps.append(ms)
                if record is not None and record["select_ms"]:
                    n = len(steps)
                    breakdown = dict(
                        select_ms=sum(record["select_ms"]) / n,
                        compact_ms=sum(record["compact_ms"]) / n,
                        instrumented_step_ms=median(steps),
                    )
        peak = bench.growth(bench.mem.peak_allocated(), base)
        t_plain = median(plain)
        t_compact = median(compact) if compact else None
        ce = s.compress_every
        amortized = ((ce - 1) * t_plain + t_compact) / ce if t_compact is not None else t_plain
        return dict(
            cache=bench.label(kind, budget),
            kind=kind,
            budget=budget,
            batch=batch,
            context=context,
            seen=seen_at_start,
            kept=kept_at_start,
            plain_step_ms=t_plain,
            plain_steps_ms=plain,
            plain_host_ms=median(host),
            device_allocs_per_step=None if None in allocs else sum(allocs) / len(allocs),
            compaction_step_ms=t_compact,
            amortized_step_ms=amortized,
            tokens_per_s=1e3 * batch / amortized,
            peak_growth_bytes=peak,
            reserved_bytes=bench.mem.reserved(),
            cache_bytes=bench.cache_bytes(cache),
            breakdown=breakdown,
        )
    finally:
        cache = nxt = None
        bench.mem.clean()


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
                    + f", {row['tokens_per_s']:.1f} tok/s, peak+ {_mib(row['peak_growth_bytes'])}"
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
    log(f"[b] capacity at {s.capacity_context} tokens under a cap of {s.cap_gib:g} GiB (weights {_mib(base_bytes)})")
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


def part_d(bench: Bench, out: dict, b_rows: list[dict] | None) -> None:
    s, log = bench.s, bench.log
    context = max(s.contexts)
    rows: list[dict] = []
    out["rows"] = rows
    for batch in s.batches:
        row = None
        if b_rows:
            row = next(
                (
                    r
                    for r in b_rows
                    if r["kind"] == ROPE and r["budget"] == s.budget and r["batch"] == batch and r["context"] == context
                ),
                None,
            )
        if row is None or row.get("breakdown") is None:
            if log.out_of_time():
                out["skipped"].append(f"batch {batch}: --max-minutes reached")
                continue
            try:
                row = decode_point(bench, ROPE, s.budget, batch, context, instrument=True)
            except Exception as err:  # noqa: BLE001
                out["errors"].append(f"batch {batch}: {type(err).__name__}: {err}")
                traceback.print_exc()
                continue
        ce = s.compress_every
        per_cycle = ce * row["amortized_step_ms"]
        extra = max(0.0, row["compaction_step_ms"] - row["plain_step_ms"])
        entry = dict(
            batch=batch,
            context=context,
            budget=s.budget,
            compress_every=ce,
            plain_step_ms=row["plain_step_ms"],
            compaction_step_ms=row["compaction_step_ms"],
            amortized_step_ms=row["amortized_step_ms"],
            share_step_delta=extra / per_cycle,
        )
        if row.get("breakdown"):
            bd = row["breakdown"]
            entry.update(
                select_ms=bd["select_ms"],
                compact_ms=bd["compact_ms"],
                share_select=bd["select_ms"] / per_cycle,
                share_compact=bd["compact_ms"] / per_cycle,
                share_instrumented=(bd["select_ms"] + bd["compact_ms"]) / per_cycle,
            )
        rows.append(entry)
        log(
            f"[d] batch {batch} T={context}: compaction adds {extra:.2f} ms once per {ce} steps of "
            f"{row['plain_step_ms']:.2f} ms -> {100 * entry['share_step_delta']:.2f} % of decode time"
            + (
                f" (instrumented: scoring+selection {entry['select_ms']:.2f} ms, compaction {entry['compact_ms']:.2f} ms)"
                if "select_ms" in entry
                else ""
            )
        )


# ============================================================================================== part c
def _crop_dynamic(cache, length: int) -> None:
    """Cut every layer of a DynamicCache back to ``length`` tokens (undo a forward that ran out of memory)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.ndim == 4 and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
        if getattr(layer, "values", None) is not None and layer.values.ndim == 4 and layer.values.shape[-2] > length:
            layer.values = layer.values[..., :length, :]


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
        log(f"[c] built in {out['build_s']:.0f}s: weights {_mib(out['weights_bytes'])} ({type(qweight).__name__})")

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
                trace.append(
                    dict(
                        tokens=bench.seen(cache),
                        allocated=mem.allocated(),
                        peak=mem.peak_allocated(),
                        cache=bench.cache_bytes(cache),
                    )
                )
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
            trace.append(
                dict(
                    tokens=bench.seen(cache),
                    allocated=mem.allocated(),
                    peak=mem.peak_allocated(),
                    cache=bench.cache_bytes(cache),
                )
            )
            if index % report_every == 0:
                log(
                    f"[c] RopeKVCache: {bench.seen(cache)} tokens, kept {bench.kept(cache)}, "
                    f"peak {_mib(mem.peak_allocated())} ({time.perf_counter() - t1:.0f}s)"
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
            f"peak {_mib(mem.peak_allocated())}, decode step {median(times):.1f} ms"
        )
        cache = nxt = None
    finally:
        model = None
        mem.clean()
        mem.set_cap(None)


# ============================================================================================== part e
def part_e(s: Settings, device: torch.device, log: Progress, mem: Memory, out: dict) -> None:
    config = models.make_config(s.shape_e)
    out["shape"] = dict(name=s.shape_e, dtype="float16", **models.shape_summary(config))
    log(f"[e] building {s.shape_e} in float16")
    model = models.build_random_model(config, dtype=torch.float16, device=device)
    try:
        bench = Bench(model, s, device, log, mem)
        # ---- kernels against their PyTorch twins, fp16 keys in a strided arena view
        if device.type == "cuda":
            from hf_ropekv.kernels import compact as kc
            from hf_ropekv.kernels import score as ks
            from hf_ropekv.scoring import query_weights

            stats = models.random_frequency_stats(model)
            q_mean, q_abs = stats.for_layer(0)
            inv_freq = torch.tensor(stats.metadata["inv_freq"], dtype=torch.float32)
            w, c = query_weights(q_mean.to(device), q_abs.to(device), inv_freq.to(device), 40000)
            arena = torch.randn(2, config.num_key_value_heads, 1536, config.head_dim, device=device, dtype=torch.float16)
            keys = arena[:, :, :1400]
            got = ks.score_keys_triton(keys, w, c)
            want = ks.score_keys_reference(keys, w, c)
            rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            keep = torch.sort(torch.rand(2, config.num_key_value_heads, 1400, device=device).topk(900, dim=-1).indices)[0]
            a1, a2 = arena.clone(), arena.clone()
            kc.compact_triton_([a1], keep)
            kc.compact_reference_([a2], keep)
            out["kernels"] = dict(
                score_max_rel_err=rel, compact_exact=bool(torch.equal(a1, a2)), dtype="float16", backend="triton"
            )
            log(f"[e] fp16 kernels: score max rel err {rel:.2e}, compaction exact: {torch.equal(a1, a2)}")
        else:
            out["kernels"] = dict(backend="torch reference (no CUDA)")
        # ---- exactness through generate(): nothing evicted -> identical greedy tokens
        ids = bench.random_ids(2, 32)
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
            max_new_tokens=24,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        ref = model.generate(input_ids=ids, **{bench.kwarg: DynamicCache(config=config)}, **kwargs)
        got = model.generate(input_ids=ids, **{bench.kwarg: RopeKVCache(model, budget=None)}, **kwargs)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref.logits, got.logits))
        out["exact"] = dict(
            identical_tokens=bool(torch.equal(ref.sequences, got.sequences)),
            max_logit_diff=diff,
            finite_logits=all(bool(torch.isfinite(x).all()) for x in ref.logits),
        )
        log(f"[e] budget=None vs DynamicCache: identical tokens {out['exact']['identical_tokens']}, max |dlogit| {diff:.2e}")
        # ---- eviction through generate()
        cache = RopeKVCache(
            model, budget=s.e_gen_budget, compress_every=s.e_gen_compress_every, **bench.scorer_kwargs()
        )
        prompt = bench.random_ids(2, 8)
        seq = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=0,
            max_new_tokens=s.e_gen_tokens,
            do_sample=False,
            **{bench.kwarg: cache},
        )
        out["eviction"] = dict(
            budget=s.e_gen_budget,
            compress_every=s.e_gen_compress_every,
            new_tokens=int(seq.shape[1] - 8),
            seen=bench.seen(cache),
            kept=bench.kept(cache),
            compactions=bench.compactions(cache),
            kept_within_bound=bench.kept(cache) <= s.e_gen_budget + s.e_gen_compress_every,
        )
        log(f"[e] generate() with eviction: {out['eviction']}")
        cache = None
        # ---- decode speed, fp16
        rows = []
        for kind, budget in ((DYNAMIC, None), (ROPE, s.e_budget)):
            rows.append(decode_point(bench, kind, budget, s.e_batch, s.e_context))
            log(f"[e] {rows[-1]['cache']} batch {s.e_batch} T={s.e_context}: {rows[-1]['tokens_per_s']:.1f} tok/s")
        out["decode"] = rows
    finally:
        model = None
        mem.clean()


# ============================================================================================== main
def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e")
    add_run_args(p, out_default="bench_out")  # --out (results.json, results.md, *.png), --commit, --dry-run, ...
    p.add_argument("--max-minutes", type=float, default=None, help="skip what is left after this many minutes")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--scorer", choices=("frequency", "recency", "online"), default="frequency",
                   help="RopeKVCache policy: frequency (default scorer, random statistics), recency, or online "
                   "(default scorer, statistics gathered from the prompt)")
    p.add_argument("--budgets", type=_ints, default=None, help="part a budgets (default 1024,2048,4096)")
    p.add_argument("--mem-points", type=_ints, default=None, help="part a token counts")
    p.add_argument("--contexts", type=_ints, default=None, help="part b contexts (default 2176,8192,32768)")
    p.add_argument("--batches", type=_ints, default=None, help="part b batches (default 1,16)")
    p.add_argument("--cap-gib", type=float, default=None, help="part b capacity cap (default 80 GiB)")
    p.add_argument("--capacity-caches", default=None, help="part b capacity caches (default dynamic,ropekv,gather)")
    p.add_argument("--c-cap-gib", type=float, default=None, help="part c cap (default 24 GiB)")
    p.add_argument("--timed-steps", type=int, default=None)
    p.add_argument("--a-fill", choices=("model", "direct"), default=None,
                   help="part a: fill through the model in chunks (default; honest, slower) or write random K/V "
                   "through cache.update (about 3x faster; the decode steps at each checkpoint still run the model)")
    p.add_argument("--c-int4", choices=("auto", "per-channel"), default=None,
                   help="part c int4 grouping (default auto: quanto's groups of 128, tinygemm; falls back to "
                   "per-channel if that fails)")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings.dry() if args.dry_run else Settings()
    s.scorer = args.scorer
    for field, value in (
        ("budgets", args.budgets),
        ("mem_points", args.mem_points),
        ("contexts", args.contexts),
        ("batches", args.batches),
        ("cap_gib", args.cap_gib),
        ("c_cap_gib", args.c_cap_gib),
        ("timed_steps", args.timed_steps),
        ("c_int4", args.c_int4),
        ("a_fill", args.a_fill),
    ):
        if value is not None:
            setattr(s, field, value)
    if args.capacity_caches:
        s.capacity_caches = tuple(x.strip() for x in args.capacity_caches.split(",") if x.strip())
    if s.budget not in s.budgets:
        s.budget = sorted(s.budgets)[len(s.budgets) // 2]
    return s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_run_args(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    s = settings_from(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Progress(args.max_minutes)
    mem = Memory(device)
    torch.manual_seed(0)

    results: dict[str, Any] = {
        "meta": run_metadata(device, args.commit, sys.argv[1:] if argv is None else argv),
        "settings": {k: v for k, v in dataclasses.asdict(s).items()},
        "parts": {},
    }
    results["meta"]["hf_ropekv"] = getattr(hf_ropekv, "__version__", None)
    results["meta"]["hf_ropekv_path"] = str(Path(hf_ropekv.__file__).resolve().parent)
    results["meta"]["quanto_python_unpack"] = baselines.use_quanto_python_unpack()
    log(
        f"hf_ropekv benchmark suite: parts {','.join(parts)} on {results['meta']['device']} "
        f"(torch {torch.__version__}, transformers {results['meta']['transformers']}, "
        f"triton {results['meta']['triton']}, commit {results['meta']['commit'][:12]})"
        + (" [DRY RUN: tiny shapes]" if s.dry_run else "")
    )

    def save() -> None:
        results["meta"]["elapsed_s"] = round(log.elapsed(), 1)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out_dir / "results.md").write_text(report.render_markdown(results))

    def new_part(name: str, **extra) -> dict:
        entry = dict(errors=[], skipped=[], notes=[], **extra)
        results["parts"][name] = entry
        return entry

    status = 0
    try:
        with torch.no_grad():  # what generate() runs under
            if any(p in parts for p in "abd"):
                config = models.make_config(s.shape)
                log(f"building {s.shape} ({s.dtype}, random weights) on {device}")
                t0 = time.perf_counter()
                model = models.build_random_model(config, dtype=getattr(torch, s.dtype), device=device, log=log)
                bench = Bench(model, s, device, log, mem)
                weights = bench.base()
                shape = dict(name=s.shape, dtype=s.dtype, **models.shape_summary(config))
                common_info = dict(
                    shape=shape,
                    weights_bytes=weights or models.weight_bytes(model),
                    bytes_per_token=bench.bpt,
                    scorer=s.scorer,
                    attn_implementation="sdpa",
                )
                log(f"built in {time.perf_counter() - t0:.0f}s: weights {_mib(common_info['weights_bytes'])}, "
                    f"KV {bench.bpt / 1024:.0f} KiB per token")
                if "a" in parts:
                    entry = new_part("a", **common_info, method=report.METHOD_A, fill=s.a_fill)
                    if s.a_fill == "direct":
                        entry["notes"].append(
                            "fill: random K/V written through cache.update (--a-fill direct), not model chunks; "
                            "the decode steps at each checkpoint run the model"
                        )
                    part_a(bench, entry)
                    save()
                b_rows = None
                if "b" in parts:
                    entry = new_part("b", **common_info, method=report.METHOD_B)
                    part_b(bench, entry, with_d="d" in parts)
                    b_rows = entry["rows"]
                    save()
                if "d" in parts:
                    entry = new_part("d", **common_info, method=report.METHOD_D)
                    part_d(bench, entry, b_rows)
                    save()
                bench = model = None
                mem.clean()
            # Parts c and e build their own models; each failure is recorded and the next part still runs.
            for name, run_part, method in (("c", part_c, report.METHOD_C), ("e", part_e, report.METHOD_E)):
                if name not in parts:
                    continue
                entry = new_part(name, method=method, scorer=s.scorer)
                if log.out_of_time():
                    entry["skipped"].append("--max-minutes reached")
                else:
                    try:
                        run_part(s, device, log, mem, entry)
                    except Exception as err:  # noqa: BLE001
                        entry["errors"].append(f"{type(err).__name__}: {err}")
                        traceback.print_exc()
                save()
    except Exception:  # noqa: BLE001 - still write what was measured
        traceback.print_exc()
        status = 1
    finally:
        save()
        try:
            written = report.make_plots(results, out_dir)
            results["meta"]["plots"] = written
            save()
        except Exception as err:  # noqa: BLE001
            print(f"plots failed: {type(err).__name__}: {err}", flush=True)
    errors = [f"{name}: {e}" for name, part in results["parts"].items() for e in part.get("errors", [])]
    print()
    print(report.render_markdown(results), flush=True)
    log(f"done: {out_dir / 'results.json'}, {out_dir / 'results.md'}" + (f"; {len(errors)} error(s)" if errors else ""))
    return 1 if (status or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
