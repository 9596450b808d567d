#!/usr/bin/env python
"""Where an eager decode step's time goes: a profiler trace of single steps of the suite's decode points.

The suite's decode steps on the H200 took 50-140 ms with the host busy the whole time (host time within a few ms of
the CUDA-event time), and the same configurations ran about 2x faster in an earlier run. This script asks why:

1. the machine's own launch cost, without any model: host microseconds per launch of a tiny kernel, and per
   iteration of a pure-Python loop, measured before and after the decode points (does the host drift?);
2. for each decode point (cache kind, batch, context; filled as ``suite_harness.decode_point`` fills them), the median
   step time, host time and, from one ``torch.profiler`` step: the kernels launched, the sum of GPU kernel time
   (how busy the GPU was), and the host operators that took the most self time;
3. the points run in a fixed order, and the first one is run again at the end: a point that is slow only the first
   time is a warm-up effect, not a property of the cache.

    python benchmarks/profile_decode.py --out prof_out --commit SHA                # qwen3-8b, bf16, on CUDA
    python benchmarks/profile_decode.py --dry-run --out /tmp/prof_dry             # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from common import (  # first: sets the hub defaults before transformers is imported
    Memory,
    gpu_kernels,
    Progress,
    add_run_args,
    apply_run_args,
    median,
    run_device,
    run_header,
    run_metadata,
    write_results,
)

import torch
from torch.profiler import ProfilerActivity, profile

import models
import suite_harness

DYNAMIC, ROPE, GATHER = suite_harness.DYNAMIC, suite_harness.ROPE, suite_harness.GATHER
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
            "aten::item", "aten::nonzero")


def launch_cost(device: torch.device, n: int = 2000) -> dict[str, float]:
    """Host microseconds per launch of a one-element add, and per iteration of a plain Python loop."""
    x = torch.ones(1, device=device)
    for _ in range(50):
        x.add_(1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    acc = 0
    for i in range(200_000):
        acc += i & 7
    py = time.perf_counter() - t0
    return dict(us_per_launch=1e6 * host / n, ns_per_python_iter=1e9 * py / 200_000)


def fill(bench: suite_harness.Bench, kind: str, budget: int | None, batch: int, context: int):
    """A cache at ``context`` tokens in the state ``suite_harness.decode_point`` times it (compacted once, warmed up)."""
    cache = bench.new_cache(kind, budget)
    return cache, bench.warm_up(cache, kind, budget, batch, context)


def profiled_step(bench: suite_harness.Bench, cache, nxt: torch.Tensor, top: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """One decode step under the profiler: kernel count, summed GPU kernel time, and the top host operators."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])
    bench.timer.sync()
    with profile(activities=activities) as prof:
        nxt = bench.step(cache, nxt)
        bench.timer.sync()
    events = prof.events()
    kernels = gpu_kernels(events)
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")]
    gpu_us = sum(e.device_time for e in kernels) if kernels else None
    averages = prof.key_averages()
    syncs = [a for a in averages if a.key in SYNC_OPS]
    host_ops = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return nxt, dict(
        kernels=len(kernels),
        launch_calls=len(launches),
        launch_us_total=sum(e.cpu_time_total for e in launches),
        gpu_kernel_ms=None if gpu_us is None else gpu_us / 1e3,
        # A step whose host time equals its wall time is either launch-bound or waiting in a synchronisation.
        syncs={a.key: a.count for a in syncs},
        aten_self_cpu_ms=sum(a.self_cpu_time_total for a in averages if a.key.startswith("aten::")) / 1e3,
        profiled_cpu_ms=sum(a.self_cpu_time_total for a in averages) / 1e3,
        # sdpa's backend op (flash, efficient, cuDNN): cuDNN builds an execution plan on the host for every new
        # sequence length, so this column says whether the step met its K/V length before.
        attention_ops={a.key: round(a.self_cpu_time_total / 1e3, 2) for a in averages if "attention" in a.key},
        host_ops=[
            dict(name=a.key, calls=a.count, self_cpu_ms=a.self_cpu_time_total / 1e3) for a in host_ops
        ],
    )


