#!/usr/bin/env python
"""Speed: the median decode step inside ``model.generate`` against DynamicCache, eager and ``static=True``.

The speed entry point of ``benchmarks/README.md``: DynamicCache, StaticCache and RopeKVCache (eager and compiled
``static=True``) on a random-weight model of a published shape, paired in one process.

Variants (``--variants``), alternated in one process at every decode point, because the host's speed drifts
between processes and the ratios only mean something within one:

- ``dynamic``: ``DynamicCache`` eager (``generate`` never compiles a DynamicCache);
- ``static``: transformers' ``StaticCache(max_cache_len=prompt + new tokens)``, compiled by ``generate`` itself:
  on CUDA it compiles the decode forward of any compileable cache with ``CompileConfig()`` (inductor, mode
  "reduce-overhead": CUDA graphs); the prefill runs eagerly, or compiled chunk by chunk when it is chunked;
- ``ropekv``: ``RopeKVCache(model, budget, static=False)`` eager (not compileable; the library's default,
  ``static="auto"``, would compile on CUDA for long generations);
- ``ropekv_static``: ``RopeKVCache(model, budget, static=True)``, compiled by ``generate`` the same way.

Every RopeKVCache is built with ``protect_prompt=False``: the prompts are longer than the budget, and nothing
should be pinned (as for a long document). A cache that cannot be built (``static=True`` before that option
exists) or a run that fails is an error entry in the results; the other variants go on.

What is measured, per variant and point (batch x prompt tokens): greedy ``generate()`` of ``--new-tokens`` tokens
(``min_new_tokens`` too, so nothing stops early) from random token ids with an all-ones mask. A decode step is the
gap between two successive logits on the host (``common.StepClock``; generate synchronises once per step). The
first decode step is left out (it compiles, for compiled variants), every later one counts, compaction steps
included: p50, p90 and mean. Also the prefill (time to the first logits), the peak allocated memory, the cache's
bytes (``bytes_held`` for RopeKVCache, its tensors otherwise) and, for compiled variants, the compile warm-up:
each compiled variant runs once, untimed, before the timed runs (the wall time of that first call minus the first
timed call's), and the graphs dynamo compiled during the timed runs (``torch._dynamo.utils.counters["stats"]
["unique_graphs"]``, the same counter in torch 2.11 and 2.13; the whole counter difference is in the JSON, graph
breaks included) and the CUDA graphs recorded then (inductor's cudagraph-tree counter; a new cache at a new
address makes cudagraph trees record again, without a dynamo recompile). ``torch._dynamo.reset()`` runs before
each point (``--no-dynamo-reset`` keeps what was compiled: later shapes then reuse an automatically dynamic
graph), so each point's compile warm-up is that of a fresh process.

cuDNN's sdpa backend is always off here (flash runs): it plans every new K/V length on the host and is not
bit-reproducible (benchmarks/README.md). ``--capacity`` finds, under an allocator cap (``--cap-gib``, default 80),
the largest batch at ``--capacity-context`` tokens for ``--capacity-variants`` (a memory model gives the first
batch, ``--capacity-batches`` overrides it; at most ``--capacity-runs`` runs each) and its decode tokens/s
(batch / p50 step). A bounded cache (RopeKVCache) holds the same slots whatever the context past
``budget + compress_every``, so its capacity runs may use a shorter prompt (``--capacity-prompt``); the prompt
used is recorded per run. Results are rewritten after every run (a process killed half way leaves what it had).

    python benchmarks/speed.py --out cd_b1 --commit SHA --points 1x4096,1x32768 --max-minutes 8
    python benchmarks/speed.py --out cd_16k --commit SHA --points 16x16384 --prefill-chunk auto
    python benchmarks/speed.py --out cd_32k --commit SHA --points 16x32768 --prefill-chunk auto --repeats 1
    python benchmarks/speed.py --out cd_cap --commit SHA --points none --capacity --capacity-prompt 4096
    python benchmarks/speed.py --dry-run --out /tmp/cd_dry     # tiny shapes on the CPU: a code check
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from common import (  # first: sets the hub defaults before transformers is imported
    GIB,
    Memory,
    Progress,
    StepClock,
    add_run_args,
    apply_run_args,
    cache_tensor_bytes,
    fmt_bytes,
    import_hf_ropekv,
    is_oom,
    run_device,
    run_generate,
    run_header,
    results_dir,
    run_metadata,
    write_results,
    write_run_readme,
)

import torch
import torch._dynamo
from transformers import CompileConfig, DynamicCache, StaticCache

import common

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402

STEM = "speed"
ALL_VARIANTS = "dynamic,static,ropekv,ropekv_static"


# ---------------------------------------------------------------------------------------------- the bench
@dataclass
class Bench:
    """Everything a measurement needs: the options, the model and where the results go."""

    args: argparse.Namespace
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    kwarg: str  # the keyword generate takes the cache under (``cache`` from transformers 5.24)
    weights: int  # bytes of the model's parameters and buffers
    mem: Memory
    log: Progress
    out_dir: Path
    result: dict[str, Any]
    compile_config: Any = None  # only for the CPU dry run: generate compiles by itself on CUDA alone
    simulate_prefill_oom: bool = False  # dry run: one simulated out-of-memory prefill, to run the retry path


# ---------------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    compiled: bool  # generate compiles its decode step (the cache is compileable)
    bounded: bool  # the cache's size stops growing with the context (a budget)
    make: Callable[[Bench, int], Any]  # (bench, prompt tokens) -> a fresh cache


def _ropekv(static: bool) -> Callable[[Bench, int], Any]:
    def make(bench: Bench, prompt_len: int) -> Any:
        # ``static`` is passed whenever the keyword exists: the eager variant says static=False explicitly, since the
        # default became "auto" (compiled on CUDA for long generations); before static caches landed it did not exist.
        extra = {"static": static} if "static" in inspect.signature(RopeKVCache).parameters else {}
        if static and not extra:
            extra = {"static": True}  # refused by such a version's RopeKVCache: reported as an unbuildable variant
        a = bench.args
        return RopeKVCache(bench.model, budget=a.budget, compress_every=a.compress_every, protect_prompt=False, **extra)

    return make


def _stock_sdpa(make: Callable[[Bench, int], Any]) -> Callable[[Bench, int], Any]:
    """``make``, run with transformers' own sdpa: a static RopeKVCache switches the model to its grouped-query
    sdpa (``hf_ropekv.model.attention``), which the other variants must not get."""

    def make_with_stock_sdpa(bench: Bench, prompt_len: int) -> Any:
        common.stock_sdpa(bench.model)
        return make(bench, prompt_len)

    return make_with_stock_sdpa


VARIANTS: dict[str, Variant] = {
    "dynamic": Variant("dynamic", "DynamicCache eager", False, False,
                       _stock_sdpa(lambda b, n: DynamicCache(config=b.model.config))),
    "static": Variant("static", "StaticCache compiled", True, False,
                      _stock_sdpa(lambda b, n: StaticCache(config=b.model.config, max_cache_len=n + b.args.new_tokens))),
    "ropekv": Variant("ropekv", "RopeKVCache eager", False, True, _stock_sdpa(_ropekv(static=False))),
    "ropekv_static": Variant("ropekv_static", "RopeKVCache(static=True) compiled", True, True, _ropekv(static=True)),
}


# ---------------------------------------------------------------------------------------------- small helpers
def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, interpolated linearly between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def step_stats(steps_ms: list[float]) -> dict[str, Any]:
    return dict(
        steps=len(steps_ms),
        p50_ms=percentile(steps_ms, 50),
        p90_ms=percentile(steps_ms, 90),
        mean_ms=sum(steps_ms) / len(steps_ms) if steps_ms else None,
    )


def dynamo_counters() -> dict[str, dict[str, int]]:
    """A copy of dynamo's global counters (``counters[group][key]``; ``stats.unique_graphs`` counts compiles)."""
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items()}


