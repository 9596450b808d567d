#!/usr/bin/env python
"""Decode speed inside ``model.generate``, the way users call it: DynamicCache against RopeKVCache.

The suite (``suite.py``) times single forwards on a cache filled in steady state. This script runs greedy
``generate()`` from a random prompt, with an attention mask, for each cache, and records when each decode step's
logits reach the logits processors (a host timestamp; ``generate`` synchronises once per step on its stopping
check, so the gaps are the steps). A RopeKVCache meets each of its ~``compress_every`` K/V lengths for the first
time during its first compression cycle and reuses them after; the steps are reported for the first cycle and for
the rest separately, because sdpa's cuDNN backend plans every new length on the host (benchmarks/README.md).

    python benchmarks/generate_speed.py --out gen --commit SHA                 # qwen3-8b bf16 on CUDA
    python benchmarks/generate_speed.py --out gen --no-cudnn-sdpa             # flash attention instead
    python benchmarks/generate_speed.py --dry-run --out /tmp/gen_dry           # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common import (  # first: sets the hub defaults before transformers is imported
    Memory,
    Progress,
    add_run_args,
    apply_run_args,
    import_hf_ropekv,
    median,
    run_device,
    run_generate,
    run_header,
    run_metadata,
    write_results,
)

import torch
from transformers import DynamicCache

import models

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens (random ids)")
    p.add_argument("--new-tokens", type=int, default=384)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    args = p.parse_args(argv)
    apply_run_args(args)
    if args.dry_run:
        args.shape, args.prompt, args.new_tokens, args.budget, args.compress_every = "tiny", 96, 40, 32, 8
    device = run_device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    log, mem = Progress(None), Memory(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = models.build_random_model(models.make_config(args.shape), dtype=dtype, device=device)
    kwarg = cache_kwarg(model)
    gen = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=device, generator=gen)
    ce = args.compress_every
    caches = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        # Nothing pinned: the random prompt is part of what gets evicted, as in a long document.
        f"RopeKVCache(budget={args.budget})": lambda: RopeKVCache(
            model, budget=args.budget, compress_every=ce, protect_prompt=False
        ),
    }
    result: dict[str, Any] = dict(
        meta=run_metadata(device, args.commit, sys.argv[1:] if argv is None else argv),
        shape=args.shape, dtype=str(dtype), batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
        budget=args.budget, compress_every=ce, runs=[],
    )
    with torch.no_grad():
        run_generate(model, caches["DynamicCache"](), prompt[:, :64], 4, kwarg)  # warm-up: kernels, allocator
        for label, make in caches.items():
            cache = make()
            mem.clean()
            run = run_generate(model, cache, prompt, args.new_tokens, kwarg)
            steps = run.pop("steps_ms")
            first, rest = steps[: ce - 1], steps[ce - 1:]
            row = dict(
                cache=label,
                **run,
                step_ms_median=median(steps),
                first_cycle_step_ms=median(first),
                later_step_ms=median(rest) if rest else None,
                decode_tokens_per_s=1e3 * args.batch * len(steps) / sum(steps),
                kept=int(getattr(cache, "tokens_kept", cache.get_seq_length())),
                steps_ms=steps,
            )
            result["runs"].append(row)
            log(f"{label:26}: {row['new_tokens']} tokens, step median {row['step_ms_median']:.2f} ms (first "
                f"{len(first)} steps {row['first_cycle_step_ms']:.2f}, later {row['later_step_ms']} ms), "
                f"{row['decode_tokens_per_s']:.1f} tok/s, kept {row['kept']}")
            cache = None
    ref = result["runs"][0]
    lines = [
        "# Decode speed inside model.generate",
        "",
        run_header(
            result["meta"],
            f"{args.shape} {dtype}, random weights, sdpa "
            f"(backends enabled: {', '.join(result['meta']['sdpa_backends'])})",
        ),
        "",
        f"Greedy `generate()`, batch {args.batch}, a {args.prompt}-token random prompt, {args.new_tokens} new tokens; "
        f"`RopeKVCache(budget={args.budget}, compress_every={ce}, protect_prompt=False)`. Steps are the gaps between "
        f"successive logits on the host; 'first cycle' is the first {ce - 1} decode steps.",
        "",
        "| cache | step ms (median) | first cycle ms | later ms | decode tok/s | x DynamicCache | kept at the end |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        later = f"{r['later_step_ms']:.2f}" if r["later_step_ms"] is not None else "n/a"
        lines.append(
            f"| {r['cache']} | {r['step_ms_median']:.2f} | {r['first_cycle_step_ms']:.2f} | {later} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f} | "
            f"{r['kept']} |"
        )
    write_results(out_dir, "generate_speed", result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