def run_point(bench: suite_harness.Bench, kind: str, budget: int | None, batch: int, context: int, top: int) -> dict:
    s = bench.s
    cache, nxt = fill(bench, kind, budget, batch, context)
    try:
        wall, host = [], []
        for _ in range(s.timed_steps):
            before = bench.compactions(cache)
            nxt, ms = bench.timed_step(cache, nxt)
            if bench.compactions(cache) != before:
                break  # keep only plain steps
            wall.append(ms)
            host.append(bench.timer.last_host_ms)
        nxt, prof = profiled_step(bench, cache, nxt, top)
        return dict(
            cache=bench.label(kind, budget),
            batch=batch,
            context=context,
            kept=bench.kept(cache),
            step_ms=median(wall),
            host_ms=median(host),
            steps_ms=wall,
            **prof,
        )
    finally:
        cache = nxt = None
        bench.mem.clean()


def run_pair(bench: suite_harness.Bench, batch: int, context: int, steps: int) -> dict:
    """DynamicCache and RopeKVCache filled side by side, then timed in alternating steps.

    The host speed of the GPU machine drifts (the same step took 35 ms in one process and 55 ms in another), and an
    eager step is host-bound, so two caches timed a minute apart can differ by the drift alone. Alternating steps
    see the same host; the ratio of each adjacent pair is the speed-up, and its median is reported.
    """
    budget = bench.s.budget
    dyn, dyn_next = fill(bench, DYNAMIC, None, batch, context)
    rope, rope_next = fill(bench, ROPE, budget, batch, context)
    try:
        dyn_ms, rope_ms = [], []
        for _ in range(steps):
            dyn_next, ms = bench.timed_step(dyn, dyn_next)
            dyn_ms.append(ms)
            before = bench.compactions(rope)
            rope_next, ms = bench.timed_step(rope, rope_next)
            if bench.compactions(rope) != before:
                raise RuntimeError("a paired step compacted: lower --paired-steps below compress_every")
            rope_ms.append(ms)
        return dict(
            batch=batch,
            context=context,
            kept=bench.kept(rope),
            dynamic_ms=median(dyn_ms),
            ropekv_ms=median(rope_ms),
            paired_ratio=median([d / r for d, r in zip(dyn_ms, rope_ms)]),
            dynamic_steps_ms=dyn_ms,
            ropekv_steps_ms=rope_ms,
        )
    finally:
        dyn = rope = dyn_next = rope_next = None
        bench.mem.clean()


