#!/usr/bin/env python
"""What RopeKVCache adds to the host's work per decode step inside ``model.generate``, against DynamicCache.

An eager decode step of a large model at batch 1 is host-bound (the H200 runs a Qwen3-8B step's ~2,250 kernels
faster than the host launches them), so every ATen op and every line of Python the cache adds per step shows in
the step time. This script measures that cost on a model whose compute is negligible: by default a Qwen3 of 36
layers (Qwen3-8B's depth, so as many hooks and per-layer ops) with hidden size 64 (``--shape tiny-deep``), on the
CPU. For each context length and cache it

1. fills a cache with a random prompt (forwards of ``--prefill-chunk`` tokens; the last prompt token is left to
   ``generate``), afresh for every measurement (``DynamicCache``: a deep copy; a ``RopeKVCache`` is refilled, so
   that no other one's idle hooks stay on the model);
2. counts, per decode step of ``generate``, the ATen ops dispatched (a ``TorchDispatchMode``), the host
   synchronisations (``aten._local_scalar_dense``: ``.item()``, ``bool(t)``, ``int(t)``; plus ``Tensor.tolist()``,
   which on a CPU tensor never reaches the dispatcher), the ``nonzero``-like ops (they sync on a GPU) and the
   tensors built from host values (``torch.tensor(...)``: a host-to-device copy on a GPU);
3. times the steps: wall clock between successive logits (``generate`` synchronises once a step, so on a GPU this
   is the step) and this thread's CPU time (steadier on a shared host), over ``--repeats`` alternated rounds,
   keeping each cache's best median.

Only steady-state steps count: the steps of the second compaction cycle (``--warm`` defaults to
``compress_every``), without its compacting step. A ``RopeKVCache`` meets each of its kept lengths for the first
time in its first cycle (and makes its views of the arena then). With a prompt shorter than ``budget +
compress_every`` the arena still grows during the first cycle and the views are made again in the second: then
pass ``--warm`` and ``--steps`` of one cycle more. ``RopeKVCache`` runs with its defaults (online statistics
with a half-life, per-layer selection, window 32) and ``protect_prompt=False``.

On the CPU, ``DynamicCache``'s step also copies its whole cache (``torch.cat``), so its time grows with the
context there (on a GPU that copy is device time, hidden under a host-bound step): compare op counts, and
``RopeKVCache``'s times between commits. On CUDA the script also times the first and later calls of the
compaction's pieces (``RopeKVCache._select``: scoring, with the Triton scoring kernel inside; ``compact_arenas``:
the Triton compaction kernel), with the Triton cache folder's state at the start: the first compaction of a
process compiles both kernels unless Triton's on-disk cache already holds them.

    python benchmarks/host_overhead.py --out /tmp/host                               # CPU, tiny-deep, 4K and 32K
    python benchmarks/host_overhead.py --out OUT --device cuda --shape qwen3-8b --commit SHA   # the GPU run
    python benchmarks/host_overhead.py --out OUT --contexts 4096 --cprofile 25      # + the top Python functions
    python benchmarks/host_overhead.py --dry-run --out /tmp/host_dry                # seconds: a code check
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from common import (  # first: sets the hub defaults before transformers is imported
    import_hf_ropekv,
    median,
    run_header,
    run_metadata,
    write_results,
)

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import models

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402

SYNC_OPS = ("_local_scalar_dense",)  # .item(), bool(t), int(t), float(t)
NONZERO_OPS = ("nonzero", "nonzero_static", "masked_select", "unique", "_unique2")


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched while active, by name, and the ``Tensor.tolist()`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self._tolist: Callable | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        original = torch.Tensor.tolist
        ops = self.ops

        def tolist(tensor, *a, **k):  # CPU tensors convert without dispatching anything: count the call
            ops["Tensor.tolist"] += 1
            return original(tensor, *a, **k)

        self._tolist = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


class StepRecorder(LogitsProcessor):
    """At each step's logits: wall and thread-CPU time, the cache's compaction count and the op counts so far."""

    def __init__(self, cache, counter: OpCounter | None = None) -> None:
        self.cache, self.counter = cache, counter
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []
        self.compactions: list[int] = []
        self.counts: list[Counter[str]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.thread_time())
        self.compactions.append(getattr(self.cache, "num_compactions", 0))
        if self.counter is not None:
            self.counts.append(Counter(self.counter.ops))
        return scores

    def plain_steps(self, warm: int) -> list[int]:
        """Indices ``i >= warm`` of the gaps ``stamps[i] -> stamps[i + 1]`` that are decode steps without compaction."""
        return [i for i in range(warm, len(self.stamps) - 1) if self.compactions[i + 1] == self.compactions[i]]


class CallTimer:
    """Times every call of some functions (CUDA-synchronised): the first one of a process against the others."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        calls = self.ms.setdefault(f"{getattr(owner, '__name__', owner)}.{name}", [])

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            torch.cuda.synchronize()
            calls.append(1e3 * (time.perf_counter() - t0))
            return out

        setattr(owner, name, timed)

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        return {
            name: dict(calls=len(ms), first_ms=ms[0] if ms else None, later_median_ms=median(ms[1:]))
            for name, ms in self.ms.items()
        }


