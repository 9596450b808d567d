#!/usr/bin/env python
"""Where a compiled static-cache decode step's time goes, inside ``model.generate``.

For each point (batch x prompt tokens) and attention implementation (``--attention``), it runs greedy
``generate()`` with ``RopeKVCache(model, budget, static=True)``, compiled by generate itself on CUDA:

1. a warm-up call (compiles), then ``--repeats`` timed calls alternated between the attention implementations:
   median plain step and each compaction step (the gaps between successive logits, ``common.StepClock``), the
   eager preparation of each step (``StaticForwardDriver.prepare``, host time) and each compaction (``Compactor.compact``,
   host time with the device synchronised before and after), and the CUDA graphs recorded;
2. one profiled call (``torch.profiler``, CPU and CUDA) over a window of ``--window`` steps from ``--skip`` that
   holds a compaction step: GPU kernel time per step, the top kernels and host operators (``tables_b*.txt``).

The implementations: ``grouped`` is the library's default for a static cache on an sdpa grouped-query model
(``hf_ropekv.model.attention.grouped_sdpa``: no copy of the key/value heads under the mask); ``sdpa`` puts the model's
implementation back to transformers' sdpa after the cache switched it (``repeat_kv`` copies under a mask).

    python benchmarks/profile_static.py --out OUT --commit SHA                      # qwen3-8b bf16 on CUDA
    python benchmarks/profile_static.py --dry-run --out /tmp/ps_dry                 # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from common import (  # first: sets the hub defaults before transformers is imported
    Progress,
    gpu_kernels,
    StepClock,
    import_hf_ropekv,
    median,
    run_generate,
    run_metadata,
    write_results,
)

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

import models
from compiled_decode import cudagraph_recordings

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402
from hf_ropekv.model.attention import GROUPED_SDPA  # noqa: E402


class Instrumented:
    """Host timings of a static cache's eager work per step: preparation and compaction (``record_function``
    labels them in a profile)."""

    def __init__(self, cache: RopeKVCache, clock: StepClock, sync: bool) -> None:
        self.prepare_ms: list[float] = []
        self.compactions: list[dict[str, float]] = []
        driver, compactor = cache._static_driver, cache.coordinator.compactor
        prepare, compact = driver.prepare, compactor.compact

        def timed_prepare(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            with record_function("ropekv.prepare_static_forward"):
                out = prepare(*args, **kwargs)
            self.prepare_ms.append(1e3 * (time.perf_counter() - t0))
            return out

        def timed_compact(*args: Any, **kwargs: Any) -> Any:
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with record_function("ropekv.compact"):
                out = compact(*args, **kwargs)
            if sync:
                torch.cuda.synchronize()
            self.compactions.append(dict(step=len(clock.stamps), ms=1e3 * (time.perf_counter() - t0)))
            return out

        driver.prepare = timed_prepare  # type: ignore[method-assign]
        compactor.compact = timed_compact  # type: ignore[method-assign]


def new_cache(model: torch.nn.Module, args: argparse.Namespace, attention: str) -> RopeKVCache:
    cache = RopeKVCache(model, budget=args.budget, compress_every=args.compress_every, protect_prompt=False,
                        static=True)
    # The cache switched the model to the grouped sdpa; "sdpa" puts transformers' own back for this run.
    model.config._attn_implementation = "sdpa" if attention == "sdpa" else GROUPED_SDPA
    return cache


def timed_run(model, args, attention: str, prompt: torch.Tensor, kwarg: str, device) -> dict[str, Any]:
    clock = StepClock()
    cache = new_cache(model, args, attention)
    inst = Instrumented(cache, clock, sync=device.type == "cuda")
    before = cudagraph_recordings(device)
    run = run_generate(model, cache, prompt, args.new_tokens, kwarg, clock=clock)
    after = cudagraph_recordings(device)
    steps = run["steps_ms"][1:]  # the first decode step compiles (warm-up) or re-records; left out
    per_step: dict[int, float] = {}
    for c in inst.compactions:  # per-layer selection compacts layer by layer: one entry per layer
        per_step[c["step"]] = per_step.get(c["step"], 0.0) + c["ms"]
    compact_steps = set(per_step)
    # stamps[i] is the logits of step i (0: prefill); a compaction inside forward i+1 lengthens gap i.
    plain = [ms for i, ms in enumerate(run["steps_ms"]) if i >= 1 and (i + 1) not in compact_steps]
    compacting = [ms for i, ms in enumerate(run["steps_ms"]) if (i + 1) in compact_steps]
    return dict(
        attention=attention,
        wall_s=run["total_s"],
        first_step_ms=run["steps_ms"][0] if run["steps_ms"] else None,
        plain_p50_ms=median(plain),
        all_p50_ms=median(steps),
        mean_ms=sum(steps) / len(steps) if steps else None,
        compaction_steps_ms=compacting,
        compaction_host_ms=list(per_step.values()),
        prepare_p50_ms=median(inst.prepare_ms),
        cudagraphs_recorded=None if before is None or after is None else after - before,
        steps=len(steps),
        amortised_compaction_pct=(
            100 * (sum(compacting) - len(compacting) * (median(plain) or 0)) / sum(steps) if steps and plain else None
        ),
    )


def profiled_run(model, args, attention: str, prompt: torch.Tensor, kwarg: str, device, out: Path, tag: str) -> dict:
    clock = StepClock()
    cache = new_cache(model, args, attention)
    Instrumented(cache, clock, sync=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sched = schedule(wait=args.skip, warmup=2, active=args.window, repeat=1)
    with profile(activities=activities, schedule=sched) as prof:

        def stepper(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            prof.step()
            return scores

        from transformers import LogitsProcessorList

        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False,
                       logits_processor=LogitsProcessorList([clock, stepper]), **{kwarg: cache})
    averages = prof.key_averages()
    gpu_attr = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    kernels = sorted(averages, key=lambda a: getattr(a, gpu_attr, 0), reverse=True)
    gpu_ms = sum(e.device_time for e in gpu_kernels(prof.events())) / 1e3  # kernels only, no annotation ranges
    host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)
    tables = out / f"tables_{tag.split('_')[0]}.txt"  # one file per point (the device returns few files)
    with open(tables, "a") as f:
        f.write(f"# {tag}: by GPU time\n")
        f.write(averages.table(sort_by=gpu_attr, row_limit=40, max_name_column_width=90) + "\n")
        f.write(f"# {tag}: by host self time\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90) + "\n")
    window_stamps = clock.stamps[args.skip + 2: args.skip + 2 + args.window + 1]
    return dict(
        attention=attention,
        window_steps=args.window,
        window_wall_ms=1e3 * (window_stamps[-1] - window_stamps[0]) if len(window_stamps) > 1 else None,
        gpu_kernel_ms_per_step=gpu_ms / args.window,
        top_kernels=[dict(name=a.key, calls=a.count, gpu_ms=getattr(a, gpu_attr, 0) / 1e3) for a in kernels[:15]],
        top_host=[dict(name=a.key, calls=a.count, self_cpu_ms=a.self_cpu_time_total / 1e3) for a in host[:15]],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--points", default="1x4096,16x4096", help="batch x prompt tokens, comma-separated")
    p.add_argument("--attention", default="grouped,sdpa")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--skip", type=int, default=110, help="decode steps before the profiled window")
    p.add_argument("--window", type=int, default=24, help="profiled decode steps (hold one compaction)")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.points, args.new_tokens = "tiny", "2x64", 40
        args.budget, args.compress_every, args.skip, args.window = 32, 8, 4, 12
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    torch.backends.cuda.enable_cudnn_sdp(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Progress(None)
    result: dict[str, Any] = dict(meta=run_metadata(device, args.commit, sys.argv[1:] if argv is None else argv),
                                  settings=vars(args), points=[])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = models.build_random_model(models.make_config(args.shape), dtype=dtype, device=device)
    kwarg = cache_kwarg(model)
    attentions = args.attention.split(",")
    for point in args.points.split(","):
        batch, prompt_len = (int(x) for x in point.split("x"))
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
        row: dict[str, Any] = dict(batch=batch, prompt=prompt_len, warmup=[], runs=[], profiles=[])
        result["points"].append(row)
        for attention in attentions:
            row["warmup"].append(timed_run(model, args, attention, prompt, kwarg, device))
            log(f"b{batch} P{prompt_len} {attention} warm-up: {row['warmup'][-1]}")
            write_results(out, "profile_static", result)
        for _ in range(args.repeats):
            for attention in attentions:
                row["runs"].append(timed_run(model, args, attention, prompt, kwarg, device))
                log(f"b{batch} P{prompt_len} {attention}: {row['runs'][-1]}")
                write_results(out, "profile_static", result)
        if not args.no_profile:
            for attention in attentions:
                prof = profiled_run(model, args, attention, prompt, kwarg, device, out, f"b{batch}_{attention}")
                row["profiles"].append(prof)
                log(f"b{batch} P{prompt_len} {attention} profile: {prof}")
                write_results(out, "profile_static", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