def render(result: dict) -> str:
    lines = [
        "# Where a decode step's time goes",
        "",
        run_header(
            result["meta"],
            f"{result['shape']} {result['dtype']}, random weights, sdpa "
            f"(backends enabled: {', '.join(result['meta']['sdpa_backends'])})",
        ),
        "",
        "Host cost of the machine itself (no model): "
        + "; ".join(
            f"{c['when']}: {c['us_per_launch']:.1f} µs per tiny-kernel launch, {c['ns_per_python_iter']:.0f} ns per "
            "Python loop iteration"
            for c in result["launch_cost"]
        ),
        "",
        "| # | cache | batch | context | kept | step ms (median) | host ms | kernels | GPU kernel ms | GPU busy "
        "| aten self-CPU ms | attention op: host self ms | syncs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["points"]):
        busy = f"{100 * r['gpu_kernel_ms'] / r['step_ms']:.0f} %" if r["gpu_kernel_ms"] and r["step_ms"] else "n/a"
        gpu = f"{r['gpu_kernel_ms']:.2f}" if r["gpu_kernel_ms"] is not None else "n/a"
        lines.append(
            f"| {i + 1} | {r['cache']} | {r['batch']} | {r['context']} | {r['kept']} | {r['step_ms']:.2f} | "
            f"{r['host_ms']:.2f} | {r['kernels']} | {gpu} | {busy} | {r['aten_self_cpu_ms']:.1f} | "
            + (", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in r["attention_ops"].items()) or "n/a")
            + " | "
            + (", ".join(f"{k} {v}" for k, v in r["syncs"].items()) or "none")
            + " |"
        )
    if result["pairs"]:
        lines += [
            "",
            f"Alternating plain decode steps, DynamicCache then RopeKVCache(budget={result['budget']}) "
            "(compaction steps not included; the suite amortises them):",
            "",
            "| batch | context | RopeKVCache kept | DynamicCache ms | RopeKVCache ms | speed-up (median of pairs) |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["pairs"]:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['kept']} | {r['dynamic_ms']:.2f} | {r['ropekv_ms']:.2f} | "
                f"{r['paired_ratio']:.2f}x |"
            )
    lines += ["", "Top host operators by self time, per point (one profiled step; profiler overhead included):", ""]
    for i, r in enumerate(result["points"]):
        ops = ", ".join(f"{o['name']} {o['self_cpu_ms']:.1f} ms/{o['calls']}" for o in r["host_ops"][:6])
        lines.append(f"- {i + 1}. {r['cache']} b{r['batch']} T{r['context']}: {ops}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default=None, help="default: the suite's (2176, 8192, 32768)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--paired-steps", type=int, default=24, help="alternating steps per pair (0: no pairs)")
    p.add_argument("--no-profile", action="store_true", help="only the alternating pairs")
    args = p.parse_args(argv)
    apply_run_args(args)

    s = suite_harness.Settings.dry() if args.dry_run else suite_harness.Settings()
    if args.contexts:
        s.contexts = suite_harness.parse_ints(args.contexts)
    batches = suite_harness.parse_ints(args.batches) if not args.dry_run else s.batches
    device = run_device(args)
    log, mem = Progress(None), Memory(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    result: dict[str, Any] = dict(
        meta=run_metadata(device, args.commit, sys.argv[1:] if argv is None else argv),
        shape=s.shape, dtype=s.dtype, budget=s.budget, launch_cost=[], points=[], pairs=[],
    )
    result["launch_cost"].append(dict(when="before the model", **launch_cost(device)))
    log(f"launch cost before: {result['launch_cost'][-1]}")
    with torch.no_grad():
        model = models.build_random_model(models.make_config(s.shape), dtype=getattr(torch, s.dtype), device=device)
        bench = suite_harness.Bench(model, s, device, log, mem)
        plan = [(kind, s.budget if kind == ROPE else None, b, c) for b in batches for c in s.contexts
                for kind in (DYNAMIC, ROPE)]
        plan.append(plan[0])  # the first point again: warm-up or a property of the point?
        if args.no_profile:
            plan = []
        for kind, budget, batch, context in plan:
            row = run_point(bench, kind, budget, batch, context, args.top)
            result["points"].append(row)
            log(f"{row['cache']:26} b{batch:<3} T{context:<6}: step {row['step_ms']:.2f} ms, host {row['host_ms']:.2f}"
                f" ms, {row['kernels']} kernels, GPU {row['gpu_kernel_ms']} ms")
            write_results(out, "profile", result)
        for batch in batches if args.paired_steps else ():
            for context in s.contexts:
                row = run_pair(bench, batch, context, min(args.paired_steps, s.compress_every - 8))
                result["pairs"].append(row)
                log(f"pair b{batch:<3} T{context:<6}: DynamicCache {row['dynamic_ms']:.2f} ms, RopeKVCache "
                    f"{row['ropekv_ms']:.2f} ms, speed-up {row['paired_ratio']:.2f}x")
                write_results(out, "profile", result)
    result["launch_cost"].append(dict(when="after the points", **launch_cost(device)))
    write_results(out, "profile", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
