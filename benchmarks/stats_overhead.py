"""What online statistics cost a decoding step: the query hooks and the per-forward fold (issue 13).

Two caches of the same random-weight model decode side by side, alternating steps in one process so that the
host's drift hits both alike:

- ``calibrated``: ``RopeKVCache(model, budget, stats=<random statistics>)``: no query hooks at all;
- ``online``: ``RopeKVCache(model, budget)``: query hooks on every layer, decoding-step queries folded into
  per-row running sums after every forward.

Both evict on the same clock, so the difference between their step times is the price of following the
generation's queries. Steps are timed with ``torch.cuda.synchronize`` around each forward; compaction steps are
reported apart.

    python benchmarks/stats_overhead.py --out OUT --commit SHA --no-cudnn-sdpa      # Qwen3-8B shape, batch 16
    python benchmarks/stats_overhead.py --out OUT --dry-run                          # tiny, CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import models  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_run_args(p)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--steps", type=int, default=384)
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.batch, args.prompt, args.budget, args.compress_every, args.steps = "tiny", 2, 24, 24, 8, 24
    common.apply_run_args(args)
    hf_ropekv = common.import_hf_ropekv()
    device = common.run_device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = common.run_metadata(device, args.commit, sys.argv if argv is None else argv)

    config = models.make_config(args.shape)
    model = models.build_random_model(config, dtype=dtype, device=device)
    kwarg = hf_ropekv._compat.cache_kwarg(model)
    caches = {
        "calibrated": hf_ropekv.RopeKVCache(model, args.budget, compress_every=args.compress_every,
                                            stats=models.random_frequency_stats(model)),
        "online": hf_ropekv.RopeKVCache(model, args.budget, compress_every=args.compress_every),
    }
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens = {}
    with torch.no_grad():
        for name, cache in caches.items():
            logits = model(input_ids=prompt, **{kwarg: cache}).logits
            tokens[name] = logits[:, -1:].argmax(-1)
        times: dict[str, list[tuple[float, bool]]] = {name: [] for name in caches}
        for step in range(args.steps):
            for name, cache in (caches.items() if step % 2 == 0 else reversed(caches.items())):
                before = cache.num_compactions
                sync()
                t0 = time.perf_counter()
                logits = model(input_ids=tokens[name], **{kwarg: cache}).logits
                sync()
                elapsed = 1e3 * (time.perf_counter() - t0)
                tokens[name] = logits[:, -1:].argmax(-1)
                times[name].append((elapsed, cache.num_compactions != before))
    warm = args.steps // 8  # the first steps include one-time costs (kernel compilation, allocator growth)
    result = {"meta": meta, "settings": vars(args), "per_cache": {}}
    for name, rows in times.items():
        plain = [t for t, compacted in rows[warm:] if not compacted]
        compacting = [t for t, compacted in rows[warm:] if compacted]
        result["per_cache"][name] = {
            "median_step_ms": statistics.median(plain),
            "mean_step_ms": statistics.fmean(plain),
            "compaction_steps": len(compacting),
            "median_compaction_step_ms": statistics.median(compacting) if compacting else None,
            "amortised_step_ms": statistics.fmean([t for t, _ in rows[warm:]]),
            "kept": caches[name].tokens_kept,
        }
    cal, onl = result["per_cache"]["calibrated"], result["per_cache"]["online"]
    result["overhead_median"] = onl["median_step_ms"] / cal["median_step_ms"] - 1
    result["overhead_amortised"] = onl["amortised_step_ms"] / cal["amortised_step_ms"] - 1
    md = [
        "# Online statistics: cost per decoding step",
        "",
        common.run_header(meta, f"{args.shape}, batch {args.batch}, prompt {args.prompt}, budget {args.budget}, "
                          f"compress_every {args.compress_every}, {args.steps} alternated steps, {dtype}"),
        "",
        "| cache | median step (ms) | amortised step (ms) | compaction steps | median compaction step (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in result["per_cache"].items():
        md.append(f"| {name} | {row['median_step_ms']:.2f} | {row['amortised_step_ms']:.2f} | "
                  f"{row['compaction_steps']} | {row['median_compaction_step_ms'] or 0:.2f} |")
    md += ["", f"Online over calibrated: {100 * result['overhead_median']:+.2f} % (median step), "
               f"{100 * result['overhead_amortised']:+.2f} % (amortised)."]
    common.write_results(out, "stats_overhead", result, "\n".join(md) + "\n")
    return result


if __name__ == "__main__":
    main()
