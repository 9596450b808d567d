#!/usr/bin/env python
"""Warm-up and per-step costs of the compiled decode step (issue 27): what a user waits for, and where it goes.

Four parts (``--parts``), each run in subprocesses of its own where process state matters (torch's in-memory
compile state, its on-disk caches, the allocator), on a random-weight model of a published shape (default
Qwen3-8B, bf16, sdpa with cuDNN off: benchmarks/README.md). Every ``RopeKVCache`` has ``protect_prompt=False``
(the prompts are longer than the budget).

- ``warmup``: the first ``generate()`` with ``RopeKVCache(static=True)`` (batch 1, budget 2048, a 4K prompt, a few
  tokens), in three fresh processes: (a) ``cold``, empty inductor / Triton cache folders; (b) ``warm``, the same
  folders again (what a second run on one machine gets); (c) ``load``, empty folders again but first
  ``hf_ropekv.load_compile_artifacts`` of the file (a) saved with ``save_compile_artifacts`` (a fresh machine
  given the file). Each reports the process's start-up, model build, the time to the first token (the prefill,
  eager), the first decode step (the compile), the whole first call, the same call again (compiled) and torch's
  cache counters (``fxgraph_cache_hit``/``miss``, ``autograd_cache_hit``/``miss``). ``--warmup-cache static``
  compiles transformers' ``StaticCache`` instead (cold and warm only): the model's own compile, what the cache's
  warm-up is compared with.
- ``profile``: one process, batch 1, budget 2048, contexts 4K and 32K: ``DynamicCache`` eager, compiled
  ``StaticCache`` and compiled ``RopeKVCache(static=True)``, each warmed up then timed (median step). For each,
  one run with host timers (``instrument.py``: the cache's host work, transformers' input preparation, the forward
  call, and the rest of generate's loop, per step) and one run under ``torch.profiler`` over ``--profile-steps``
  steps (GPU kernel time and GPU busy time per step, against the wall time). ``--profile-variants`` may add
  ``ropekv_graphed`` (``static=True, cuda_graphs=True``: the eager step replayed as a CUDA graph, what the default
  cache decodes with on one GPU).
- ``overhead``: one process, batch 16, budget 2048, a 4K prompt: what the query statistics cost the compiled static
  cache's decoding step. Variants: ``file`` (``stats=`` a statistics file: nothing gathered in the step, the
  reference), ``off`` (online statistics, ``learn_workload=False``: the default), ``on`` (they also feed the
  workload, ``freeze_at`` raised so it keeps learning) and ``frozen`` (``learn_workload=True`` after
  ``workload_statistics(model).freeze()``). ``--overhead-rounds`` rounds of short runs (``--overhead-new-tokens``)
  alternate file / off / on in a rotating order; after the freeze (it cannot be undone) as many alternate file /
  off / frozen. The host drifts by several per cent within a process, so each variant is also paired with the
  reference run of its own round (median of the per-round ratios), and one run of each is profiled: GPU kernel
  time per step (``torch.profiler``) and the cache's host time per step (timers), whose excess over ``file`` no
  drift reaches.
- ``e2e``: a 2,000-token generation at 4K, batch 1, end to end (cache construction, prefill, compile, decode): one
  process warms the on-disk caches (a few tokens of each variant), then each variant runs in a fresh process of
  its own: ``RopeKVCache(model, budget=2048)`` with its default ``static`` (its ``static`` and, if the attribute
  exists, ``static_reason`` and ``cuda_graphs`` are recorded), explicit ``static=True``, and ``DynamicCache`` eager.
  Ratios against DynamicCache. The warming process runs only the timed variants. ``--e2e-cold`` first runs the
  default cache end to end in a process with empty torch cache folders (inductor, Triton, CUDA): a fresh machine. ``--e2e-rounds N`` runs the variants N times, the order reversed every other round, and gives each
  round's ratio (the host drifts between processes: a ratio is taken between runs close in time).

All parts share one folder of torch caches (``--cache-root``/warm, a temporary folder by default; the ``warmup``
part's (a) and (b) use it too, so parts after it in one command start warm); (c) uses ``--cache-root``/fresh.
``--max-minutes`` starts no part whose estimate (``ESTIMATE_MIN``) would not fit and gives every subprocess only
the time left. Results: ``results.json`` (every number), ``results.md`` and ``README.md`` in ``--out``; each part's
subprocesses write ``parts/*.json`` and ``logs/*.log`` there as they finish.

    python benchmarks/warmup.py --parts warmup,overhead --commit SHA --out warm_a --max-minutes 9.5  # ~8.5 min
    python benchmarks/warmup.py --parts profile --commit SHA --out warm_b --max-minutes 9.5           # ~7.5 min
    python benchmarks/warmup.py --parts e2e --commit SHA --out warm_c --max-minutes 9.5               # ~6 min
    python benchmarks/warmup.py --dry-run --out /tmp/warm_dry     # tiny shapes on the CPU: a code check (~2.5 min)
    python benchmarks/warmup.py --parts warmup --warmup-modes cold,warm --dynamic-batch false ...  # the step
                                                       # specialised to batch 1: what the dynamic batch costs
    python benchmarks/warmup.py --parts warmup --warmup-modes cold,warm --warmup-cache static ...  # the baseline

All four parts together need about 22 minutes of an H200 (``ESTIMATE_MIN``, cold caches): more than one
10-minute device call, hence the three commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from common import (  # first: sets the hub defaults before transformers is imported
    Progress,
    StepClock,
    add_run_args,
    apply_run_args,
    import_hf_ropekv,
    median,
    results_dir,
    run_device,
    run_generate,
    run_header,
    run_metadata,
    write_results,
    write_run_readme,
)

import torch
import torch._dynamo

import common
import instrument

SCRIPT = Path(__file__).resolve()
PARTS = ("warmup", "profile", "overhead", "e2e")
#: --dynamic-batch: RopeKVCache(dynamic_batch=...)
DYNAMIC_BATCH = {"true": True, "false": False, "auto": "auto"}
#: Minutes of device time each part is expected to take on an H200 with the default sizes, cold caches (the
#: ``--max-minutes`` guard); a dry run's parts take a fraction of a minute each but ``warmup`` (inductor on the CPU).
ESTIMATE_MIN = {"warmup": 4.5, "profile": 7.5, "overhead": 5.0, "e2e": 6.0}
#: The warm-up part's share per process (``--warmup-modes``): the cold compile is most of it.
WARMUP_MODE_SHARE = {"cold": 0.5, "warm": 0.25, "load": 0.25}
E2E_WARM_SHARE = 0.4  # of ESTIMATE_MIN["e2e"]: the warming process; each timed variant a third of the rest
DRY_ESTIMATE_MIN = {"warmup": 2.0, "profile": 0.5, "overhead": 0.5, "e2e": 1.0}
E2E_VARIANTS = ("ropekv_default", "ropekv_static", "dynamic")
PROFILE_VARIANTS = ("dynamic", "static", "ropekv_static", "ropekv_graphed")
DEFAULT_PROFILE_VARIANTS = ("dynamic", "static", "ropekv_static")
WARMUP_CACHES = ("ropekv_static", "static")  # what the warm-up part compiles (static: transformers' StaticCache)
LABELS = {
    "dynamic": "DynamicCache eager",
    "static": "StaticCache compiled",
    "ropekv_static": "RopeKVCache(static=True) compiled",
    "ropekv_graphed": "RopeKVCache(static=True, cuda_graphs=True) eager step as a CUDA graph",
    "ropekv_default": "RopeKVCache defaults (static, cuda_graphs)",
}


# ---------------------------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)}")
    p.add_argument("--max-minutes", type=float, default=None, help="start no part that would not fit")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of warmup and e2e")
    p.add_argument("--warmup-new-tokens", type=int, default=8)
    p.add_argument("--profile-contexts", default="4096,32768")
    p.add_argument("--profile-new-tokens", type=int, default=256, help="tokens of each timed profile run")
    p.add_argument("--profile-steps", type=int, default=64, help="decode steps under torch.profiler")
    p.add_argument("--profile-variants", default=",".join(DEFAULT_PROFILE_VARIANTS),
                   help=f"comma-separated, from {','.join(PROFILE_VARIANTS)}")
    p.add_argument("--overhead-batch", type=int, default=16)
    p.add_argument("--overhead-context", type=int, default=4096)
    p.add_argument("--overhead-new-tokens", type=int, default=128, help="tokens of each overhead run")
    p.add_argument("--overhead-rounds", type=int, default=4,
                   help="overhead: rounds before and after the freeze, each one short run of every variant")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per variant (profile, overhead)")
    p.add_argument("--e2e-new-tokens", type=int, default=2000)
    p.add_argument("--e2e-variants", default=",".join(E2E_VARIANTS),
                   help="comma-separated subset timed end to end (the warming process runs these)")
    p.add_argument("--e2e-cold", action="store_true",
                   help="e2e: first the default RopeKVCache in a process with empty cache folders (a fresh machine)")
    p.add_argument("--e2e-rounds", type=int, default=1,
                   help="rounds of the timed e2e variants, each variant a fresh process per round, the order reversed "
                        "every other round (A B, B A, ...): the host's speed drifts between processes, so each "
                        "round's ratio pairs runs that were close in time")
    p.add_argument("--cache-root", default=None, help="torch cache folders go here (default: a temporary folder)")
    p.add_argument("--keep-caches", action="store_true", help="leave --cache-root behind")
    p.add_argument("--recompile-limit", type=int, default=32)
    p.add_argument("--dynamic-batch", choices=tuple(DYNAMIC_BATCH), default="auto",
                   help="RopeKVCache(dynamic_batch=...) for every RopeKVCache of the run (true: one compiled step for "
                        "every batch size; false: specialised to its batch size, a shorter trace; auto, the "
                        "library's default: specialised while the model has compiled only batch 1)")
    p.add_argument("--warmup-modes", default="cold,warm,load",
                   help="the warm-up part's processes, from cold,warm,load (warm needs cold; load needs cold's file)")
    p.add_argument("--warmup-cache", choices=WARMUP_CACHES, default="ropekv_static",
                   help="the warm-up part's cache: ropekv_static, or static (transformers' compiled StaticCache "
                        "sized to the prompt and new tokens: the model's own compile, the baseline; no artifacts, so "
                        "no load mode)")
    p.add_argument("--bytecode-cache", default=None, metavar="DIR",
                   help="Python bytecode of every installed module compiled into DIR before the first process "
                        "(PYTHONPYCACHEPREFIX), as pip install leaves it; without it, an environment with "
                        "PYTHONDONTWRITEBYTECODE=1 (the GPU machine's) compiles every module each process imports, "
                        "dynamo's and inductor's included, inside the timings")
    p.add_argument("--seed", type=int, default=0)
    # internal: one subprocess's job
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.no_cudnn_sdpa = True  # always (benchmarks/README.md)
    args.warmup_modes = [m for m in args.warmup_modes.split(",") if m]
    if not args.warmup_modes or set(args.warmup_modes) - {"cold", "warm", "load"} or (
            "cold" not in args.warmup_modes):
        p.error("--warmup-modes: a subset of cold,warm,load that includes cold (the others start from its caches)")
    if args.warmup_cache == "static" and "load" in args.warmup_modes:
        p.error("--warmup-cache static saves no artifacts (save_compile_artifacts takes a RopeKVCache): leave load "
                "out of --warmup-modes")
    if args.dry_run:
        args.shape, args.budget, args.compress_every, args.context = "tiny", 32, 8, 48
        args.warmup_new_tokens, args.profile_contexts, args.profile_new_tokens, args.profile_steps = 4, "48,80", 24, 6
        args.overhead_batch, args.overhead_context, args.overhead_new_tokens, args.repeats = 2, 48, 16, 1
        args.overhead_rounds = 1
        args.e2e_new_tokens = 40
    args.parts = [part for part in args.parts.split(",") if part]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    args.profile_contexts = [int(c) for c in args.profile_contexts.split(",") if c]
    args.profile_variants = [v for v in args.profile_variants.split(",") if v]
    unknown = set(args.profile_variants) - set(PROFILE_VARIANTS)
    if unknown:
        p.error(f"--profile-variants: unknown {sorted(unknown)}; choose from {','.join(PROFILE_VARIANTS)}")
    args.dynamic_batch = DYNAMIC_BATCH[args.dynamic_batch]  # the option's value, for every RopeKVCache of the run
    args.e2e_variants = [v for v in args.e2e_variants.split(",") if v]
    if not args.e2e_variants or set(args.e2e_variants) - set(E2E_VARIANTS):
        p.error(f"--e2e-variants: a non-empty subset of {','.join(E2E_VARIANTS)}")
    if args.e2e_rounds < 1:
        p.error("--e2e-rounds: at least 1")
    return args


# ---------------------------------------------------------------------------------------------- child helpers
@dataclasses.dataclass
class Child:
    """A subprocess's model and settings."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    model: Any
    kwarg: str
    build_s: float
    compile_config: Any  # None on CUDA: generate's own CompileConfig()
    hf_ropekv: Any


