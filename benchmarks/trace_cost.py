#!/usr/bin/env python
"""What tracing the compiled decode step costs, cache by cache: the part of the compile warm-up no disk cache keeps.

dynamo traces the decode step in every process (its FX graph and inductor's output are cached on disk; the
trace is not), so every Python op a cache adds to the step is paid at each warm start. This measures, on the CPU,
the first ``generate()`` with generate's own compilation (dynamo's ``eager`` backend by default: the trace alone,
and the FX nodes of each traced graph, a count that does not drift with the host;
``--backend aot_eager`` adds AOT autograd's) against a second one with a fresh cache of the same shapes (compiled
already), for a tiny-width model of many layers (the trace's cost grows with the layers, not their width):

- ``StaticCache``: transformers' own compiled cache, the reference;
- ``ropekv``: ``RopeKVCache(static=True)``, the defaults (online query statistics gathered in the step;
  ``dynamic_batch="auto"``: at batch 1 the batch dimension stays static, at a larger ``--batch`` it is dynamic);
- ``ropekv_dynamic_batch``: the same with ``dynamic_batch=True`` (the batch dimension dynamic at any batch: one
  compiled step for every batch size; the default until ``18e15bc``): what the symbolic batch size costs the trace;
- ``ropekv_static_batch``: the same with ``dynamic_batch=False`` (the batch dimension static at any batch);
- ``ropekv_recency``: the defaults with ``RecencyScorer`` (no query statistics, no query capture in the step);
- ``ropekv_plain_sdpa``: the defaults with transformers' sdpa instead of ``hf_ropekv_sdpa``.

Each variant runs in a fresh process per repeat. Results: ``results.json`` and ``results.md`` in ``--out``.

    python benchmarks/trace_cost.py --out /tmp/trace --commit SHA    # ~5 min on 2 CPU cores
    python benchmarks/trace_cost.py --out /tmp/trace_dry --dry-run   # 2 layers, 1 repeat: a code check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

VARIANTS = ("static_cache", "ropekv", "ropekv_dynamic_batch", "ropekv_static_batch", "ropekv_recency",
            "ropekv_plain_sdpa")
DYNAMIC_BATCH = {"ropekv_dynamic_batch": True, "ropekv_static_batch": False}  # the others: the default


def child(backend: str, variant: str, layers: int, batch: int) -> dict:
    import torch
    from transformers import CompileConfig, Qwen3Config, Qwen3ForCausalLM, StaticCache

    from hf_ropekv import RecencyScorer, RopeKVCache
    from hf_ropekv._compat import cache_kwarg

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_sliding_window=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    ids = torch.randint(3, 100, (batch, 64))
    nodes: list[int] = []

    def counting_eager(gm, example_inputs):  # dynamo's eager backend, counting the traced graph's FX nodes
        nodes.append(len(gm.graph.nodes))
        return gm.forward

    compile_config = CompileConfig(backend=counting_eager if backend == "eager" else backend, fullgraph=True,
                                   mode=None)
    compile_config._compile_all_devices = True  # generate compiles on accelerators only by default

    def make():
        if variant == "static_cache":
            return StaticCache(config=config, max_cache_len=64 + 8)
        options = dict(budget=48, compress_every=16, static=True, protect_prompt=False)
        if variant in DYNAMIC_BATCH:
            options["dynamic_batch"] = DYNAMIC_BATCH[variant]
        if variant == "ropekv_recency":
            options["scorer"] = RecencyScorer()
        cache = RopeKVCache(model, **options)
        if variant == "ropekv_plain_sdpa":
            model.config._attn_implementation = "sdpa"  # after the cache switched it (README: to opt out)
        return cache

    def run() -> float:
        cache = make()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, pad_token_id=0, compile_config=compile_config, **{cache_kwarg(model): cache})
        return time.perf_counter() - t0

    first, again = run(), run()
    from torch._dynamo.utils import counters

    return dict(first_s=first, again_s=again, trace_s=first - again, graphs=counters["stats"]["unique_graphs"],
                fx_nodes=nodes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--backend", default="eager")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--batch", type=int, default=1, help="rows of the generation")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dry-run", action="store_true", help="2 layers, 1 repeat: a code check")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dry_run:
        args.layers, args.repeats = 2, 1
    if args.child:
        print(json.dumps(child(args.backend, args.child, args.layers, args.batch)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for variant in [v for v in args.variants.split(",") if v]:
        runs = []
        for _ in range(args.repeats):
            command = [sys.executable, __file__, "--out", args.out, "--backend", args.backend, "--layers",
                       str(args.layers), "--batch", str(args.batch), "--child", variant]
            proc = subprocess.run(command, capture_output=True, text=True, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(variant, runs[-1], flush=True)
        rows[variant] = dict(runs=runs, trace_s_median=statistics.median(r["trace_s"] for r in runs))
    import torch
    import transformers

    meta = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=args.commit,
                device=f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
                       f"transformers {transformers.__version__}",
                backend=args.backend, layers=args.layers, batch=args.batch, repeats=args.repeats,
                command="python benchmarks/trace_cost.py " + " ".join(sys.argv[1:]))
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    reference = rows.get("static_cache", {}).get("trace_s_median")
    lines = [f"# Trace cost of the compiled decode step ({args.backend} backend, {args.layers} layers, batch "
             f"{args.batch})", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "| variant | trace s (median) | runs (first call / again) | vs StaticCache | FX nodes per graph |",
             "|---|---|---|---|---|"]
    for variant, row in rows.items():
        runs = ", ".join(f"{r['first_s']:.1f} / {r['again_s']:.2f}" for r in row["runs"])
        ratio = f"{row['trace_s_median'] / reference:.2f}×" if reference else "n/a"
        nodes = ", ".join(str(n) for n in row["runs"][0].get("fx_nodes", [])) or "n/a"
        lines.append(f"| {variant} | {row['trace_s_median']:.1f} | {runs} | {ratio} | {nodes} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
