#!/usr/bin/env python
"""Where a ``RopeKVCache``'s time to first token goes: the eager prefill of ``generate()``, cache by cache.

The end-to-end run (``warmup.py --parts e2e``) gave the default ``RopeKVCache`` a time to first token of 2.65 s
against 0.41 s for ``DynamicCache`` (H200, Qwen3-8B shape, 4K prompt). This process runs, in order, a
``generate()`` that stops after its first token (so ``static="auto"`` settles as for a long generation and the
prefill is the default's, with no compile) for each of:

- ``dynamic``: transformers' ``DynamicCache``;
- ``ropekv``: ``RopeKVCache(model, budget)``, the defaults (static on CUDA for ``max_new_tokens`` 2000);
- ``ropekv_eager``: the same with ``static=False`` (growing layers);

in rounds: round 0 under ``cProfile`` for ``ropekv`` (host time by function, first call in the process), the later
rounds plain; one more ``ropekv`` call under ``torch.profiler``. Each timing syncs the device before and after, and
also stamps the first logits with a sync (the prefill's device work done) and without (what the e2e run's clock
saw). Run it twice with the same ``TRITON_CACHE_DIR`` to see the first process's kernel compiles apart.

    python benchmarks/prefill_profile.py --out /tmp/pp --commit SHA            # H200: ~1 min per process
    python benchmarks/prefill_profile.py --out /tmp/pp_dry --dry-run           # tiny model on the CPU: a code check
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = ("dynamic", "ropekv", "ropekv_eager")


class FirstTokenStop:
    """A stopping criterion that ends ``generate()`` after its first token, stamping when the logits arrived."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamp, self.synced = device, None, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.stamp = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.synced = time.perf_counter()
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def make_cache(model: Any, variant: str, budget: int) -> Any:
    from transformers import DynamicCache

    if variant == "dynamic":
        return DynamicCache(config=model.config)
    options = dict(static=False) if variant == "ropekv_eager" else {}
    return common.import_hf_ropekv().RopeKVCache(model, budget=budget, protect_prompt=False, **options)


def first_token(model: Any, variant: str, prompt: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import StoppingCriteriaList

    from hf_ropekv._compat import cache_kwarg

    if variant == "dynamic":
        common.stock_sdpa(model)
    stop = FirstTokenStop(prompt.device)
    sync = torch.cuda.synchronize if prompt.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    cache = make_cache(model, variant, args.budget)
    t1 = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([stop]), **{cache_kwarg(model): cache})
    sync()
    t2 = time.perf_counter()
    return dict(variant=variant, construct_ms=1e3 * (t1 - t0), logits_unsynced_ms=1e3 * (stop.stamp - t1),
                logits_synced_ms=1e3 * (stop.synced - t1), generate_ms=1e3 * (t2 - t1),
                static=getattr(cache, "static", None), static_reason=getattr(cache, "static_reason", None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=2000, help="max_new_tokens (static='auto' reads it)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="run", help="names this process's files (e.g. first, second)")
    args = p.parse_args(argv)
    args.no_cudnn_sdpa = True
    if args.dry_run:
        args.shape, args.budget, args.context = "tiny", 32, 64
    common.apply_run_args(args)
    common.import_hf_ropekv()  # the installed package, or this checkout's (before anything imports from it)
    device = common.run_device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = common.build_random_model(common.make_config(args.shape), dtype=dtype, device=device)
    build_s = time.perf_counter() - t0
    gen = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context), device=device, generator=gen)

    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            profiler = cProfile.Profile() if (round_ == 0 and variant == "ropekv") else None
            if profiler is not None:
                profiler.enable()
            run = first_token(model, variant, prompt, args)
            if profiler is not None:
                profiler.disable()
                for key in ("cumulative", "tottime"):
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(45)
                    (out / f"{args.tag}_cprofile_{key}.txt").write_text(text.getvalue())
            runs.append(dict(run, round=round_))
            print(json.dumps(runs[-1]), flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        traced = first_token(model, "ropekv", prompt, args)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    (out / f"{args.tag}_torch_profile.txt").write_text(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n\n"
        + prof.key_averages().table(sort_by=sort, row_limit=25))
    meta = common.run_metadata(device, args.commit, sys.argv)
    (out / f"{args.tag}.json").write_text(json.dumps(dict(meta=meta, build_s=build_s, runs=runs, traced=traced,
                                                          triton_cache=os.environ.get("TRITON_CACHE_DIR")),
                                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