def counters_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    delta: dict[str, dict[str, int]] = {}
    for group, values in after.items():
        old = before.get(group, {})
        changed = {key: value - old.get(key, 0) for key, value in values.items() if value != old.get(key, 0)}
        if changed:
            delta[group] = changed
    return delta


def cudagraph_recordings(device: torch.device) -> int | None:
    """CUDA graphs inductor's cudagraph trees have recorded on ``device`` since the last dynamo reset.

    Private torch API (``CUDAGraphTreeManager.graph_counter``, an ``itertools.count``); ``None`` when unreadable.
    """
    if device.type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees

        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
        if manager is None:
            return 0
        return int(repr(manager.graph_counter).removeprefix("count(").removesuffix(")"))
    except Exception:  # noqa: BLE001 - a diagnostic, never worth failing a run for
        return None


def cache_bytes(cache: Any) -> int:
    held = getattr(cache, "bytes_held", None)
    return int(held) if held is not None else cache_tensor_bytes(cache)


def cache_kept(cache: Any) -> int:
    return int(getattr(cache, "tokens_kept", None) or cache.get_seq_length())


def random_prompt(bench: Bench, batch: int, length: int) -> torch.Tensor:
    gen = torch.Generator(device=bench.device).manual_seed(bench.args.seed)
    return torch.randint(0, bench.model.config.vocab_size, (batch, length), device=bench.device, generator=gen)


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1x4096,16x32768"`` -> ``[(1, 4096), (16, 32768)]`` (batch x prompt tokens); ``"none"`` -> ``[]``."""
    if text.strip().lower() in ("", "none"):
        return []
    return [tuple(int(x) for x in item.lower().split("x")) for item in text.split(",")]  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- prefill chunks