def triton_cache_state() -> dict[str, Any]:
    """Where Triton keeps compiled kernels and how many files it held when this run started."""
    folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache"
    )
    files = sum(len(names) for _, _, names in os.walk(folder)) if os.path.isdir(folder) else 0
    return dict(folder=folder, files_at_start=files)


def fill(model, cache, prompt: torch.Tensor, chunk: int, kwarg: str) -> None:
    """Run all but the last prompt token through the model into ``cache``, ``chunk`` tokens per forward."""
    total = prompt.shape[1] - 1
    with torch.no_grad():
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            mask = torch.ones(prompt.shape[0], end, dtype=torch.long, device=prompt.device)
            model(input_ids=prompt[:, start:end], attention_mask=mask, use_cache=True, **{kwarg: cache})


def run_generate(model, cache, prompt: torch.Tensor, steps: int, kwarg: str, recorder: StepRecorder) -> None:
    with torch.no_grad():
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            logits_processor=LogitsProcessorList([recorder]),
            **{kwarg: cache},
        )


def count_ops(model, cache, prompt, steps: int, kwarg: str, warm: int) -> dict[str, Any]:
    """Per plain decode step after the first ``warm``: ATen ops, syncs, nonzero-like ops, host-built tensors."""
    counter = OpCounter()
    recorder = StepRecorder(cache, counter)
    with counter:
        run_generate(model, cache, prompt, steps, kwarg, recorder)
    per_step = [recorder.counts[i + 1] - recorder.counts[i] for i in recorder.plain_steps(warm)]
    total: Counter[str] = Counter()
    for c in per_step:
        total.update(c)
    n = max(1, len(per_step))

    def mean_of(names) -> float:
        return sum(total[name] for name in names) / n

    return dict(
        steps_counted=len(per_step),
        ops_per_step=sum(total.values()) / n - mean_of(("Tensor.tolist",)),
        syncs_per_step=mean_of(SYNC_OPS) + mean_of(("Tensor.tolist",)),
        item_like_per_step=mean_of(SYNC_OPS),
        tolist_per_step=mean_of(("Tensor.tolist",)),
        nonzero_per_step=mean_of(NONZERO_OPS),
        host_tensors_per_step=mean_of(("lift_fresh",)),
        op_mix={name: count / n for name, count in total.most_common()},
    )


def time_steps(model, cache, prompt, steps: int, kwarg: str, warm: int) -> tuple[list[float], list[float], float]:
    """Wall and thread-CPU microseconds of each plain decode step after the first ``warm``, and the mean wall
    microseconds of every decode step but the first (both cycles, compaction steps included)."""
    recorder = StepRecorder(cache)
    run_generate(model, cache, prompt, steps, kwarg, recorder)
    wall, cpu = recorder.stamps, recorder.cpu_stamps
    plain = recorder.plain_steps(warm)
    every = 1e6 * (wall[-1] - wall[1]) / max(1, len(wall) - 2)
    return [1e6 * (wall[i + 1] - wall[i]) for i in plain], [1e6 * (cpu[i + 1] - cpu[i]) for i in plain], every


def paired_ratios(rounds: dict[str, list[float]], name: str, reference: str) -> list[float]:
    """``name``'s figure over ``reference``'s, round by round (each round ran both, back to back): the host's speed
    drifts in phases of seconds, so ratios within a round are steadier than best-of-run figures."""
    return [a / b for a, b in zip(rounds[name], rounds[reference])]


