#!/usr/bin/env python
"""Memory over a long generation: the KV bytes a cache holds and the peak memory, against DynamicCache and
transformers' QuantizedCache (quanto int4, where optimum-quanto is installed).

    python benchmarks/memory.py --commit SHA                      # Qwen3-8B shape, bf16, to 32K tokens
    python benchmarks/memory.py --dry-run --out /tmp/memory.json  # a tiny random model on the CPU

Batch 1, a 64-token prompt (pinned), then random tokens up to ``--points``' largest. Decoding 32K tokens one by one
takes about 35 minutes per cache at the 8B shape, so tokens go through the model in chunks of ``compress_every``
(128): one compaction per chunk, at the cache state 128 single-token steps leave (DynamicCache and QuantizedCache in
chunks of 512: their footprint does not depend on how tokens arrive). At each checkpoint: the cache's bytes
(``bytes_held`` for RopeKVCache, every tensor a layer holds otherwise, quantized ones by their storage), the peak
allocated memory beyond the weights so far (an upper bound of decoding's: the chunk forwards count), and the median
of 4 real decode steps. Writes one JSON, after every cache.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch

import common
import policies

PROMPT, DECODE_STEPS = 64, 4


def tensor_bytes(obj: Any, seen: set) -> int:
    """Bytes of the storages behind ``obj`` (a tensor, a quantized tensor subclass, or a container), once each."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and flatten is not None:
            return sum(tensor_bytes(getattr(obj, name), seen) for name in flatten()[0])
        key = obj.untyped_storage().data_ptr()
        if key in seen or key == 0:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(item, seen) for item in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(item, seen) for item in obj.values())
    return 0


def cache_bytes(cache: Any) -> int:
    if hasattr(cache, "bytes_held"):
        return int(cache.bytes_held)
    seen: set = set()
    return sum(tensor_bytes(value, seen) for layer in cache.layers for value in vars(layer).values())


def make_cache(kind: str, model: torch.nn.Module, budget: int) -> Any:
    from transformers import DynamicCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "quantized":
        return policies.quanto_cache(model)
    return policies.make_cache(model, budget, "int8" if kind == "ropekv-int8" else "default")


def forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{common.cache_kwarg(model): cache}).logits
    return logits[:, -1:].argmax(-1)


def measure(kind: str, model: torch.nn.Module, args: argparse.Namespace, device: torch.device, log: common.Clock,
            weights: int) -> list[dict[str, Any]]:
    """One cache to every checkpoint: bytes held, peak growth, decode step."""
    gen = torch.Generator(device=device).manual_seed(0)

    def random_ids(n: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (1, n), device=device, generator=gen)

    cuda = device.type == "cuda"
    gc.collect()
    common.sync(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # Growth is counted from the weights alone, so what an earlier cache left allocated counts against this one.
    leftover = torch.cuda.memory_allocated(device) - weights if cuda else 0
    if leftover > 2**20:
        log(f"  {leftover / 2**20:.1f} MiB of an earlier cache still allocated: counted in {kind}'s peak growth")
    cache = make_cache(kind, model, args.budget)
    label = {"dynamic": "DynamicCache", "quantized": "QuantizedCache (quanto int4)",
             "ropekv": f"RopeKVCache(budget={args.budget})",
             "ropekv-int8": f"RopeKVCache(budget={args.budget}, kv_bits=8)"}[kind]
    chunk = args.compress_every if kind.startswith("ropekv") else 512
    token = forward(model, forward(model, random_ids(PROMPT), cache), cache)  # the prompt, then a decode step
    seen, rows = PROMPT + 1, []
    for point in args.points:
        while seen < point:
            q = min(chunk, point - seen)
            forward(model, random_ids(q), cache)
            seen += q
        times = []
        for _ in range(DECODE_STEPS):
            token, seconds = common.timed(lambda t=token: forward(model, t, cache), device)
            times.append(1e3 * seconds)
        seen += DECODE_STEPS
        peak = torch.cuda.max_memory_allocated(device) - weights if cuda else None
        rows.append({"cache": label, "kind": kind, "budget": None if kind in ("dynamic", "quantized") else args.budget,
                     "tokens": seen, "kept": getattr(cache, "tokens_kept", None), "cache_bytes": cache_bytes(cache),
                     "peak_bytes": peak, "leftover_bytes": leftover, "step_ms": common.percentile(times, 50)})
        log(f"  {label} at {seen} tokens: {rows[-1]['cache_bytes'] / 2**20:.1f} MiB held")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(common.SHAPES))
    p.add_argument("--caches", default="dynamic,ropekv,ropekv-int8,quantized")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128, help="the library's default: one compaction a chunk")
    p.add_argument("--points", default="4096,8192,16384,32768", help="token counts measured at")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.budget, args.points = "tiny", 64, "160,320"
    args.points = [int(x) for x in args.points.split(",")]
    cuda = torch.cuda.is_available() and not args.dry_run
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    log = common.Clock(args.max_minutes)
    path = common.out_path("memory", args.out, device)
    model = common.build_random_model(args.shape, dtype=dtype, device=device)
    gc.collect()
    weights = torch.cuda.memory_allocated(device) if cuda else 0
    result = {**common.run_metadata("memory", "memory.py", argv, device, args.commit), "rows": [], "notes": [],
              "settings": {"shape": args.shape, "dtype": str(dtype), "budget": args.budget, "prompt": PROMPT,
                           "kv_bytes_per_token": common.kv_bytes_per_token(model.config, dtype)}}
    for kind in args.caches.split(","):
        if log.out_of_time():
            result["notes"].append(f"{kind}: not run (--max-minutes)")
            continue
        start = time.perf_counter()
        try:
            result["rows"] += measure(kind, model, args, device, log, weights)
        except Exception as err:  # noqa: BLE001 - e.g. no optimum-quanto here: the other caches go on
            result["notes"].append(f"{kind}: {type(err).__name__}: {str(err)[:300]}")
            log(f"{kind} failed: {result['notes'][-1]}")
        policies.hf_ropekv.detach(model)  # a static cache's arena stays pooled on the model for its next cache
        log(f"{kind} done in {time.perf_counter() - start:.0f} s")
        common.write_json(path, result)
    from report import memory_table

    print(memory_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
