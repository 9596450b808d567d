#!/usr/bin/env python
"""Does the compiled static cache generate the eager static cache's tokens? (GPU, bf16, cuDNN sdpa off.)

``RopeKVCache(static=True)`` decodes inside ``model.generate`` twice from the same left-padded batch: eagerly
(``disable_compile=True``), then compiled by generate itself (inductor, CUDA graphs; ``fullgraph=True`` so a
graph break is an error). The tokens are compared step by step; at the first difference, the eager run's top-2
logit margin there says whether it is a near-tie that bf16 rounding can flip. Also recorded: the growing default
cache's tokens (``static=False``) against the eager static ones, recompilations across a second compiled
generate() call with a fresh cache, CUDA-graph skips, and the compile warm-up.

    python benchmarks/static_exactness.py --out OUT --commit SHA              # qwen3-1.7b shape on CUDA
    python benchmarks/static_exactness.py --dry-run --out /tmp/exact_dry      # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    add_run_args, apply_run_args, import_hf_ropekv, padded_prompts, run_device, run_header, run_metadata, write_results,
)

import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import models

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402


def run(model, cache, ids, mask, steps: int, compile_config: CompileConfig | None) -> tuple[torch.Tensor, list, float]:
    extra: dict[str, Any] = {"disable_compile": True} if compile_config is None else {"compile_config": compile_config}
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True, **{cache_kwarg(model): cache}, **extra,
    )
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return out.sequences[:, ids.shape[1] :], list(out.scores), time.perf_counter() - start


def first_divergence(reference: torch.Tensor, scores: list, other: torch.Tensor) -> dict[str, Any]:
    """Where ``other`` first differs from ``reference`` (per row), with the reference's top-2 margin there."""
    rows = []
    for row in range(reference.shape[0]):
        differ = (reference[row] != other[row]).nonzero()
        if differ.numel() == 0:
            rows.append({"row": row, "identical_steps": reference.shape[1]})
            continue
        step = int(differ[0])
        top2 = scores[step][row].float().topk(2).values
        rows.append({"row": row, "first_divergence_step": step, "reference_top2_margin": float(top2[0] - top2[1]),
                     "identical_steps": step})
    return {"identical": bool(torch.equal(reference, other)), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(models.SHAPES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--compress-every", type=int, default=64)
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.batch, args.prompt, args.steps, args.budget, args.compress_every = "tiny", 2, 24, 24, 16, 4
    args.no_cudnn_sdpa = True  # bit-exactness: cuDNN's sdpa is not deterministic from call to call
    apply_run_args(args)
    device = run_device(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(device, args.commit, sys.argv if argv is None else argv)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = models.build_random_model(models.make_config(args.shape), dtype=dtype, device=device)
    ids, mask = padded_prompts(args.batch, args.prompt, model.config.vocab_size, device)
    options = dict(budget=args.budget, compress_every=args.compress_every, protect_prompt=False)
    compile_config = CompileConfig(fullgraph=True)
    if device.type != "cuda":
        compile_config = CompileConfig(fullgraph=True, backend="eager", mode=None)
        compile_config._compile_all_devices = True

    eager_cache = RopeKVCache(model, **options, static=True)
    eager, scores, eager_s = run(model, eager_cache, ids, mask, args.steps, None)
    growing, _, growing_s = run(model, RopeKVCache(model, **options), ids, mask, args.steps, None)
    counters.clear()
    compiled_cache = RopeKVCache(model, **options, static=True)
    compiled, _, first_s = run(model, compiled_cache, ids, mask, args.steps, compile_config)
    graphs_after_first = counters["stats"]["unique_graphs"]
    again, _, second_s = run(model, RopeKVCache(model, **options, static=True), ids, mask, args.steps, compile_config)
    result = {
        "meta": meta,
        "setup": {"shape": args.shape, "dtype": str(dtype), "batch": args.batch, "prompt": args.prompt,
                  "left_pads": [int((mask[r] == 0).sum()) for r in range(args.batch)], "steps": args.steps, **options,
                  "compactions": compiled_cache.num_compactions},
        "compiled_vs_eager_static": first_divergence(eager, scores, compiled),
        "second_compiled_call_vs_first": first_divergence(compiled, scores, again),
        "growing_default_vs_eager_static": first_divergence(eager, scores, growing),
        "graphs": {"after_first_call": graphs_after_first, "after_second_call": counters["stats"]["unique_graphs"]},
        "inductor_counters": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
        "seconds": {"eager_static": eager_s, "eager_growing": growing_s, "compiled_first_call": first_s,
                    "compiled_second_call": second_s, "compile_warm_up": first_s - second_s},
    }
    lines = [run_header(meta, "Compiled static cache against eager (tokens)"), "",
             f"`{args.shape}` random weights, {dtype}, batch {args.batch} (left pads {result['setup']['left_pads']}), "
             f"prompt {args.prompt}, {args.steps} new tokens, budget {args.budget}, compress_every "
             f"{args.compress_every}, {compiled_cache.num_compactions} compactions, cuDNN sdpa off.", ""]
    for name in ("compiled_vs_eager_static", "second_compiled_call_vs_first", "growing_default_vs_eager_static"):
        lines.append(f"- {name}: {result[name]}")
    lines += [f"- graphs: {result['graphs']}", f"- CUDA-graph counters: {result['inductor_counters']}",
              f"- seconds: { {k: round(v, 2) for k, v in result['seconds'].items()} }"]
    write_results(out_dir, "static_exactness", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
