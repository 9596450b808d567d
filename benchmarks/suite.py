#!/usr/bin/env python
"""The memory + speed suite (GitHub issue 4): memory, decode speed, capacity, the 24 GB scenario, overhead, fp16.

This file is the command line; each part lives in its own module (``suite_memory``, ``suite_throughput``,
``suite_scenario_24gb``, ``suite_overhead``, ``suite_fp16``), on the settings and ``Bench`` of ``suite_harness``.

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
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from common import Memory, Progress, add_run_args, apply_run_args, run_metadata  # first: sets the hub defaults
from suite_harness import Bench, Settings, hf_ropekv, mib_text, parse_ints  # imports hf_ropekv from the checkout

import baselines
import models
import report
from suite_fp16 import part_e
from suite_memory import part_a
from suite_overhead import part_d
from suite_scenario_24gb import part_c
from suite_throughput import part_b

PARTS = ("a", "b", "c", "d", "e")


# ============================================================================================== command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e")
    add_run_args(p, out_default="bench_out")  # --out (results.json, results.md, *.png), --commit, --dry-run, ...
    p.add_argument("--max-minutes", type=float, default=None, help="skip what is left after this many minutes")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--scorer", choices=("frequency", "recency", "online"), default="frequency",
                   help="RopeKVCache policy: frequency (default scorer, random statistics), recency, or online "
                   "(default scorer, statistics gathered from the prompt)")
    p.add_argument("--budgets", type=parse_ints, default=None, help="part a budgets (default 1024,2048,4096)")
    p.add_argument("--mem-points", type=parse_ints, default=None, help="part a token counts")
    p.add_argument("--contexts", type=parse_ints, default=None, help="part b contexts (default 2176,8192,32768)")
    p.add_argument("--batches", type=parse_ints, default=None, help="part b batches (default 1,16)")
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
                log(f"built in {time.perf_counter() - t0:.0f}s: weights {mib_text(common_info['weights_bytes'])}, "
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