def python_profile(model, cache, prompt, steps: int, kwarg: str, top: int) -> str:
    """The ``top`` Python functions by own time over one whole ``generate()`` (its compactions included)."""
    recorder = StepRecorder(cache)
    profiler = cProfile.Profile()
    profiler.enable()
    run_generate(model, cache, prompt, steps, kwarg, recorder)
    profiler.disable()
    text = io.StringIO()
    text.write(f"cProfile of one generate() of {steps + 1} steps (totals, compaction steps included)\n")
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def model_hooks(model) -> int:
    """Forward hooks on ``model`` and its modules: a live RopeKVCache's stay, and run idle in any other forward."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def markdown(result: dict[str, Any], contexts: list[int]) -> str:
    args = result["settings"]
    by = {(r["context"], r["cache"]): r for r in result["rows"]}
    lines = [
        "# Host work per decode step inside generate(): DynamicCache vs RopeKVCache",
        "",
        run_header(result["meta"], f"{args['shape']} ({result['shape']['layers']} layers, hidden "
                   f"{result['shape']['hidden']}), {result['dtype']}, batch {args['batch']}, "
                   f"RopeKVCache(budget={args['budget']}, compress_every={args['compress_every']}, "
                   "protect_prompt=False), otherwise defaults"),
        "",
        f"Per plain decode step of the second compaction cycle (steps {args['warm']}..{args['steps'] - 1} of "
        "generate, compacting steps left out). Syncs: `_local_scalar_dense` (`.item()`, `bool(t)`) + `tolist()`; "
        "host tensors: `torch.tensor(...)` (a host-to-device copy on a GPU). Times: best median of "
        f"{args['repeats']} alternated runs.",
        "",
        "| context | cache | ATen ops | − DynamicCache | syncs | nonzero | host tensors | wall µs | CPU µs | "
        "wall ratio | CPU ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ref = by.get((r["context"], "DynamicCache"), r)
        lines.append(
            f"| {r['context']} | {r['cache']} | {r['ops_per_step']:.1f} | {r['ops_per_step'] - ref['ops_per_step']:+.1f} "
            f"| {r['syncs_per_step']:.2f} | {r['nonzero_per_step']:.2f} | {r['host_tensors_per_step']:.2f} | "
            f"{r['host_us_per_step']:.0f} | {r['cpu_us_per_step']:.0f} | "
            f"{r['host_us_per_step'] / ref['host_us_per_step']:.3f} | {r['cpu_us_per_step'] / ref['cpu_us_per_step']:.3f} |"
        )
    if all((c, name) in by for c in contexts for name in ("DynamicCache", "RopeKVCache")):
        lines += ["", f"Paired, RopeKVCache / DynamicCache within each of the {args['repeats']} rounds (the two ran back "
                      "to back, order alternating): the median over rounds, and the range. *Plain*: the median plain "
                      "step of the second cycle, as above; *all steps*: the mean of every decode step but the first "
                      "(both cycles, compaction steps included).", "",
                  "| context | plain, median | plain, range | all steps, median | all steps, range |",
                  "|---|---:|---:|---:|---:|"]
        for context in contexts:
            r = by[(context, "RopeKVCache")]
            plain, every = r["paired_plain"], r["paired_all_steps"]
            lines.append(f"| {context} | {median(plain):.3f} | {min(plain):.3f}–{max(plain):.3f} | "
                         f"{median(every):.3f} | {min(every):.3f}–{max(every):.3f} |")
        lines += ["", "Ops RopeKVCache adds per step, by op (mean count; negative: ops DynamicCache runs instead):", ""]
        for context in contexts:
            rope, dyn = by[(context, "RopeKVCache")]["op_mix"], by[(context, "DynamicCache")]["op_mix"]
            extra = {k: rope.get(k, 0) - dyn.get(k, 0) for k in set(rope) | set(dyn)}
            extra = {k: v for k, v in sorted(extra.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 0.5}
            lines.append(f"- {context}: " + (", ".join(f"{k} {v:+.1f}" for k, v in extra.items()) or "none"))
    if result.get("compaction_calls"):
        lines += ["", f"Compaction pieces, first call of the process against the later ones (Triton cache "
                      f"`{result['triton_cache']['folder']}` held {result['triton_cache']['files_at_start']} files "
                      "at the start):", "", "| function | calls | first ms | later median ms |", "|---|---:|---:|---:|"]
        for name, row in result["compaction_calls"].items():
            later = "n/a" if row["later_median_ms"] is None else f"{row['later_median_ms']:.2f}"
            first = "n/a" if row["first_ms"] is None else f"{row['first_ms']:.1f}"
            lines.append(f"| `{name}` | {row['calls']} | {first} | {later} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--commit", default=None, help="git commit of the code (the GPU machine may have no .git)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes and few steps: a code check")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny-deep", choices=sorted(models.SHAPES))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768], help="prompt tokens")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="decode steps per generate(); default: two cycles")
    p.add_argument("--warm", type=int, default=None, help="first steps left out; default: the first cycle")
    p.add_argument("--repeats", type=int, default=3, help="timed generate() calls per cache, alternated")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--caches", nargs="+", default=["DynamicCache", "RopeKVCache"],
                   choices=["DynamicCache", "RopeKVCache"])
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="also print the N top Python functions")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.contexts, args.budget, args.compress_every, args.repeats = "tiny-deep", [96], 32, 8, 1
        args.prefill_chunk = 40
    if args.steps is None:
        args.steps = 2 * args.compress_every - 2  # forwards 0..steps: compactions at 0 and compress_every
    if args.warm is None:
        args.warm = args.compress_every
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(device, args.commit, sys.argv[1:] if argv is None else argv)

    timer = None
    if device.type == "cuda":  # the first compaction of the process against the later ones
        timer = CallTimer()
        timer.wrap(hf_ropekv.cache.cache.RopeKVCache, "_select")
        timer.wrap(hf_ropekv.storage.paged, "compact_arenas")
        hf_ropekv.eviction.compactor.compact_arenas = hf_ropekv.storage.paged.compact_arenas  # the compactor calls it from there
    triton_cache = triton_cache_state()

    config = models.make_config(args.shape)
    config.max_position_embeddings = max(config.max_position_embeddings, max(args.contexts) + args.steps + 8)
    model = models.build_random_model(config, dtype=dtype, device=device)
    kwarg = cache_kwarg(model)
    gen = torch.Generator(device=device).manual_seed(0)
    makers: dict[str, Callable[[], Any]] = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        "RopeKVCache": lambda: RopeKVCache(
            model, budget=args.budget, compress_every=args.compress_every, protect_prompt=False
        ),
    }
    makers = {name: makers[name] for name in args.caches}
    result: dict[str, Any] = dict(meta=meta, settings=vars(args), shape=models.shape_summary(config),
                                  dtype=str(dtype), triton_cache=triton_cache, rows=[], profiles={})
    for context in args.contexts:
        prompt = torch.randint(3, config.vocab_size, (args.batch, context), device=device, generator=gen)
        dynamic = None
        if "DynamicCache" in makers:
            t0 = time.perf_counter()
            dynamic = makers["DynamicCache"]()
            fill(model, dynamic, prompt, args.prefill_chunk, kwarg)
            print(f"[{context}] DynamicCache filled in {time.perf_counter() - t0:.1f} s", flush=True)

        def fresh(name: str):
            """A cache holding the prompt but its last token."""
            gc.collect()  # the last RopeKVCache, and its hooks, are gone before the next cache runs
            if name == "DynamicCache":
                if model_hooks(model):
                    raise RuntimeError(f"{model_hooks(model)} hooks of a RopeKVCache are still on the model")
                return copy.deepcopy(dynamic)
            cache = makers[name]()
            fill(model, cache, prompt, args.prefill_chunk, kwarg)
            return cache

        # One untimed generate() per cache first: one-time costs (kernel compilation, allocator growth).
        for name in makers:
            cache = fresh(name)
            time_steps(model, cache, prompt, min(args.steps, args.compress_every + 2), kwarg, 0)
            cache = None
        counts, kept = {}, {}
        for name in makers:
            cache = fresh(name)
            counts[name] = count_ops(model, cache, prompt, args.steps, kwarg, args.warm)
            kept[name] = int(getattr(cache, "tokens_kept", cache.get_seq_length()))
            cache = None
        walls: dict[str, list[float]] = {name: [] for name in makers}
        cpus: dict[str, list[float]] = {name: [] for name in makers}
        everys: dict[str, list[float]] = {name: [] for name in makers}
        for repeat in range(args.repeats):
            for name in list(makers) if repeat % 2 == 0 else list(reversed(makers)):
                cache = fresh(name)
                wall, cpu, every = time_steps(model, cache, prompt, args.steps, kwarg, args.warm)
                cache = None
                walls[name].append(median(wall))
                cpus[name].append(median(cpu))
                everys[name].append(every)
        for name in makers:
            row = dict(context=context, cache=name, host_us_per_step=min(walls[name]), medians_us=walls[name],
                       cpu_us_per_step=min(cpus[name]), cpu_medians_us=cpus[name], mean_all_steps_us=everys[name],
                       kept=kept[name], **counts[name])
            if "DynamicCache" in makers:
                row["paired_plain"] = paired_ratios(walls, name, "DynamicCache")
                row["paired_all_steps"] = paired_ratios(everys, name, "DynamicCache")
            if args.cprofile:
                cache = fresh(name)
                result["profiles"][f"{context}/{name}"] = text = python_profile(
                    model, cache, prompt, args.steps, kwarg, args.cprofile
                )
                cache = None
                print(f"--- {name} at {context}\n{text}")
            result["rows"].append(row)
            print(f"[{context}] {name:12}: {row['ops_per_step']:7.1f} ops, {row['syncs_per_step']:.2f} syncs, "
                  f"{row['host_tensors_per_step']:.2f} host tensors, {row['host_us_per_step']:8.0f} us per step, "
                  f"{row['cpu_us_per_step']:8.0f} CPU us (medians {', '.join(f'{m:.0f}' for m in walls[name])}; "
                  f"CPU {', '.join(f'{m:.0f}' for m in cpus[name])}; all-step means "
                  f"{', '.join(f'{m:.0f}' for m in everys[name])})", flush=True)
        dynamic = None
    if timer is not None:
        result["compaction_calls"] = timer.summary()
    write_results(out_dir, "host_overhead", result, markdown(result, args.contexts))
    return result


if __name__ == "__main__":
    main()