def auto_chunk(bench: Bench, batch: int, prompt_len: int) -> int | None:
    """Tokens per row of a prefill chunk so that a forward holds about ``--chunk-tokens`` tokens (a power of two,
    at least ``compress_every``, so it divides the power-of-two prompts); ``None`` when the prompt fits in one."""
    a = bench.args
    if batch * prompt_len <= a.chunk_tokens:
        return None
    per_row = max(a.compress_every, a.chunk_tokens // batch)
    return 1 << (per_row.bit_length() - 1)


def first_chunk(bench: Bench, batch: int, prompt_len: int) -> int | None:
    mode = bench.args.prefill_chunk
    if mode == "none":
        return None
    if mode == "auto":
        return auto_chunk(bench, batch, prompt_len)
    return int(mode)


def chunk_after_oom(bench: Bench, batch: int, prompt_len: int) -> int:
    quarter = max(bench.args.compress_every, prompt_len // 4)
    return auto_chunk(bench, batch, prompt_len) or 1 << (quarter.bit_length() - 1)


# ---------------------------------------------------------------------------------------------- one run
def generate_once(bench: Bench, variant: Variant, cache: Any, prompt: torch.Tensor, chunk: int | None,
                  clock: StepClock) -> dict[str, Any]:
    """One timed ``generate`` with ``cache``: step statistics, compile counters, memory."""
    kwargs: dict[str, Any] = {}
    if chunk is not None:
        kwargs["prefill_chunk_size"] = chunk
    if variant.compiled and bench.compile_config is not None:
        kwargs["compile_config"] = bench.compile_config
    before, recorded = dynamo_counters(), cudagraph_recordings(bench.device)
    bench.mem.reset_peak()
    allocated_before = bench.mem.allocated()
    run = run_generate(bench.model, cache, prompt, bench.args.new_tokens, bench.kwarg, clock=clock, **kwargs)
    delta, recorded_after = counters_delta(before, dynamo_counters()), cudagraph_recordings(bench.device)
    steps = run["steps_ms"][1:]  # the first decode step compiles (compiled variants): left out for all
    return dict(
        new_tokens=run["new_tokens"],
        wall_s=run["total_s"],
        prefill_ms=run["prefill_and_first_ms"],
        first_step_ms=run["steps_ms"][0] if run["steps_ms"] else None,
        **step_stats(steps),
        graphs_compiled=delta.get("stats", {}).get("unique_graphs", 0),
        cudagraphs_recorded=None if recorded is None or recorded_after is None else recorded_after - recorded,
        peak_allocated=bench.mem.peak_allocated(),
        allocated_before=allocated_before,
        cache_bytes=cache_bytes(cache),
        kept=cache_kept(cache),
        dynamo_counters=delta,
        steps_ms=steps,
    )


def try_run(bench: Bench, variant: Variant, prompt: torch.Tensor, chunk: int | None,
            check_cap: bool = False) -> dict[str, Any]:
    """Build a fresh cache and run ``generate_once``; a failure becomes the row's ``error`` instead of raising.

    ``check_cap``: on the CPU, hold the run's bytes (weights, activations, logits, the cache) against the
    simulated cap (``Memory.check_cpu_cap``), as the allocator cap does on a GPU.
    """
    row: dict[str, Any] = dict(variant=variant.key, batch=prompt.shape[0], prompt=prompt.shape[1],
                               prefill_chunk=chunk, error=None, oom=False)
    try:
        cache = variant.make(bench, prompt.shape[1])
    except Exception as err:  # noqa: BLE001 - e.g. TypeError: RopeKVCache(static=True) before the option exists
        return dict(row, error=f"constructing the cache: {type(err).__name__}: {err}", stage="construct")
    clock = StepClock()
    try:
        if bench.simulate_prefill_oom and chunk is None:
            bench.simulate_prefill_oom = False
            raise torch.OutOfMemoryError("dry run: a simulated out-of-memory error in the prefill")
        row.update(generate_once(bench, variant, cache, prompt, chunk, clock))
        if check_cap:
            bench.mem.check_cpu_cap(modelled_bytes(bench, prompt.shape[0]) + row["cache_bytes"])
    except Exception as err:  # noqa: BLE001 - recorded; the other variants go on
        row.update(error=f"{type(err).__name__}: {str(err)[:600]}", oom=is_oom(err),
                   stage="prefill" if not clock.stamps else "decode")
    return row


def log_row(bench: Bench, row: dict[str, Any], what: str) -> None:
    head = f"{VARIANTS[row['variant']].label:34} b{row['batch']} x {row['prompt']} {what}"
    if row["error"]:
        bench.log(f"{head}: FAILED ({row.get('stage')}): {row['error'][:200]}")
        return
    bench.log(
        f"{head}: p50 {row['p50_ms']:.2f} ms, p90 {row['p90_ms']:.2f}, mean {row['mean_ms']:.2f}; prefill "
        f"{row['prefill_ms'] / 1e3:.2f} s (chunk {row['prefill_chunk']}), first step {row['first_step_ms']:.0f} ms, "
        f"wall {row['wall_s']:.1f} s; graphs compiled {row['graphs_compiled']}, CUDA graphs recorded "
        f"{row['cudagraphs_recorded']}; peak {fmt_bytes(row['peak_allocated'])}, cache {fmt_bytes(row['cache_bytes'])}"
    )


# ---------------------------------------------------------------------------------------------- decode points
def measure_point(bench: Bench, batch: int, prompt_len: int) -> None:
    """Every variant at one point: compiled ones warm up once, then ``--repeats`` rounds, the order rotating."""
    a = bench.args
    point: dict[str, Any] = dict(batch=batch, prompt=prompt_len, prefill_chunk=first_chunk(bench, batch, prompt_len),
                                 runs=[], errors={}, skipped=[], summary={})
    bench.result["points"].append(point)
    if a.dynamo_reset:
        torch._dynamo.reset()  # a fresh compile per point, as in a process that runs one shape
    prompt = random_prompt(bench, batch, prompt_len)
    variants = [VARIANTS[key] for key in a.variants]
    if a.dry_run and (batch, prompt_len) == a.points[-1]:
        bench.simulate_prefill_oom = True
    for variant in variants:
        if variant.compiled:
            point_run(bench, point, variant, prompt, warmup=True, round_index=None)
    for round_index in range(a.repeats):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            point_run(bench, point, variant, prompt, warmup=False, round_index=round_index)
    point["summary"] = {v.key: summarize_variant(point, v) for v in variants}
    save(bench)


def point_run(bench: Bench, point: dict[str, Any], variant: Variant, prompt: torch.Tensor, *, warmup: bool,
              round_index: int | None) -> None:
    what = "warm-up" if warmup else f"round {round_index}"
    if variant.key in point["errors"]:
        return
    if bench.log.out_of_time():
        point["skipped"].append(f"{variant.key} {what}: past --max-minutes")
        return
    row = try_run(bench, variant, prompt, point["prefill_chunk"])
    bench.mem.clean()
    if row["oom"] and row["stage"] == "prefill" and point["prefill_chunk"] is None:
        point["runs"].append(dict(row, warmup=warmup, round=round_index, retried_chunked=True))
        point["prefill_chunk"] = chunk_after_oom(bench, *prompt.shape)
        point["chunked_after_oom_of"] = variant.key
        bench.log(f"{variant.label}: the prefill ran out of memory; from here on in chunks of {point['prefill_chunk']}")
        row = try_run(bench, variant, prompt, point["prefill_chunk"])
        bench.mem.clean()
    row.update(warmup=warmup, round=round_index)
    point["runs"].append(row)
    if row["error"]:
        point["errors"][variant.key] = row["error"]
    log_row(bench, row, what)
    if row["error"] and warmup and variant.compiled and bench.args.dynamo_reset:
        # A compiled run that failed can leave its CUDA-graph memory pool (and what it recorded) held by the
        # cudagraph trees: at batch 16 and 32K the next variant then ran out of memory. Compiled variants warm up
        # before the timed rounds, so a reset here costs only the warm-ups still to come.
        held = bench.mem.allocated()
        torch._dynamo.reset()
        bench.mem.clean()
        point.setdefault("reset_after_failure", []).append(
            dict(variant=variant.key, allocated_before=held, allocated_after=bench.mem.allocated()))
        if held is not None:
            bench.log(f"dynamo reset after {variant.label}'s failure: {fmt_bytes(held)} -> "
                      f"{fmt_bytes(bench.mem.allocated())} allocated")
    save(bench)


def summarize_variant(point: dict[str, Any], variant: Variant) -> dict[str, Any]:
    """Steps of every timed run pooled (the first decode step of each left out), and the run-level readings."""
    runs = [r for r in point["runs"] if r["variant"] == variant.key and not r["error"]]
    timed = [r for r in runs if not r["warmup"]]
    warm = [r for r in runs if r["warmup"]]
    if not timed and variant.key in point["errors"]:
        return dict(label=variant.label, error=point["errors"][variant.key])
    if not timed:
        return dict(label=variant.label, skipped="not run: past --max-minutes")
    same_shape = bool(warm) and warm[0]["prefill_chunk"] == timed[0]["prefill_chunk"]
    recorded = [r["cudagraphs_recorded"] for r in timed]
    peaks = [r["peak_allocated"] for r in timed if r["peak_allocated"] is not None]
    return dict(
        label=variant.label,
        runs=len(timed),
        **step_stats([s for r in timed for s in r["steps_ms"]]),
        prefill_ms=percentile([r["prefill_ms"] for r in timed], 50),
        compile_warmup_s=warm[0]["wall_s"] - timed[0]["wall_s"] if same_shape else None,
        graphs_compiled_in_warmup=warm[0]["graphs_compiled"] if warm else None,
        graphs_compiled_in_timed_runs=sum(r["graphs_compiled"] for r in timed),
        # inductor decides at compile time: a skipped step runs the compiled code without CUDA graphs
        cudagraph_skips=sum(r["dynamo_counters"].get("inductor", {}).get("cudagraph_skips", 0) for r in warm + timed),
        cudagraphs_recorded_in_timed_runs=None if None in recorded else sum(recorded),
        peak_allocated=max(peaks) if peaks else None,
        cache_bytes=timed[-1]["cache_bytes"],
        kept=timed[-1]["kept"],
    )


# ---------------------------------------------------------------------------------------------- capacity
def activation_bytes(bench: Bench) -> int:
    """Transient bytes of one forward of ``--chunk-tokens`` tokens: hidden-size tensors x 6, MLP-size x 3."""
    c = bench.model.config
    element = torch.empty((), dtype=bench.dtype).element_size()
    return bench.args.chunk_tokens * element * (6 * c.hidden_size + 3 * c.intermediate_size)


def logits_bytes_per_row(bench: Bench) -> int:
    return 3 * bench.model.config.vocab_size * 4  # generate's float32 copies of the last logits


def modelled_bytes(bench: Bench, batch: int) -> int:
    """Everything but the cache: weights, a prefill chunk's activations, the logits; plus headroom on CUDA for
    what the model leaves out (CUDA graph pools, the allocator's rounding and fragmentation)."""
    headroom = 2 * GIB if bench.device.type == "cuda" else 0
    return bench.weights + activation_bytes(bench) + batch * logits_bytes_per_row(bench) + headroom


def cache_row_bytes(bench: Bench, variant: Variant, prompt_len: int) -> int:
    """Modelled bytes one batch row of ``variant``'s cache holds: K/V (and slot positions for RopeKVCache)."""
    a, c = bench.args, bench.model.config
    per_token = common.kv_bytes_per_token(c, bench.dtype)
    if not variant.bounded:
        return per_token * (prompt_len + a.new_tokens)
    page = inspect.signature(RopeKVCache).parameters["page_size"].default
    slots = -(-(a.budget + a.compress_every) // page) * page
    positions = c.num_hidden_layers * c.num_key_value_heads * 8  # int64 slot positions per KV head and layer
    return slots * (per_token + positions)


def estimate_batch(bench: Bench, variant: Variant, prompt_len: int, cap: int) -> dict[str, Any]:
    row = cache_row_bytes(bench, variant, prompt_len) + logits_bytes_per_row(bench)
    free = cap - modelled_bytes(bench, 0)
    return dict(batch=max(1, free // row), bytes_per_row=row, fixed_bytes=modelled_bytes(bench, 0))


def capacity_cap(bench: Bench) -> int:
    """The allocator cap; on the CPU (dry run) a simulated one that fits two DynamicCache rows and not three."""
    if bench.device.type == "cuda":
        return int(bench.args.cap_gib * GIB)
    row = cache_row_bytes(bench, VARIANTS["dynamic"], bench.args.capacity_context) + logits_bytes_per_row(bench)
    return modelled_bytes(bench, 0) + int(2.5 * row)


def next_batch(runs: list[dict[str, Any]], step: int) -> int | None:
    """Gallop by ``step`` until a fit and a failure bracket the answer, then bisect; ``None`` once it is exact."""
    fit = max((r["batch"] for r in runs if r["fits"]), default=None)
    fail = min((r["batch"] for r in runs if not r["fits"]), default=None)
    if fail is None:
        return fit + step
    if fit is None:
        return max(1, fail - step) if fail > 1 else None
    return (fit + fail) // 2 if fail - fit > 1 else None


def capacity_search(bench: Bench, variant: Variant, cap: int, start: int | None) -> dict[str, Any]:
    a = bench.args
    prompt_len = a.capacity_prompt if variant.bounded else a.capacity_context
    estimate = estimate_batch(bench, variant, prompt_len, cap)
    batch = start or estimate["batch"]
    entry: dict[str, Any] = dict(label=variant.label, prompt=prompt_len, estimate=estimate, first_batch=batch,
                                 first_batch_given=start is not None, runs=[])
    bench.result["capacity"]["variants"][variant.key] = entry
    if variant.compiled and a.dynamo_reset:
        torch._dynamo.reset()
    step = max(1, round(0.05 * batch))
    while batch is not None and len(entry["runs"]) < a.capacity_runs:
        if bench.log.out_of_time():
            entry["stopped"] = "past --max-minutes"
            break
        row = capacity_run(bench, variant, batch, prompt_len)
        entry["runs"].append(row)
        save(bench)
        if row["error"] and not row["oom"]:
            break  # not a question of memory: a smaller batch would fail the same way
        batch = next_batch(entry["runs"], step)
    fits = [r for r in entry["runs"] if r["fits"]]
    best = max(fits, key=lambda r: r["batch"]) if fits else None
    failing = [r["batch"] for r in entry["runs"] if not r["fits"]]
    entry.update(
        largest_batch=best["batch"] if best else None,
        smallest_failing_batch=min(failing) if failing else None,
        p50_ms=best["p50_ms"] if best else None,
        tokens_per_s=1e3 * best["batch"] / best["p50_ms"] if best else None,
        peak_allocated=best["peak_allocated"] if best else None,
    )
    entry["exact"] = entry["smallest_failing_batch"] is not None and best is not None and (
        entry["smallest_failing_batch"] == best["batch"] + 1
    )
    return entry


def capacity_run(bench: Bench, variant: Variant, batch: int, prompt_len: int) -> dict[str, Any]:
    """One run at ``batch`` under the cap; the prefill is chunked whenever it exceeds ``--chunk-tokens``."""
    prompt = random_prompt(bench, batch, prompt_len)
    row = try_run(bench, variant, prompt, auto_chunk(bench, batch, prompt_len), check_cap=True)
    del prompt
    row["fits"] = row["error"] is None
    if row["oom"] and variant.compiled and bench.args.dynamo_reset:
        torch._dynamo.reset()  # an out-of-memory error inside a CUDA graph recording leaves the tree unusable
    if variant.bounded and hasattr(hf_ropekv, "release_static_buffers"):
        # The next run has another batch size: the arenas this one left in the model's pool would only hold
        # memory (at 1220a86 the run after an OOM at batch 180 failed at once, with 80.5 GiB in use).
        hf_ropekv.release_static_buffers(bench.model)
    bench.mem.clean()  # after the reset and the release: what they let go goes back to the device
    log_row(bench, row, "capacity")
    return row


def measure_capacity(bench: Bench) -> None:
    a = bench.args
    cap = capacity_cap(bench)
    bench.result["capacity"] = dict(cap_bytes=cap, context=a.capacity_context, bounded_prompt=a.capacity_prompt,
                                    new_tokens=a.new_tokens, chunk_tokens=a.chunk_tokens, variants={})
    starts = a.capacity_batches or [None] * len(a.capacity_variants)
    bench.mem.set_cap(cap)
    try:
        for key, start in zip(a.capacity_variants, starts):
            capacity_search(bench, VARIANTS[key], cap, start)
            save(bench)
    finally:
        bench.mem.set_cap(None)
    entries = bench.result["capacity"]["variants"]
    dyn, rope = entries.get("dynamic", {}), entries.get("ropekv_static", {})
    if dyn.get("tokens_per_s") and rope.get("tokens_per_s"):
        bench.result["capacity"]["ropekv_static_vs_dynamic_tokens_per_s"] = rope["tokens_per_s"] / dyn["tokens_per_s"]
    save(bench)


# ---------------------------------------------------------------------------------------------- report
def _f(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(ref: dict[str, Any], row: dict[str, Any]) -> str:
    if not ref.get("p50_ms") or not row.get("p50_ms"):
        return "n/a"
    return f"{ref['p50_ms'] / row['p50_ms']:.2f}×"


def render_point(point: dict[str, Any]) -> list[str]:
    chunk = point["prefill_chunk"]
    how = "in one piece" if chunk is None else f"in chunks of {chunk} tokens per row"
    if point.get("chunked_after_oom_of"):
        how += f" (after {point['chunked_after_oom_of']}'s unchunked prefill ran out of memory)"
    lines = [
        f"## Batch {point['batch']}, prompt {point['prompt']} tokens",
        "",
        f"Prefill {how}.",
        "",
        "| variant | p50 ms | p90 ms | mean ms | steps | prefill s | compile warm-up s | graphs compiled (timed) | "
        "CUDA graphs recorded (timed) | CUDA graph skips | peak allocated | cache | speed-up vs DynamicCache eager | "
        "speed-up vs StaticCache compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = point["summary"]
    dyn, sta = summary.get("dynamic", {}), summary.get("static", {})
    for key, row in summary.items():
        if row.get("error") or row.get("skipped"):
            what = f"error: {row['error'][:160]}" if row.get("error") else row["skipped"]
            lines.append(f"| {row['label']} | {what} |" + " |" * 12)
            continue
        recorded = row["cudagraphs_recorded_in_timed_runs"]
        lines.append(
            f"| {row['label']} | {_f(row['p50_ms'])} | {_f(row['p90_ms'])} | {_f(row['mean_ms'])} | {row['steps']} | "
            f"{_f(row['prefill_ms'] / 1e3)} | {_f(row['compile_warmup_s'], '.1f')} | "
            f"{row['graphs_compiled_in_timed_runs']} | {'n/a' if recorded is None else recorded} | "
            f"{row['cudagraph_skips']} | {fmt_bytes(row['peak_allocated'])} | {fmt_bytes(row['cache_bytes'])} | {_ratio(dyn, row)} | "
            f"{_ratio(sta, row)} |"
        )
    if point["skipped"]:
        lines += ["", "Not run (out of time): " + "; ".join(point["skipped"]) + "."]
    return lines + [""]


def render_capacity(section: dict[str, Any]) -> list[str]:
    lines = [
        f"## Capacity under a {fmt_bytes(section['cap_bytes'])} allocator cap",
        "",
        f"Context {section['context']} tokens for caches that grow with it; bounded caches (RopeKVCache) prefilled "
        f"with the prompt length in the table (their footprint stops growing past budget + compress_every). "
        f"{section['new_tokens']} new tokens; prefill chunked to about {section['chunk_tokens']} tokens per forward.",
        "",
        "| variant | prompt tokens | batches tried (fits?) | largest batch | p50 ms there | decode tok/s there | "
        "peak allocated |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in section["variants"].values():
        tried = ", ".join(f"{r['batch']} ({'yes' if r['fits'] else 'OOM' if r['oom'] else 'error'})"
                          for r in entry["runs"]) or "none"
        largest = "none" if entry.get("largest_batch") is None else str(entry["largest_batch"])
        if entry.get("largest_batch") is not None and not entry.get("exact"):
            largest += " (a lower bound: the next batch up was not tried)"
        lines.append(
            f"| {entry['label']} | {entry['prompt']} | {tried} | {largest} | {_f(entry.get('p50_ms'))} | "
            f"{_f(entry.get('tokens_per_s'), '.1f')} | {fmt_bytes(entry.get('peak_allocated'))} |"
        )
    ratio = section.get("ropekv_static_vs_dynamic_tokens_per_s")
    if ratio is not None:
        lines += ["", f"RopeKVCache(static=True) compiled / DynamicCache eager, total decode tok/s at each one's "
                      f"largest batch: **{ratio:.2f}×**."]
    errors = [f"{e['label']} at batch {r['batch']}: {r['error'][:200]}"
              for e in section["variants"].values() for r in e["runs"] if r["error"] and not r["oom"]]
    if errors:
        lines += ["", "Errors: " + "; ".join(errors)]
    return lines + [""]


def render(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Compiled decode inside model.generate",
        "",
        run_header(result["meta"], f"{s['shape']} {s['dtype']}, random weights, sdpa "
                                   f"(backends enabled: {', '.join(result['meta']['sdpa_backends'])})"),
        "",
        f"Greedy `generate()` of {s['new_tokens']} tokens from random prompts; RopeKVCache with budget {s['budget']}, "
        f"compress_every {s['compress_every']}, protect_prompt=False. A step is the gap between successive logits; "
        f"the first decode step of each run is left out, compaction steps count. {s['repeats']} timed run(s) per "
        f"variant and point, alternated; compiled variants ran once before them (compile warm-up = that call's wall "
        f"time minus the first timed call's). Compile: {s['compile']}; dynamo reset before each point: "
        f"{s['dynamo_reset']}. Speed-up = the reference's p50 / the variant's p50.",
        "",
    ]
    for point in result["points"]:
        lines += render_point(point)
    if result.get("capacity"):
        lines += render_capacity(result["capacity"])
    if result.get("stopped"):
        lines += [f"Stopped early: {result['stopped']}.", ""]
    return "\n".join(lines)


def save(bench: Bench, final: bool = False) -> None:
    """The JSON after every run; the Markdown too (printed only at the end)."""
    markdown = render(bench.result)
    if final:
        write_results(bench.out_dir, STEM, bench.result, markdown)
        write_run_readme(bench.out_dir, bench.result["meta"], "speed.py",
                         "Decode speed inside generate(): DynamicCache, StaticCache, RopeKVCache eager and static")
    else:
        write_results(bench.out_dir, STEM, bench.result)
        (bench.out_dir / f"{STEM}.md").write_text(markdown)


# ---------------------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.set_defaults(no_cudnn_sdpa=True)  # always: see the module docstring
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--variants", default=ALL_VARIANTS, help=f"comma-separated, from {ALL_VARIANTS}")
    p.add_argument("--points", default="1x4096,1x32768,16x16384,16x32768",
                   help="BATCHxPROMPT,... ('none': only --capacity)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per variant and point (alternated)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--prefill-chunk", default="none",
                   help="'none': one piece, and chunks (as 'auto') after an out-of-memory prefill; 'auto': chunks "
                   "of about --chunk-tokens tokens per forward; N: chunks of N tokens per row")
    p.add_argument("--chunk-tokens", type=int, default=32768, help="tokens per prefill forward for 'auto' chunks")
    p.add_argument("--no-dynamo-reset", dest="dynamo_reset", action="store_false",
                   help="keep compiled graphs between points (saves compile time; later points then run the "
                   "automatically dynamic graph)")
    p.add_argument("--recompile-limit", type=int, default=32,
                   help="torch._dynamo.config.recompile_limit (default 8: two compiled caches with chunked "
                   "prefills could reach it, and dynamo would then fall back to eager silently)")
    p.add_argument("--capacity", action="store_true", help="also the largest batch under --cap-gib")
    p.add_argument("--capacity-variants", default="dynamic,ropekv_static")
    p.add_argument("--capacity-batches", default=None,
                   help="first batch to try per capacity variant, in their order (e.g. 13,160); "
                   "default: from the memory model")
    p.add_argument("--capacity-runs", type=int, default=3, help="runs at most per capacity variant")
    p.add_argument("--capacity-context", type=int, default=32768,
                   help="prompt tokens for caches that grow with the context")
    p.add_argument("--capacity-prompt", type=int, default=32768,
                   help="prompt tokens for bounded caches (RopeKVCache); recorded per run")
    p.add_argument("--cap-gib", type=float, default=80.0)
    p.add_argument("--max-minutes", type=float, default=None, help="start no new run after this many minutes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.no_cudnn_sdpa = True
    if args.dry_run:
        args.shape, args.new_tokens, args.budget, args.compress_every = "tiny", 24, 32, 8
        args.points, args.chunk_tokens, args.capacity, args.repeats = "1x48,2x80", 64, True, 1
        args.capacity_context, args.capacity_prompt = 96, 64
    args.variants = [v for v in args.variants.split(",") if v]
    args.capacity_variants = [v for v in args.capacity_variants.split(",") if v]
    unknown = sorted(set(args.variants + args.capacity_variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {ALL_VARIANTS}")
    args.points = parse_points(args.points)
    if args.capacity_batches:
        args.capacity_batches = [int(b) for b in args.capacity_batches.split(",")]
        if len(args.capacity_batches) != len(args.capacity_variants):
            p.error("--capacity-batches needs one batch per --capacity-variants entry")
    return args


def setup(args: argparse.Namespace, argv: list[str]) -> Bench:
    apply_run_args(args)
    config = torch._dynamo.config  # ``cache_size_limit`` is the older name of ``recompile_limit``
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit",
            args.recompile_limit)
    device = run_device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    log = Progress(args.max_minutes)
    out_dir = results_dir("speed", args.out, device)
    model = common.build_random_model(common.make_config(args.shape), dtype=dtype, device=device, log=log)
    compile_config = None
    if device.type != "cuda":  # generate compiles by itself on accelerators only: ask for it, the cheap way
        compile_config = CompileConfig(backend="eager", mode=None)
        compile_config._compile_all_devices = True
    compile_note = ("generate's own default, CompileConfig() (inductor, reduce-overhead)" if compile_config is None
                    else "CompileConfig(backend='eager', _compile_all_devices=True) (CPU dry run: dynamo only)")
    settings = dict(
        shape=args.shape, dtype=str(dtype), new_tokens=args.new_tokens, budget=args.budget,
        compress_every=args.compress_every, repeats=args.repeats, variants=args.variants,
        points=[f"{b}x{n}" for b, n in args.points], prefill_chunk=args.prefill_chunk, chunk_tokens=args.chunk_tokens,
        dynamo_reset=args.dynamo_reset, recompile_limit=args.recompile_limit, compile=compile_note,
        model=common.shape_summary(model.config), weight_bytes=common.weight_bytes(model),
    )
    result = dict(meta=run_metadata(device, args.commit, argv), settings=settings, points=[], capacity=None)
    return Bench(args=args, model=model, device=device, dtype=dtype, kwarg=cache_kwarg(model),
                 weights=settings["weight_bytes"], mem=Memory(device), log=log, out_dir=out_dir, result=result,
                 compile_config=compile_config)


def prime(bench: Bench) -> None:
    """Every variant once, eagerly and briefly, before anything is compiled: kernels and allocator, and the state
    hf_ropekv leaves on the model. The first ``RopeKVCache(static=True)`` keeps its model hooks and rotary
    pass-through for the model's lifetime (so that the next static cache reuses the compiled step); a StaticCache
    step compiled before they appear would be compiled again once they do, inside the timed runs."""
    a = bench.args
    prompt = random_prompt(bench, 1, min(64, a.budget))
    for key in dict.fromkeys(a.variants + (a.capacity_variants if a.capacity else [])):
        try:
            cache = VARIANTS[key].make(bench, prompt.shape[1])
            run_generate(bench.model, cache, prompt, 4, bench.kwarg, disable_compile=True)
        except Exception as err:  # noqa: BLE001 - the measurement records it
            bench.log(f"priming {key} failed ({type(err).__name__}: {str(err)[:120]})")
        cache = None
    bench.mem.clean()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    bench = setup(args, argv)
    prime(bench)
    for batch, prompt_len in args.points:
        if bench.log.out_of_time():
            bench.result["stopped"] = f"past --max-minutes before batch {batch} x {prompt_len}"
            break
        bench.log(f"point: batch {batch}, prompt {prompt_len}")
        measure_point(bench, batch, prompt_len)
    if args.capacity and not bench.result.get("stopped"):
        bench.log("capacity")
        measure_capacity(bench)
    save(bench, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
