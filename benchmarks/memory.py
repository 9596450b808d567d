#!/usr/bin/env python
"""Memory: the KV bytes a cache holds, and the peak memory, over a long generation, against DynamicCache.

The memory entry point of ``benchmarks/README.md``. Batch 1, a short pinned prompt, then tokens up to 32K
(``--mem-points``) on a random-weight model of a published shape (Qwen3-8B by default). At each checkpoint, for
DynamicCache, RopeKVCache at three budgets, gather-and-rebind (``baselines.GatherRebindCache``) and transformers'
QuantizedCache (quanto int4, where optimum-quanto is installed): the cache's bytes (``bytes_held`` for RopeKVCache,
the bytes of every tensor a layer holds otherwise), the allocated memory beyond the weights at rest, its peak over
the whole generation so far and over a few real decode steps, and the reserved memory.

Decoding 32K tokens one at a time takes ~35 minutes per cache for the 8B shape, so the generation is emulated in
steady state: tokens go through the model in chunks of ``compress_every`` (one compaction per chunk, at the cache
state 128 single-token steps would leave; DynamicCache in chunks of 512, its footprint does not depend on how
tokens arrive). The chunk forwards make the whole-generation peak an upper bound of real decoding's.
``--a-fill direct`` writes random K/V through ``cache.update`` instead (faster; the decode steps still run the
model).

    python benchmarks/memory.py --commit SHA                     # Qwen3-8B shape, bf16, on CUDA
    python benchmarks/memory.py --budgets 2048 --mem-points 4096,32768
    python benchmarks/memory.py --dry-run --out /tmp/mem_dry     # tiny shapes on the CPU: a code check

Writes ``memory.json``, ``memory.md`` and ``README.md`` into ``--out`` (default
``benchmarks/results/memory_<date>_<device>/``); the JSON after every variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from typing import Callable

from common import (  # first: sets the hub defaults before transformers is imported
    MIB,
    Memory,
    Progress,
    StepTimer,
    add_run_args,
    apply_run_args,
    cache_tensor_bytes,
    fmt_bytes,
    forward,
    import_hf_ropekv,
    median,
    results_dir,
    run_device,
    run_header,
    run_metadata,
    write_results,
    write_run_readme,
)

import torch

import common

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RecencyScorer, RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import baselines  # noqa: E402

DYNAMIC, ROPE, GATHER, QUANT = "dynamic", "ropekv", "gather", "quantized"
STEM = "memory"


@dataclasses.dataclass
class Settings:
    shape: str = "qwen3-8b"
    dtype: str = "bfloat16"
    budgets: tuple[int, ...] = (1024, 2048, 4096)
    budget: int = 2048  # the headline budget: the reclamation target and gather-and-rebind
    compress_every: int = 128
    page_size: int = 64
    prompt: int = 64  # the short pinned prompt
    mem_points: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    mem_decode_steps: int = 4
    a_fill: str = "model"  # model: chunks through the model; direct: random K/V through cache.update (faster)
    dynamic_fill_chunk: int = 512
    dynamic_direct_chunk: int = 4096
    dry_run: bool = False
    scorer: str = "frequency"

    @classmethod
    def dry(cls) -> "Settings":
        """Every code path of the full run, at shapes a CPU gets through in seconds."""
        return cls(shape="tiny", dtype="float32", budgets=(32, 64), budget=64, compress_every=16, page_size=16,
                   prompt=8, mem_points=(64, 160), mem_decode_steps=2, dynamic_fill_chunk=64,
                   dynamic_direct_chunk=64, dry_run=True)


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


# ---------------------------------------------------------------------------------------------- the bench
class Bench:
    """One model on one device, and the caches compared, fed tokens the way decoding feeds them."""

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
        self.bpt = common.kv_bytes_per_token(model.config, self.dtype)
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
                self._stats = common.random_frequency_stats(self.model)
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

    def timed_step(self, cache, nxt: torch.Tensor) -> tuple[torch.Tensor, float]:
        return self.timer(lambda: self.step(cache, nxt))

    # ------------------------------------------------------------------------------ memory readings
    def base(self) -> int:
        self.mem.clean()
        self.mem.reset_peak()
        return self.mem.allocated() or 0

    def growth(self, value: int | None, base: int) -> int | None:
        return None if value is None else value - base


# ---------------------------------------------------------------------------------------------- measurement
def measure(bench: Bench, out: dict) -> None:
    """Every cache variant to every checkpoint of ``mem_points``: bytes held, peaks, a few real decode steps."""
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
            f"{label}: prompt {s.prompt}, then {'model chunks' if s.a_fill == 'model' else 'K/V writes'} "
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
                    f"  {label} T={seen:>6} kept={kept:>6} cache={cbytes / MIB:9.1f} MiB "
                    f"peak+={mib_text(running_peak if fill_peak is not None else None)} "
                    f"reserved={mib_text(bench.mem.reserved())} step={median(times):.1f} ms "
                    f"({time.perf_counter() - t0:.0f}s)"
                )
        except Exception as err:  # noqa: BLE001 - one variant failing must not lose the others
            out["errors"].append(f"{label}: {type(err).__name__}: {err}")
            log(f"  {label} FAILED: {type(err).__name__}: {err}")
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


def mib_text(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def render(result: dict) -> str:
    """The Markdown report: one row per cache and checkpoint, and the reclamation check."""
    s = result["settings"]
    lines = [
        "# Memory over a long generation",
        "",
        run_header(result["meta"], f"{s['shape']} {s['dtype']}, random weights"),
        "",
        f"Batch 1, prompt {s['prompt']} (pinned), fill: {s['a_fill']}; RopeKVCache compress_every "
        f"{s['compress_every']}, page_size {s['page_size']}, scorer {s['scorer']}. Peak = allocated beyond the "
        "weights, over the generation so far (an upper bound of decoding's: the chunk forwards count).",
        "",
        "| cache | tokens | kept | cache bytes | x DynamicCache | peak so far | decode peak | step ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    full = {r["tokens"]: r["cache_bytes"] for r in result["rows"] if r["kind"] == DYNAMIC}
    for r in result["rows"]:
        ref = full.get(r["tokens"])
        ratio = f"{r['cache_bytes'] / ref:.3f}" if ref else "n/a"
        lines.append(
            f"| {r['cache']} | {r['tokens']} | {r['kept']} | {fmt_bytes(r['cache_bytes'])} | {ratio} | "
            f"{mib_text(r['peak_so_far_bytes'])} | {mib_text(r['decode_peak_bytes'])} | {r['step_ms']:.2f} |"
        )
    rec = result.get("reclamation")
    if rec:
        met = rec["max_cache_bytes"] <= rec["limit_bytes"]
        lines += ["", f"Reclamation target at budget {rec['budget']}: cache bytes <= 1.1 x (budget + compress_every) "
                  f"x bytes per token = {fmt_bytes(rec['limit_bytes'])}; measured max {fmt_bytes(rec['max_cache_bytes'])}"
                  f" over {rec['tokens']} tokens: **{'met' if met else 'NOT met'}**."]
    for key in ("notes", "errors", "skipped"):
        if result[key]:
            lines += ["", f"{key.capitalize()}:"] + [f"- {x}" for x in result[key]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--max-minutes", type=float, default=None, help="start no new cache variant after this")
    p.add_argument("--shape", default=None, help=f"model shape, from {sorted(common.SHAPES)} (default qwen3-8b)")
    p.add_argument("--scorer", choices=("frequency", "recency", "online"), default="frequency",
                   help="RopeKVCache policy: frequency (default scorer, random statistics: the weights are random "
                   "too), recency, or online (statistics gathered from the prompt)")
    p.add_argument("--budgets", type=parse_ints, default=None, help="RopeKVCache budgets (default 1024,2048,4096)")
    p.add_argument("--mem-points", type=parse_ints, default=None, help="token counts measured at")
    p.add_argument("--a-fill", choices=("model", "direct"), default=None,
                   help="fill through the model in chunks (default) or write random K/V through cache.update")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    apply_run_args(args)
    s = Settings.dry() if args.dry_run else Settings()
    s.scorer = args.scorer
    for name in ("shape", "budgets", "mem_points", "a_fill"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    if s.budget not in s.budgets:
        s.budget = sorted(s.budgets)[len(s.budgets) // 2]
    device = run_device(args)
    out_dir = results_dir(STEM, args.out, device)
    log = Progress(args.max_minutes)
    torch.manual_seed(0)
    result: dict = dict(meta=run_metadata(device, args.commit, argv), settings=dataclasses.asdict(s),
                        rows=[], notes=[], errors=[], skipped=[])
    result["meta"]["quanto_python_unpack"] = baselines.use_quanto_python_unpack()
    model = common.build_random_model(common.make_config(s.shape), dtype=getattr(torch, s.dtype), device=device,
                                      log=log)
    result["settings"]["model"] = common.shape_summary(model.config)
    bench = Bench(model, s, device, log, Memory(device))
    result["settings"]["kv_bytes_per_token"] = bench.bpt
    measure(bench, result)
    markdown = render(result)
    write_results(out_dir, STEM, result, markdown)
    write_run_readme(out_dir, result["meta"], "memory.py", "Memory over a long generation, against DynamicCache")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