def child_setup(args: argparse.Namespace, batch_backend: str = "eager") -> Child:
    """The model of a subprocess; on the CPU (dry run) generate is told to compile with ``batch_backend``."""
    from transformers import CompileConfig

    from hf_ropekv._compat import cache_kwarg

    apply_run_args(args)
    config = torch._dynamo.config
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit",
            args.recompile_limit)
    hf_ropekv = import_hf_ropekv()
    device = run_device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = common.build_random_model(common.make_config(args.shape), dtype=dtype, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    compile_config = None
    if device.type != "cuda":  # generate compiles by itself on accelerators only: ask for it
        compile_config = CompileConfig(backend=batch_backend, mode=None)
        compile_config._compile_all_devices = True
    return Child(args, device, dtype, model, cache_kwarg(model), build_s, compile_config, hf_ropekv)


def make_cache(child: Child, variant: str, max_cache_len: int | None = None, **options: Any) -> Any:
    from transformers import DynamicCache, StaticCache

    a = child.args
    if variant == "dynamic":
        common.stock_sdpa(child.model)
        return DynamicCache(config=child.model.config)
    if variant == "static":
        common.stock_sdpa(child.model)
        return StaticCache(config=child.model.config, max_cache_len=max_cache_len)
    if variant == "ropekv_static":
        options = dict(options, static=True)
    elif variant == "ropekv_graphed":
        options = dict(options, static=True, cuda_graphs=True)
    elif variant != "ropekv_default":
        raise ValueError(variant)
    return child.hf_ropekv.RopeKVCache(child.model, budget=a.budget, compress_every=a.compress_every,
                                       protect_prompt=False, dynamic_batch=a.dynamic_batch, **options)


def compiled(variant: str, cache: Any) -> bool:
    return variant == "static" or bool(getattr(cache, "is_compileable", False))


def generate(child: Child, cache: Any, prompt: torch.Tensor, new_tokens: int, variant: str,
             clock: StepClock | None = None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if child.compile_config is not None and compiled(variant, cache):
        kwargs["compile_config"] = child.compile_config
    return run_generate(child.model, cache, prompt, new_tokens, child.kwarg, clock=clock, **kwargs)


def random_prompt(child: Child, batch: int, length: int) -> torch.Tensor:
    gen = torch.Generator(device=child.device).manual_seed(child.args.seed)
    return torch.randint(0, child.model.config.vocab_size, (batch, length), device=child.device, generator=gen)


def counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters as dynamo_counters

    return {group: dict(values) for group, values in dynamo_counters.items()}


def cache_counters(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, int]:
    """torch's compile-cache counters that changed between two readings."""
    keys = [("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
            ("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_hit"),
            ("aot_autograd", "autograd_cache_miss"), ("aot_autograd", "autograd_cache_bypass"),
            ("stats", "unique_graphs"), ("inductor", "async_compile_cache_hit"),
            ("inductor", "async_compile_cache_miss")]
    return {f"{g}.{k}": after.get(g, {}).get(k, 0) - before.get(g, {}).get(k, 0) for g, k in keys}


def compile_phases() -> dict[str, float]:
    """torch's cumulative compile time by phase, in seconds (``entire_frame_compile``: dynamo's whole frame,
    ``backend_compile``: AOT autograd and inductor within it, ``inductor_compile``, ...); {} where unavailable."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:
        return {}
    return dict(calculate_time_spent())


def phase_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The phases' seconds between two ``compile_phases`` snapshots, those that grew, largest first."""
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 1e-4}
    return dict(sorted(grown.items(), key=lambda kv: -kv[1]))


def folder_bytes(path: str | None) -> int | None:
    if not path or not os.path.isdir(path):
        return None
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def step_summary(steps_ms: list[float]) -> dict[str, Any]:
    ordered = sorted(steps_ms)
    return dict(steps=len(steps_ms), p50_ms=median(steps_ms),
                p90_ms=ordered[int(0.9 * (len(ordered) - 1))] if ordered else None,
                mean_ms=sum(steps_ms) / len(steps_ms) if steps_ms else None)


def write_child(args: argparse.Namespace, result: dict[str, Any]) -> None:
    Path(args.child_out).write_text(json.dumps(result, indent=1, default=str))


def sync(child: Child) -> None:
    if child.device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- child: warm-up
def child_warmup(args: argparse.Namespace) -> None:
    """One first generate() with a static cache in this fresh process (mode cold / warm / load)."""
    spawn = float(os.environ["HF_ROPEKV_WARMUP_SPAWN"])
    started = time.time() - spawn  # interpreter start-up and imports so far
    artifacts = Path(os.environ["HF_ROPEKV_WARMUP_ARTIFACTS"])
    result: dict[str, Any] = dict(mode=args.mode, cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                                  cache_dir_bytes_before=folder_bytes(os.environ.get("TORCHINDUCTOR_CACHE_DIR")),
                                  start_to_script_s=started)
    t0 = time.perf_counter()
    child = child_setup(args, batch_backend="inductor")  # the dry run compiles with inductor here: real artifacts
    result.update(setup_s=time.perf_counter() - t0, model_build_s=child.build_s)
    if args.mode == "load":
        t0 = time.perf_counter()
        info = child.hf_ropekv.load_compile_artifacts(artifacts, strict=False, model=child.model)
        result.update(load_s=time.perf_counter() - t0, loaded=None if info is None else dataclasses.asdict(info))
    prompt = random_prompt(child, 1, args.context)
    variant = args.warmup_cache
    runs = []
    for call in range(2):  # the first call compiles; the second shows the compiled step's speed
        before, phases_before = counters(), compile_phases()
        t_call = time.time()
        cache = make_cache(child, variant, max_cache_len=args.context + args.warmup_new_tokens)
        run = generate(child, cache, prompt, args.warmup_new_tokens, variant)
        steps = run["steps_ms"]
        runs.append(dict(
            call=call,
            process_to_call_s=t_call - spawn,
            generate_s=run["total_s"],
            time_to_first_token_s=run["prefill_and_first_ms"] / 1e3,
            first_decode_step_s=steps[0] / 1e3 if steps else None,
            process_to_first_decode_step_s=(t_call - spawn) + (run["prefill_and_first_ms"] + (steps[0] if steps
                                                                                             else 0)) / 1e3,
            later_steps=step_summary(steps[1:]),
            counters=cache_counters(before, counters()),
            compile_phases_s=phase_deltas(phases_before, compile_phases()),
        ))
        if call == 0 and args.mode == "cold" and variant == "ropekv_static":
            t0 = time.perf_counter()
            info = child.hf_ropekv.save_compile_artifacts(
                artifacts, model=child.model, cache=cache,
                extra={"context": args.context, "saved_by": "benchmarks/warmup.py warmup (a) cold"})
            result.update(save_s=time.perf_counter() - t0, saved=dataclasses.asdict(info))
        del cache
    result.update(runs=runs, compile_s=runs[0]["generate_s"] - runs[1]["generate_s"],
                  cache_dir_bytes_after=folder_bytes(os.environ.get("TORCHINDUCTOR_CACHE_DIR")))
    write_child(args, result)


# ---------------------------------------------------------------------------------------------- child: profile
def timed_run(child: Child, variant: str, prompt: torch.Tensor, new_tokens: int, max_len: int,
              **options: Any) -> dict[str, Any]:
    """A generate with host timers on the cache and on generate's calls; per-step split (the first step left out).
    ``options`` go to the cache."""
    cache = make_cache(child, variant, max_cache_len=max_len, **options)
    timers = instrument.HostTimers()
    is_compiled = compiled(variant, cache) and (child.device.type == "cuda" or child.compile_config is not None)
    instrument.instrument_cache(timers, cache, eager_update=not compiled(variant, cache))
    instrument.instrument_generate(timers, child.model, compiled=is_compiled)
    clock = instrument.TimedClock(timers)
    before = counters()
    try:
        run = generate(child, cache, prompt, new_tokens, variant, clock=clock)
    finally:
        timers.restore()
    splits = [instrument.host_split(step) for step in clock.steps()[1:]]
    keys = [k for k in splits[0]] if splits else []
    compaction = [s for s in splits if s["compact_ms"] > 0]
    return dict(
        wall_s=run["total_s"], prefill_ms=run["prefill_and_first_ms"],
        **step_summary([s["wall_ms"] for s in splits]),
        median={k: median([s[k] for s in splits]) for k in keys},
        mean={k: sum(s[k] for s in splits) / len(splits) for k in keys} if splits else {},
        compaction_steps=len(compaction),
        compaction_step_wall_ms=median([s["wall_ms"] for s in compaction]),
        compaction_step_cache_ms=median([s["cache_ms"] for s in compaction]),
        counters=cache_counters(before, counters()),
        kept=getattr(cache, "tokens_kept", None),
    )


def profiled_run(child: Child, variant: str, prompt: torch.Tensor, max_len: int, **options: Any) -> dict[str, Any]:
    cache = make_cache(child, variant, max_cache_len=max_len, **options)
    steps = child.args.profile_steps
    clock = instrument.ProfilingClock(child.device, start=2, steps=steps)
    generate(child, cache, prompt, steps + 3, variant, clock=clock)
    return clock.kernel_summary()


def child_profile(args: argparse.Namespace) -> None:
    child = child_setup(args)
    result: dict[str, Any] = dict(model_build_s=child.build_s, contexts=[])
    for context in args.profile_contexts:
        torch._dynamo.reset()  # each context compiles afresh (from the on-disk caches), as a process of its own
        prompt = random_prompt(child, 1, context)
        max_len = context + args.profile_new_tokens + 8
        entry: dict[str, Any] = dict(context=context, variants={})
        result["contexts"].append(entry)
        for variant in args.profile_variants:
            row: dict[str, Any] = dict(label=LABELS[variant])
            entry["variants"][variant] = row
            try:
                t0 = time.perf_counter()
                cache = make_cache(child, variant, max_cache_len=max_len)
                generate(child, cache, prompt, 4, variant)  # compile (compiled variants), allocator, kernels
                del cache
                row["warmup_s"] = time.perf_counter() - t0
                row["timed"] = [timed_run(child, variant, prompt, args.profile_new_tokens, max_len)
                                for _ in range(args.repeats)]
                row["profiled"] = profiled_run(child, variant, prompt, max_len)
            except Exception as err:  # noqa: BLE001 - recorded; the other variants go on
                row["error"] = f"{type(err).__name__}: {str(err)[:600]}"
            write_child(args, result)
    write_child(args, result)


# ---------------------------------------------------------------------------------------------- child: overhead
#: The overhead part's variants of the compiled static cache, by the options they differ in: ``file`` scores with a
#: statistics file (``stats=``, learned by the process's first run, so not listed here; no query statistics are
#: gathered in the step: the reference), ``off`` gathers the online
#: statistics (the default), ``on`` also feeds the workload, ``frozen`` reads a frozen workload prior.
OVERHEAD_OPTIONS: dict[str, dict[str, Any]] = {"file": {}, "off": dict(learn_workload=False),
                                               "on": dict(learn_workload=True), "frozen": dict(learn_workload=True)}
#: Rounds before the freeze alternate these, rotating their order; after it, ``frozen`` takes ``on``'s place.
OVERHEAD_BEFORE, OVERHEAD_AFTER = ("file", "off", "on"), ("file", "off", "frozen")


def child_overhead(args: argparse.Namespace) -> None:
    child = child_setup(args)
    workload = child.hf_ropekv.workload_statistics(child.model)
    workload.freeze_at = 2**62  # "on" keeps learning through every run
    prompt = random_prompt(child, args.overhead_batch, args.overhead_context)
    max_len = args.overhead_context + args.overhead_new_tokens + 8
    result: dict[str, Any] = dict(model_build_s=child.build_s, runs=[], warmup_s={}, profiled={}, host={})
    stats = None  # the file variant's statistics, taken from the workload after "on" warmed up

    def options(name: str) -> dict[str, Any]:
        return dict(stats=stats) if name == "file" else dict(OVERHEAD_OPTIONS[name])

    def run(name: str, new_tokens: int, round_: int | None = None) -> None:
        cache = make_cache(child, "ropekv_static", **options(name))
        t0 = time.perf_counter()
        out = generate(child, cache, prompt, new_tokens, "ropekv_static")
        if round_ is None:
            result["warmup_s"][name] = time.perf_counter() - t0
            return
        result["runs"].append(dict(variant=name, round=round_, **step_summary(out["steps_ms"][1:]),
                                   wall_s=out["total_s"], prior_tokens=getattr(cache, "workload_prior_tokens", 0),
                                   prior_frozen=getattr(cache, "workload_prior_frozen", False),
                                   workload_tokens_after=workload.tokens, steps_ms=out["steps_ms"][1:]))
        write_child(args, result)

    def inspect(name: str) -> None:
        """GPU kernel time per step (torch.profiler) and the host split (timers) of one run each."""
        result["profiled"][name] = profiled_run(child, "ropekv_static", prompt, max_len, **options(name))
        result["host"][name] = timed_run(child, "ropekv_static", prompt, args.overhead_new_tokens, max_len,
                                         **options(name))
        write_child(args, result)

    def rounds(names: tuple[str, ...], first: int) -> None:
        # The host's speed drifts by several per cent within a run (session 13: 32-step medians from 12.2 to
        # 14.4 ms), so the variants alternate in short runs, rotating their order each round, and each is also
        # paired with the reference runs of its own round.
        for r in range(first, first + args.overhead_rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                run(name, args.overhead_new_tokens, round_=r)

    run("on", 4)  # compiles; and learns a little, for the file variant's statistics
    stats = workload.to_stats()
    for name in ("off", "file"):
        run(name, 4)
    rounds(OVERHEAD_BEFORE, 0)
    for name in OVERHEAD_BEFORE:
        inspect(name)
    workload.freeze()
    run("frozen", 4)
    rounds(OVERHEAD_AFTER, args.overhead_rounds)
    inspect("frozen")
    result["summary"] = overhead_summary(result["runs"], result["profiled"], result["host"])
    write_child(args, result)


def overhead_summary(runs: list[dict[str, Any]], profiled: dict[str, dict[str, Any]] | None = None,
                     host: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per variant: the median step over all its runs, % against ``file`` and ``off`` unpaired and paired (the
    median of the per-round ratios to the reference run of the same round), and, from one run each, GPU kernel
    time and the cache's host time per step; ``decomposed_vs_file_pct``: their excess over ``file``'s, in % of
    its step, which host drift does not reach."""
    profiled, host = profiled or {}, host or {}
    summary: dict[str, dict[str, Any]] = {}
    for name in OVERHEAD_OPTIONS:
        steps = [s for r in runs if r["variant"] == name for s in r["steps_ms"]]
        if steps:
            summary[name] = dict(p50_ms=median(steps), steps=len(steps))
    by_round = {(r["variant"], r["round"]): r["p50_ms"] for r in runs}
    for reference in ("file", "off"):
        base = summary.get(reference, {}).get("p50_ms")
        for name, row in summary.items():
            row[f"vs_{reference}_pct"] = None if not base else 100.0 * (row["p50_ms"] / base - 1.0)
            ratios = [p50 / by_round[(reference, n)] for (v, n), p50 in by_round.items()
                      if v == name and p50 is not None and by_round.get((reference, n))]
            row[f"paired_vs_{reference}_pct"] = 100.0 * (median(ratios) - 1.0) if ratios else None
            row[f"paired_vs_{reference}_rounds"] = [round(100.0 * (x - 1.0), 2) for x in ratios]
    for name, row in summary.items():
        row["kernel_ms"] = profiled.get(name, {}).get("kernel_ms_per_step")
        row["kernels_per_step"] = profiled.get(name, {}).get("kernels_per_step")
        row["cache_host_ms"] = host.get(name, {}).get("median", {}).get("cache_ms")
    ref = summary.get("file", {})
    for row in summary.values():
        parts = (row["kernel_ms"], ref.get("kernel_ms"), row["cache_host_ms"], ref.get("cache_host_ms"),
                 ref.get("p50_ms"))
        row["decomposed_vs_file_pct"] = None if None in parts or not ref["p50_ms"] else 100.0 * (
            (row["kernel_ms"] - ref["kernel_ms"]) + (row["cache_host_ms"] - ref["cache_host_ms"])) / ref["p50_ms"]
    return summary


# ---------------------------------------------------------------------------------------------- child: e2e
def child_e2e(args: argparse.Namespace) -> None:
    """``--mode warm``: a few tokens of every variant (fills the on-disk caches); else one variant, end to end."""
    child = child_setup(args)
    prompt = random_prompt(child, 1, args.context)
    if args.mode == "warm":
        done = {}
        for variant in args.e2e_variants:
            t0 = time.perf_counter()
            cache = make_cache(child, variant, max_cache_len=args.context + args.e2e_new_tokens + 8)
            generate(child, cache, prompt, 4, variant)
            done[variant] = time.perf_counter() - t0
            del cache
        write_child(args, dict(model_build_s=child.build_s, warm_s=done))
        return
    variant = args.mode
    before = counters()
    sync(child)
    t0 = time.perf_counter()
    cache = make_cache(child, variant)
    construct_s = time.perf_counter() - t0
    run = generate(child, cache, prompt, args.e2e_new_tokens, variant)
    total_s = time.perf_counter() - t0
    steps = run["steps_ms"]
    write_child(args, dict(
        variant=variant, label=LABELS[variant], model_build_s=child.build_s, construct_s=construct_s,
        total_s=total_s, new_tokens=run["new_tokens"], tokens_per_s=run["new_tokens"] / total_s,
        time_to_first_token_s=run["prefill_and_first_ms"] / 1e3, first_decode_step_s=steps[0] / 1e3 if steps else None,
        later_steps=step_summary(steps[1:]), static=getattr(cache, "static", None),
        static_reason=getattr(cache, "static_reason", "n/a: no such attribute"),
        cuda_graphs=getattr(cache, "cuda_graphs", None),
        is_compileable=bool(getattr(cache, "is_compileable", False)), counters=cache_counters(before, counters()),
    ))


CHILDREN = {"warmup": child_warmup, "profile": child_profile, "overhead": child_overhead, "e2e": child_e2e}


# ---------------------------------------------------------------------------------------------- parent
class Runner:
    """Starts the subprocesses of the parts, each with the time left, and gathers what they wrote."""

    def __init__(self, args: argparse.Namespace, argv: list[str], out_dir: Path, log: Progress) -> None:
        self.args, self.argv, self.out_dir, self.log = args, argv, out_dir, log
        root = args.cache_root or tempfile.mkdtemp(prefix="hf_ropekv_warmup_")
        self.cache_root = Path(root)
        self.warm_dir = self.cache_root / "warm"
        self.artifacts = self.cache_root / "decode_step.ropekv-compile"
        (out_dir / "parts").mkdir(exist_ok=True)
        (out_dir / "logs").mkdir(exist_ok=True)

    def seconds_left(self) -> float | None:
        if self.log.max_seconds is None:
            return None
        return self.log.max_seconds - self.log.elapsed()

    def child(self, part: str, name: str, mode: str | None, cache_dir: Path) -> dict[str, Any]:
        """Run one subprocess; its JSON, or ``{"error": ...}``."""
        out = self.out_dir / "parts" / f"{name}.json"
        left = self.seconds_left()
        timeout = None if left is None else max(5.0, left - 10.0)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton"),
                   CUDA_CACHE_PATH=str(cache_dir / "cuda"), HF_ROPEKV_WARMUP_SPAWN=repr(time.time()),
                   HF_ROPEKV_WARMUP_ARTIFACTS=str(self.artifacts))
        # hf_ropekv comes as it came to this process (installed, or PYTHONPATH): never the repository root here,
        # whose kernels/ would shadow HuggingFace's `kernels` package that transformers imports
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPT.parent), env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, str(SCRIPT), *self.argv, "--child", part, "--child-out", str(out)]
        if mode is not None:
            command += ["--mode", mode]
        limit = "none" if timeout is None else f"{timeout:.0f} s"
        self.log(f"{name}: starting (cache folder {cache_dir}, timeout {limit})")
        t0 = time.perf_counter()
        with open(self.out_dir / "logs" / f"{name}.log", "w") as log_file:
            try:
                proc = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        wall = time.perf_counter() - t0
        result = json.loads(out.read_text()) if out.is_file() else {}
        if code != 0:
            tail = (self.out_dir / "logs" / f"{name}.log").read_text()[-1500:]
            result["error"] = f"exit {code} after {wall:.0f} s; log tail:\n{tail}"
            self.log(f"{name}: FAILED ({code}); see logs/{name}.log")
        else:
            self.log(f"{name}: done in {wall:.1f} s")
        result["process_wall_s"] = wall
        return result

    def warmup(self) -> dict[str, Any]:
        fresh = self.cache_root / "fresh"
        for folder in (self.warm_dir, fresh):
            shutil.rmtree(folder, ignore_errors=True)
        self.artifacts.unlink(missing_ok=True)
        out = dict(cache=self.args.warmup_cache, cold=self.child("warmup", "warmup_a_cold", "cold", self.warm_dir))
        if "warm" in self.args.warmup_modes:
            out["warm"] = self.child("warmup", "warmup_b_warm", "warm", self.warm_dir)
        if "load" not in self.args.warmup_modes:
            return out
        if self.artifacts.is_file():
            out["artifacts_bytes"] = self.artifacts.stat().st_size
            out["load"] = self.child("warmup", "warmup_c_load", "load", fresh)
        else:
            out["load"] = dict(error="(a) saved no artifacts: nothing to load")
        return out

    def profile(self) -> dict[str, Any]:
        return self.child("profile", "profile", None, self.warm_dir)

    def overhead(self) -> dict[str, Any]:
        return self.child("overhead", "overhead", None, self.warm_dir)

    def e2e(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.args.e2e_cold:  # before anything filled the caches of this run: a fresh machine
            fresh = self.cache_root / "e2e_fresh"
            shutil.rmtree(fresh, ignore_errors=True)
            out["cold"] = self.child("e2e", "e2e_ropekv_default_cold", "ropekv_default", fresh)
        out.update(warm=self.child("e2e", "e2e_warm", "warm", self.warm_dir), rounds=[])
        rounds = self.args.e2e_rounds
        for round_ in range(rounds):
            order = self.args.e2e_variants if round_ % 2 == 0 else self.args.e2e_variants[::-1]
            suffix = f"_r{round_}" if rounds > 1 else ""
            out["rounds"].append({v: self.child("e2e", f"e2e_{v}{suffix}", v, self.warm_dir) for v in order})
        out["variants"] = out["rounds"][0]  # the first round under the keys of single-round runs
        out["round_ratios"] = [vs_dynamic(r) for r in out["rounds"]]
        out["vs_dynamic_total"] = out["round_ratios"][0]
        return out


def prepare_bytecode(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """How this run's processes get Python bytecode; with ``--bytecode-cache``, compile it first, untimed.

    pip compiles every module's bytecode at install time, and Python writes it on a first import where it may. The
    GPU machine sets ``PYTHONDONTWRITEBYTECODE=1`` and ships none, so each of its processes compiles every module it
    imports from source: several seconds for torch, dynamo and inductor, paid only by the variants that compile.
    """
    if args.bytecode_cache is None:
        written = not (sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"))
        return dict(mode="environment's", written=written, prefix=sys.pycache_prefix)
    folder = str(Path(args.bytecode_cache).resolve())
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = folder  # the subprocesses inherit both
    import importlib.util
    import sysconfig

    roots = [sysconfig.get_paths()["purelib"]]
    spec = importlib.util.find_spec("hf_ropekv")
    if spec is not None and spec.origin:
        roots.append(str(Path(spec.origin).parent))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *roots], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    seconds = time.perf_counter() - t0
    log(f"bytecode of {', '.join(roots)} compiled into {folder} in {seconds:.1f} s (not timed)")
    return dict(mode="compiled before the first process (--bytecode-cache)", written=True, prefix=folder,
                roots=roots, compile_s=seconds)


def vs_dynamic(variants: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each variant's speed-up over ``DynamicCache`` end to end (its total time over theirs), within one round."""
    dyn = variants.get("dynamic", {}).get("total_s")
    return {v: dyn / r["total_s"] for v, r in variants.items() if dyn and r.get("total_s")}


# ---------------------------------------------------------------------------------------------- report
def _f(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def render_warmup(part: dict[str, Any]) -> list[str]:
    cache = part.get("cache", "ropekv_static")  # (absent from runs before --warmup-cache)
    title = "RopeKVCache(static=True)" if cache == "ropekv_static" else "transformers' StaticCache (the baseline)"
    lines = [f"## Warm-up: the first generate() with {title}", "",
             "Each row is a fresh process. Times from the process's start (spawn) unless said; the compile is the "
             "first call's wall time minus the second's.", "",
             "| process | caches | model build s | TTFT s (first call) | first decode step s | process start → first "
             "decode step s | compile s | later step p50 ms | fxgraph hit / miss | autograd hit / miss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"cold": "(a) cold", "warm": "(b) same machine again", "load": "(c) fresh machine + artifacts"}
    caches = {"cold": "empty", "warm": "(a)'s folders", "load": "empty + load_compile_artifacts"}
    for key in [key for key in ("cold", "warm", "load") if key in part]:  # (--warmup-modes may leave some out)
        row = part[key]
        if row.get("error") or not row.get("runs"):
            lines.append(f"| {names[key]} | {caches[key]} | error: {str(row.get('error', 'no result'))[:200]} |"
                         + " |" * 7)
            continue
        first = row["runs"][0]
        c = first["counters"]
        lines.append(
            f"| {names[key]} | {caches[key]} | {_f(row['model_build_s'], '.1f')} | "
            f"{_f(first['time_to_first_token_s'])} | {_f(first['first_decode_step_s'])} | "
            f"{_f(first['process_to_first_decode_step_s'], '.1f')} | {_f(row.get('compile_s'), '.1f')} | "
            f"{_f(row['runs'][1]['later_steps']['p50_ms'])} | {c['inductor.fxgraph_cache_hit']} / "
            f"{c['inductor.fxgraph_cache_miss']} | {c['aot_autograd.autograd_cache_hit']} / "
            f"{c['aot_autograd.autograd_cache_miss']} |")
    cold = part.get("cold", {})
    if cold.get("saved"):
        saved = cold["saved"]
        kinds = ", ".join(f"{k}: {v}" for k, v in saved["artifacts"].items())
        lines += ["", f"Artifacts saved by (a): {saved['artifact_bytes'] / 2**20:.1f} MiB "
                      f"({kinds}) in {_f(cold.get('save_s'))} s; "
                      f"loaded by (c) in {_f(part.get('load', {}).get('load_s'))} s. Inductor cache folder after (a): "
                      f"{_f((cold.get('cache_dir_bytes_after') or 0) / 2**20, '.1f')} MiB."]
    lines += ["", "torch's compile time by phase in the first call (`torch._dynamo.utils.calculate_time_spent`; "
                  "phases nest: `entire_frame_compile` holds the others), seconds:", ""]
    for key in names:
        row = part.get(key)
        if row and not row.get("error") and row.get("runs"):
            phases = row["runs"][0].get("compile_phases_s") or {}
            listed = ", ".join(f"{name} {seconds:.2f}" for name, seconds in list(phases.items())[:8])
            lines.append(f"- {names[key]}: {listed or 'n/a'}")
    return lines + [""]


def render_profile(part: dict[str, Any]) -> list[str]:
    lines = ["## Profile: decode steps inside generate(), batch 1", ""]
    if part.get("error") and not part.get("contexts"):
        return lines + [f"Error: {part['error'][:500]}", ""]
    profiled = [row.get("profiled", {}).get("profiled_steps") for entry in part.get("contexts", [])
                for row in entry["variants"].values()]
    lines += ["Median over the timed runs' steps (first decode step left out); host split from timers "
              "(`benchmarks/instrument.py`); kernel and GPU-busy time from torch.profiler over "
              f"{max((n for n in profiled if n), default='n/a')} "
              "steps of another run. Each host column is its own median over the last timed run's steps, so they "
              "need not add up to the step; their means (in `results.json`) do.", "",
              "| context | variant | step p50 ms | GPU kernels ms/step | GPU busy ms/step | cache host ms (share) | "
              "transformers prepare ms | forward call host ms | generate loop rest ms | compaction steps: wall / "
              "cache ms | vs DynamicCache |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in part.get("contexts", []):
        dyn_p50 = None
        for variant, row in entry["variants"].items():
            if row.get("error") or not row.get("timed"):
                lines.append(f"| {entry['context']} | {row['label']} | error: {str(row.get('error'))[:200]} |"
                             + " |" * 8)
                continue
            steps = [t["p50_ms"] for t in row["timed"] if t["p50_ms"] is not None]
            p50 = median(steps)
            if variant == "dynamic":
                dyn_p50 = p50
            m = row["timed"][-1]["median"]
            prof = row.get("profiled", {})
            last = row["timed"][-1]
            lines.append(
                f"| {entry['context']} | {row['label']} | {_f(p50)} | {_f(prof.get('kernel_ms_per_step'))} | "
                f"{_f(prof.get('gpu_busy_ms_per_step'))} | {_f(m.get('cache_ms'), '.3f')} "
                f"({_f(100 * m['cache_share'] if m.get('cache_share') is not None else None, '.1f')} %) | "
                f"{_f(m.get('transformers_prepare_ms'), '.3f')} | {_f(m.get('forward_call_ms'), '.3f')} | "
                f"{_f(m.get('generate_loop_ms'), '.3f')} | {last['compaction_steps']}: "
                f"{_f(last['compaction_step_wall_ms'])} / {_f(last['compaction_step_cache_ms'])} | "
                f"{'n/a' if not dyn_p50 or not p50 else f'{dyn_p50 / p50:.2f}×'} |")
    kinds = [(entry["context"], row["label"], row.get("profiled", {}).get("kernel_kinds"))
             for entry in part.get("contexts", []) for row in entry["variants"].values()]
    for context, label, table in kinds:
        if table:
            lines += ["", f"GPU time per decode step by kernel kind: {label}, context {context}", "",
                      "| kernel kind | ms/step | kernels/step |", "|---|---|---|"]
            lines += [f"| {row['kind']} | {row['ms_per_step']:.3f} | {row['per_step']:.1f} |" for row in table[:12]]
    return lines + [""]


def render_overhead(part: dict[str, Any]) -> list[str]:
    lines = ["## What query statistics cost the compiled decoding step", ""]
    summary = part.get("summary")
    if not summary:
        return lines + [f"Error: {str(part.get('error'))[:500]}", ""]
    lines += ["| variant | step p50 ms | steps | vs file (unpaired) | vs file, paired (per round) | vs off, paired | "
              "GPU kernels ms / step | cache host ms / step | kernels + host over file |",
              "|---|---|---|---|---|---|---|---|---|"]
    names = {"file": "statistics file (`stats=`)", "off": "online, `learn_workload=False` (default)",
             "on": "online + learning", "frozen": "online + frozen workload prior"}

    def pct(value: Any) -> str:
        return "n/a" if value is None else f"{value:+.2f} %"

    for key, row in summary.items():
        rounds = ", ".join(f"{x:+.1f}" for x in row["paired_vs_file_rounds"])
        lines.append(f"| {names[key]} | {_f(row['p50_ms'])} | {row['steps']} | {pct(row['vs_file_pct'])} | "
                     f"{pct(row['paired_vs_file_pct'])} ({rounds}) | {pct(row['paired_vs_off_pct'])} | "
                     f"{_f(row['kernel_ms'], '.3f')} ({_f(row['kernels_per_step'], '.0f')}) | "
                     f"{_f(row['cache_host_ms'], '.3f')} | {pct(row['decomposed_vs_file_pct'])} |")
    return lines + [""]


def render_e2e(part: dict[str, Any]) -> list[str]:
    rounds = part.get("rounds") or [part.get("variants", {})]  # runs before --e2e-rounds kept one round
    ratios = part.get("round_ratios") or [part.get("vs_dynamic_total", {})]
    lines = ["## End to end: one generate() of the e2e tokens at batch 1, after another process warmed the caches",
             "", "| round | cache | static (reason) | total s | tokens/s | TTFT s | first decode step s | "
                 "later step p50 ms | fxgraph hit / miss | DynamicCache total / this (same round) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    labelled = [(round_, variants, ratio) for round_, (variants, ratio) in enumerate(zip(rounds, ratios))]
    if part.get("cold"):  # --e2e-cold: the default in a process of its own, before the rounds, no ratio
        labelled.insert(0, ("cold (empty caches)", {"ropekv_default": part["cold"]}, {}))
    for round_, variants, ratio in labelled:
        for variant, row in variants.items():
            if row.get("error") or row.get("total_s") is None:
                lines.append(f"| {round_} | {LABELS[variant]} | error: {str(row.get('error'))[:200]} |" + " |" * 7)
                continue
            c = row["counters"]
            graphs = ", CUDA graphs" if row.get("cuda_graphs") else ""
            lines.append(
                f"| {round_} | {row['label']} | {row['static']}{graphs} ({row['static_reason']}) | "
                f"{_f(row['total_s'], '.1f')} | {_f(row['tokens_per_s'], '.1f')} | "
                f"{_f(row['time_to_first_token_s'])} | {_f(row['first_decode_step_s'])} | "
                f"{_f(row['later_steps']['p50_ms'])} | "
                f"{c['inductor.fxgraph_cache_hit']} / {c['inductor.fxgraph_cache_miss']} | "
                f"{_f(ratio.get(variant)) + '×' if ratio else 'n/a'} |")
    if len(rounds) > 1:
        for variant in rounds[0]:
            values = [r[variant] for r in ratios if variant in r]
            if values and variant != "dynamic":
                lines += ["", f"{LABELS[variant]} against DynamicCache, round by round: "
                          + ", ".join(f"{v:.2f}×" for v in values) + f" (median {median(values):.2f}×)"]
    return lines + [""]


RENDER = {"warmup": render_warmup, "profile": render_profile, "overhead": render_overhead, "e2e": render_e2e}


def bytecode_line(bytecode: dict[str, Any] | None) -> str:
    if bytecode is None:
        return "not recorded (runs before 2026-12-04's --bytecode-cache: none written on the GPU machine)"
    if bytecode.get("compile_s") is not None:
        return (f"compiled into `{bytecode['prefix']}` before the first process ({bytecode['compile_s']:.0f} s, "
                "untimed), as pip install leaves it")
    if not bytecode["written"]:
        return "none cached (PYTHONDONTWRITEBYTECODE): each process compiles every module it imports, in the timings"
    return "the environment's (written on first import)"


def render(result: dict[str, Any]) -> str:
    s = result["settings"]
    meta = result["meta"]
    command = " ".join(["python", "benchmarks/warmup.py", *meta["argv"]])
    lines = ["# Warm-up, per-step costs and workload-statistics overhead of the compiled decode step", "",
             run_header(meta, f"{s['shape']} {s['dtype']}, random weights, sdpa (cuDNN off)"), "",
             f"- date: {meta['date']}; device: {meta['device']}; commit `{meta['commit']}`",
             f"- command: `{command}`",
             f"- torch {meta['torch']}, transformers {meta['transformers']}, triton {meta['triton']}",
             f"- budget {s['budget']}, compress_every {s['compress_every']}, protect_prompt=False; "
             f"context {s['context']}; dynamic_batch={s.get('dynamic_batch', True)!r} (True: one compiled step for "
             "every batch size; False: specialised to the batch size; 'auto', the default since 2026-12-04: "
             "specialised while the model has compiled only batch 1; runs before that default say True)",
             f"- Python bytecode: {bytecode_line(s.get('python_bytecode'))}", ""]
    for part in s["parts"]:
        if part in result["parts"]:
            lines += RENDER[part](result["parts"][part])
    for skipped in result["skipped"]:
        lines.append(f"Not run: {skipped}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        CHILDREN[args.child](args)
        return 0
    device = run_device(args)
    out_dir = results_dir("warmup", args.out, device)
    log = Progress(args.max_minutes)
    apply_run_args(args)
    meta = run_metadata(device, args.commit, argv)
    settings = dict(parts=args.parts, shape=args.shape, budget=args.budget, compress_every=args.compress_every,
                    context=args.context, dtype="bfloat16" if device.type == "cuda" else "float32",
                    profile_contexts=args.profile_contexts, profile_new_tokens=args.profile_new_tokens,
                    profile_steps=args.profile_steps, overhead_batch=args.overhead_batch,
                    overhead_context=args.overhead_context, overhead_new_tokens=args.overhead_new_tokens,
                    overhead_rounds=args.overhead_rounds,
                    repeats=args.repeats, e2e_new_tokens=args.e2e_new_tokens, warmup_new_tokens=args.warmup_new_tokens,
                    dynamic_batch=args.dynamic_batch, warmup_modes=args.warmup_modes,
                    warmup_cache=args.warmup_cache)
    result: dict[str, Any] = dict(meta=meta, settings=settings, parts={}, skipped=[], part_wall_s={})
    settings["python_bytecode"] = prepare_bytecode(args, log)
    runner = Runner(args, argv, out_dir, log)
    settings["cache_root"] = str(runner.cache_root)
    estimates = dict(DRY_ESTIMATE_MIN if args.dry_run else ESTIMATE_MIN)
    estimates["warmup"] = round(estimates["warmup"] * sum(WARMUP_MODE_SHARE[m] for m in args.warmup_modes), 2)
    variant_share = (1 - E2E_WARM_SHARE) / len(E2E_VARIANTS)
    timed = len(args.e2e_variants) * args.e2e_rounds
    estimates["e2e"] = round(estimates["e2e"] * (E2E_WARM_SHARE + variant_share * timed), 2)
    try:
        for part in args.parts:
            left = runner.seconds_left()
            if left is not None and left < 60 * estimates[part]:
                result["skipped"].append(f"{part} (needs about {estimates[part]} min, {left / 60:.1f} min left)")
                log(f"skipping {part}: about {estimates[part]} min needed, {left / 60:.1f} left")
                continue
            t0 = time.perf_counter()
            result["parts"][part] = getattr(runner, part)()
            result["part_wall_s"][part] = time.perf_counter() - t0
            write_results(out_dir, "results", result)  # after every part: a killed run keeps what it had
            (out_dir / "results.md").write_text(render(result))
    finally:
        if not args.keep_caches and args.cache_root is None:
            shutil.rmtree(runner.cache_root, ignore_errors=True)
    write_results(out_dir, "results", result, render(result))
    write_run_readme(out_dir, meta, "warmup.py", "Warm-up and per-step costs of the compiled decode step",
                     "See `results.md`; every number in `results.json`, each subprocess in `parts/` and `logs/`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
