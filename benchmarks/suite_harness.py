"""The suite's shared harness: its settings, and the Bench every part drives caches with.

``Bench`` holds one model on one device and the primitives the parts are made of: the caches compared
(``DYNAMIC``, ``ROPE``, ``GATHER``, ``QUANT``), feeding tokens through the model or writing random K/V through
``cache.update`` to reach a context in steady state, and memory readings. ``decode_point`` times decode steps at
one (cache, batch, context), the measurement parts b, d and e share; ``instrument_compaction`` splits a
compaction step into selection and compaction. ``benchmarks/README.md`` explains the steady-state emulation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from typing import Callable

import torch

from common import MIB, Memory, Progress, StepTimer, cache_tensor_bytes, forward, import_hf_ropekv, median

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RecencyScorer, RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import baselines  # noqa: E402
import models  # noqa: E402

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


def parse_ints(text: str) -> tuple[int, ...]:
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


# ============================================================================================== timed decode points
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
        import hf_ropekv.cache.cache as cache_module

        wrap(cache, "_select", "select_ms")
        # Every compaction (global: all layers in one call; per layer: one call each) goes through cache.py's
        # compact_arenas.
        wrap(cache_module, "compact_arenas", "compact_ms")
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


def mib_text(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"
