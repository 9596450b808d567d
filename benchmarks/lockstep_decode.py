#!/usr/bin/env python
"""Decode steps of several caches inside ``model.generate``, run in lockstep: the host's drift hits all alike.

An eager decode step of a large model at batch 1 is host-bound, so a cache's own host work shows in the step
time. Comparing two caches by separate ``generate()`` calls is hard on a shared host whose speed moves by up to
1.4x within seconds (``results/issue12_2026-12-01_session5``). Here every variant runs its own ``generate()`` in
its own thread, and a turnstile lets exactly one step of one variant run at a time, round robin: variant 0's
step t, variant 1's step t, ..., variant 0's step t+1. Neighbouring steps of the variants then meet the same
host, and a ratio of medians over hundreds of steps is steady.

- **One model per variant** (same config, same seed): a live ``RopeKVCache`` hooks its model, and those hooks
  must not run, idle, inside the ``DynamicCache`` variant's steps. The models are identical and as large as
  their config says; an H200 holds three Qwen3-8B shapes in bf16.
- **A step** is the interval between two successive logits of one variant (``generate``'s own loop: stopping
  criteria with their host synchronisation, the next inputs, the forward), timed in wall clock and in thread
  CPU time. Before passing the turn on, a variant synchronises the device outside its timing, so every step
  starts on an idle GPU and no step pays for the previous variant's queued kernels.
- Compaction steps (a ``RopeKVCache``'s compaction count moved) are reported apart and in the all-steps mean.

    python benchmarks/lockstep_decode.py --out OUT --device cuda --shape qwen3-8b --contexts 4096 32768
    python benchmarks/lockstep_decode.py --out /tmp/ls --dry-run       # tiny-deep on the CPU: a code check
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from common import import_hf_ropekv, run_header, run_metadata, write_results  # first: hub defaults

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import models

hf_ropekv = import_hf_ropekv()
from hf_ropekv import RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402
from hf_ropekv.scorers import RecencyScorer  # noqa: E402


class Turnstile:
    """Round-robin turns among ``n`` threads; a thread that leaves is skipped from then on."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._active = list(range(n))

    def wait(self, i: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == i)

    def _advance(self, i: int) -> None:
        if self._active:
            later = [j for j in self._active if j > i]
            self._turn = later[0] if later else self._active[0]
        self._cond.notify_all()

    def pass_on(self, i: int) -> None:
        with self._cond:
            self._advance(i)

    def leave(self, i: int) -> None:
        with self._cond:
            self._active.remove(i)
            self._advance(i)


class GcPauses:
    """Python's garbage-collector pauses, per thread: a full collection (generation 2) of a process that holds
    models and compiled code can take hundreds of ms, and falls on whichever thread allocated last; it is reported
    apart, so that it is not read as a cost of the cache that happened to trigger it."""

    def __init__(self) -> None:
        self._started: dict[int, tuple[float, int]] = {}
        self.pending_us: dict[int, float] = {}
        self.pending_full: dict[int, int] = {}  # full collections (generation 2) among them

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._started[me] = (time.perf_counter(), info.get("generation", 0))
        elif me in self._started:
            t0, generation = self._started.pop(me)
            self.pending_us[me] = self.pending_us.get(me, 0.0) + 1e6 * (time.perf_counter() - t0)
            if generation == 2:
                self.pending_full[me] = self.pending_full.get(me, 0) + 1

    def take(self) -> tuple[float, int]:
        """µs this thread spent in collections since the last take, and how many of them were full ones."""
        me = threading.get_ident()
        return self.pending_us.pop(me, 0.0), self.pending_full.pop(me, 0)


class LockstepClock(LogitsProcessor):
    """At each logits: close the step that just ran, hand the turn on, wait for it, open the next step."""

    def __init__(
        self, index: int, turnstile: Turnstile, cache: Any, device: torch.device,
        python_profile: "PythonProfile | None" = None, gc_pauses: GcPauses | None = None,
    ) -> None:
        self.index, self.turnstile, self.cache, self.device = index, turnstile, cache, device
        self.python_profile = python_profile
        self.gc_pauses = gc_pauses
        self.gc_us: list[float] = []  # per step: time in the garbage collector (within wall_us)
        self.gc_full: list[int] = []  # per step: full collections among them
        self.wall_us: list[float] = []
        self.cpu_us: list[float] = []
        self.compacted: list[bool] = []
        self._opened: tuple[float, float, int] | None = None

    def open(self) -> None:
        self._opened = (time.perf_counter(), time.thread_time(), getattr(self.cache, "num_compactions", 0))
        if self.python_profile is not None:
            self.python_profile.open(len(self.wall_us))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.python_profile is not None:
            self.python_profile.close()
        wall, cpu = time.perf_counter(), time.thread_time()
        assert self._opened is not None
        w0, c0, n0 = self._opened
        self.wall_us.append(1e6 * (wall - w0))
        pause_us, full = self.gc_pauses.take() if self.gc_pauses is not None else (0.0, 0)
        self.gc_us.append(pause_us)
        self.gc_full.append(full)
        self.cpu_us.append(1e6 * (cpu - c0))
        self.compacted.append(getattr(self.cache, "num_compactions", 0) != n0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # outside the timing: the next variant starts on an idle GPU
        self.turnstile.pass_on(self.index)
        self.turnstile.wait(self.index)
        self.open()
        return scores


class PythonProfile:
    """``cProfile`` over decode steps ``first .. first + n`` of one variant, steps only (not the turnstile).

    A ``cProfile.Profile`` traces the thread that enables it, so each variant's profile holds its own steps only.
    It inflates every Python call alike (a few hundred ns each): the per-function *difference* between variants
    says where a cache's extra host time goes, not its size.
    """

    def __init__(self, first: int, n: int) -> None:
        self.first, self.n = first, n
        self.profile = cProfile.Profile()
        self._on = False
        self.steps = 0

    def open(self, step: int) -> None:  # step: intervals already closed (the prefill is interval 0)
        if self.first <= step < self.first + self.n:
            self.profile.enable()
            self._on = True

    def close(self) -> None:
        if self._on:
            self.profile.disable()
            self._on = False
            self.steps += 1

    def per_step(self) -> dict[str, dict[str, float]]:
        """Per profiled step, for every function: calls, own µs (tottime) and µs with callees (cumtime)."""
        stats = pstats.Stats(self.profile).stats  # type: ignore[attr-defined]
        out = {}
        for (path, line, name), (_, calls, tottime, cumtime, _) in stats.items():
            short = path if path.startswith("{") or path == "~" else f"{'/'.join(Path(path).parts[-2:])}:{line}"
            out[f"{short}({name})"] = dict(calls=calls / max(1, self.steps), own_us=1e6 * tottime / max(1, self.steps),
                                           cum_us=1e6 * cumtime / max(1, self.steps))
        return out


def python_table(profiles: dict[str, dict[str, dict[str, float]]], top: int = 40) -> str:
    """Per step, the functions whose own time differs most from the first variant's (cProfile)."""
    names = list(profiles)
    base = profiles[names[0]]
    keys = set().union(*profiles.values())
    own = lambda p, k: p.get(k, {}).get("own_us", 0.0)
    spread = lambda k: max(abs(own(p, k) - own(base, k)) for p in profiles.values())
    lines = ["| per step: calls × / own µs | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines.append("| all functions, own µs | " + " | ".join(
        f"{sum(f['own_us'] for f in p.values()):.0f}" for p in profiles.values()) + " |")
    for k in sorted(keys, key=spread, reverse=True)[:top]:
        cells = [f"{p.get(k, {}).get('calls', 0):.1f} × / {own(p, k):.1f}" for p in profiles.values()]
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def lockstep_generate(
    models_: list[torch.nn.Module], caches: list[Any], prompt: torch.Tensor, steps: int, kwarg: str,
    python_profiles: list[PythonProfile] | None = None,
) -> list[LockstepClock]:
    """One greedy ``generate()`` of ``steps + 1`` tokens per (model, cache), in lockstep threads."""
    turnstile = Turnstile(len(caches))
    gc.collect()  # young garbage of earlier runs goes now, not inside a timed step
    pauses = GcPauses()
    clocks = [LockstepClock(i, turnstile, cache, prompt.device, None if python_profiles is None else python_profiles[i],
                            pauses)
              for i, cache in enumerate(caches)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            turnstile.wait(i)
            clocks[i].open()
            with torch.no_grad():
                models_[i].generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=steps + 1,
                    min_new_tokens=steps + 1,
                    do_sample=False,
                    logits_processor=LogitsProcessorList([clocks[i]]),
                    **{kwarg: caches[i]},
                )
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
        finally:
            turnstile.leave(i)

    threads = [threading.Thread(target=run, args=(i,), name=f"variant-{i}") for i in range(len(caches))]
    with pauses:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return clocks


def summarise(clock: LockstepClock) -> dict[str, Any]:
    """Decode steps only (the first interval is the prefill): plain-step median and p90, all-steps mean."""
    wall, cpu, compacted = clock.wall_us[1:], clock.cpu_us[1:], clock.compacted[1:]
    gc_us = clock.gc_us[1:]
    plain = [w for w, c in zip(wall, compacted) if not c]
    plain_cpu = [w for w, c in zip(cpu, compacted) if not c]
    comp = [w for w, c in zip(wall, compacted) if c]
    q = statistics.quantiles(plain, n=10) if len(plain) >= 10 else [float("nan")] * 9
    return dict(
        steps=len(wall), plain_steps=len(plain), compaction_steps=len(comp),
        p50_us=statistics.median(plain), p90_us=q[8], mean_plain_us=statistics.mean(plain),
        mean_all_us=statistics.mean(wall), cpu_p50_us=statistics.median(plain_cpu),
        compaction_step_us=statistics.median(comp) if comp else None, prefill_ms=clock.wall_us[0] / 1e3,
        gc_ms=sum(gc_us) / 1e3, gc_full_collections=sum(clock.gc_full[1:]), mean_all_minus_gc_us=statistics.mean(w - g for w, g in zip(wall, gc_us)),
    )


def step_ratio(clock: LockstepClock, ref: LockstepClock) -> float:
    """Median over decode steps t (plain in both) of step t's time over the reference's step t, its neighbour."""
    pairs = zip(clock.wall_us[1:], clock.compacted[1:], ref.wall_us[1:], ref.compacted[1:])
    return statistics.median(a / b for a, ca, b, cb in pairs if not ca and not cb)


VARIANTS: dict[str, Callable[..., Any]] = {
    "DynamicCache": lambda model, args: DynamicCache(config=model.config),
    "RopeKVCache": lambda model, args: RopeKVCache(
        model, budget=args.budget, compress_every=args.compress_every, protect_prompt=False
    ),
    "RopeKVCache+recency": lambda model, args: RopeKVCache(
        model, budget=args.budget, compress_every=args.compress_every, protect_prompt=False, scorer=RecencyScorer()
    ),
}


class ProfileWindow(LogitsProcessor):
    """Runs ``torch.profiler`` over decode steps ``first .. first + n`` of one ``generate()``."""

    def __init__(self, first: int, n: int, device: torch.device) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=acts)
        self.first, self.n, self.step, self.wall = first, n, 0, 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.step == self.first:
            self.profiler.start()
            self.wall = time.perf_counter()
        elif self.step == self.first + self.n:
            self.wall = time.perf_counter() - self.wall
            self.profiler.stop()
        self.step += 1
        return scores


def op_profile(model: torch.nn.Module, cache: Any, prompt: torch.Tensor, kwarg: str, first: int, n: int) -> dict:
    """Per decode step, over ``n`` plain steps: every ATen op's calls and self CPU µs, CUDA kernels and their µs."""
    window = ProfileWindow(first, n, prompt.device)
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=first + n + 2,
                       min_new_tokens=first + n + 2, do_sample=False,
                       logits_processor=LogitsProcessorList([window]), **{kwarg: cache})
    ops: dict[str, dict[str, float]] = {}
    kernels = dict(calls=0.0, us=0.0)
    for e in window.profiler.key_averages():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kernels["calls"] += e.count / n
            kernels["us"] += e.self_device_time_total / n
            continue
        ops[e.key] = dict(calls=e.count / n, self_cpu_us=e.self_cpu_time_total / n)
    return dict(step_wall_us=1e6 * window.wall / n, ops=ops, kernels=kernels,
                self_cpu_us=sum(o["self_cpu_us"] for o in ops.values()))


def op_table(profiles: dict[str, dict]) -> str:
    """Side by side, per step: the ops whose self CPU time differs most between the variants."""
    names = list(profiles)
    base = profiles[names[0]]["ops"]
    keys = set().union(*(p["ops"] for p in profiles.values()))
    spread = lambda k: max(abs(p["ops"].get(k, {}).get("self_cpu_us", 0) - base.get(k, {}).get("self_cpu_us", 0))
                           for p in profiles.values())
    lines = ["| per step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines.append("| wall µs (under the profiler) | " + " | ".join(f"{p['step_wall_us']:.0f}" for p in profiles.values()) + " |")
    lines.append("| self CPU µs of all ATen ops | " + " | ".join(f"{p['self_cpu_us']:.0f}" for p in profiles.values()) + " |")
    lines.append("| CUDA kernels (calls / µs) | " + " | ".join(
        f"{p['kernels']['calls']:.0f} / {p['kernels']['us']:.0f}" for p in profiles.values()) + " |")
    for k in sorted(keys, key=spread, reverse=True)[:40]:
        cells = [f"{p['ops'].get(k, {}).get('calls', 0):.1f} × / {p['ops'].get(k, {}).get('self_cpu_us', 0):.0f}"
                 for p in profiles.values()]
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Decode steps in lockstep inside generate()", "",
        run_header(result["meta"], f"{s['shape']} · {result['dtype']} · batch {s['batch']} · budget {s['budget']} · "
                   f"compress_every {s['compress_every']} · {s['steps']} steps · {s['rounds']} round(s) · "
                   + ("threads on one core" if s.get("pin_core") is not None else "threads unpinned")), "",
        "Each variant runs its own generate() on its own copy of the model; one step of one variant at a time, "
        "round robin. µs per decode step; step ratio: the median over steps t of the variant's step t over DynamicCache's "
        "step t (plain steps of both); the other ratios: the variant's figure over DynamicCache's in the same round. "
        "GC: the garbage collector's pauses within the variant's steps (a full collection falls on whichever thread "
        "allocated last); the last ratio leaves them out of both means.", "",
        "| context | round | cache | p50 plain | p90 plain | mean plain | mean all steps | CPU p50 | compaction step | "
        "GC ms | step ratio | p50 ratio | mean-all ratio | mean-all ratio, GC out |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        comp = "—" if row["compaction_step_us"] is None else f"{row['compaction_step_us']:.0f}"
        lines.append(
            f"| {row['context']} | {row['round']} | {row['cache']} | {row['p50_us']:.0f} | {row['p90_us']:.0f} | "
            f"{row['mean_plain_us']:.0f} | {row['mean_all_us']:.0f} | {row['cpu_p50_us']:.0f} | {comp} | "
            f"{row['gc_ms']:.1f} | {row.get('step_ratio', 1.0):.3f} | {row.get('p50_ratio', 1.0):.3f} | "
            f"{row.get('mean_all_ratio', 1.0):.3f} | {row.get('mean_all_minus_gc_ratio', 1.0):.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny-deep on the CPU, few steps: a code check")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny-deep", choices=sorted(models.SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=384, help="timed decode steps per generate()")
    p.add_argument("--rounds", type=int, default=1, help="timed lockstep generate() calls per context")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--pin-core", type=int, default=None, metavar="CPU",
                   help="run every thread on this one CPU core (-1: the last core this process may use). Threads "
                        "on different cores meet cores of different speed on a shared host; the turnstile "
                        "already runs one step at a time, so one core costs nothing")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N plain decode steps of each variant (torch.profiler), at the first context")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile the Python functions of N decode steps of each variant (cProfile), in one "
                        "more lockstep generate() at each context")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.shape, args.contexts, args.budget, args.compress_every = "cpu", "tiny-deep", [96], 32, 8
        args.steps, args.rounds, args.profile, args.cprofile = 20, 1, min(args.profile, 4), min(args.cprofile, 4)
    if args.pin_core is not None:  # before CUDA starts its threads: they inherit the affinity
        core = max(os.sched_getaffinity(0)) if args.pin_core < 0 else args.pin_core
        os.sched_setaffinity(0, {core})
        args.pin_core = core
    device = torch.device(args.device)
    torch.backends.cuda.enable_cudnn_sdp(False)  # as every other speed figure of issue 12
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meta = run_metadata(device, args.commit, sys.argv[1:] if argv is None else argv)
    config = models.make_config(args.shape)
    config.max_position_embeddings = max(config.max_position_embeddings, max(args.contexts) + args.steps + 8)
    copies = [models.build_random_model(config, dtype=dtype, device=device) for _ in args.variants]
    kwarg = cache_kwarg(copies[0])
    gen = torch.Generator(device=device).manual_seed(0)
    result: dict[str, Any] = dict(meta=meta, settings=vars(args), shape=models.shape_summary(config),
                                  dtype=str(dtype), rows=[])
    if args.cprofile:  # steps after the first compaction cycle: every view a cache reuses exists, as in a long run
        result["cprofile_first_step"] = min(args.steps - args.cprofile, args.compress_every + 8)
    for context in args.contexts:
        prompt = torch.randint(3, config.vocab_size, (args.batch, context), device=device, generator=gen)
        # Untimed first: Triton's kernels compile, the allocator grows, every variant meets its shapes once.
        warm = min(args.steps, args.compress_every + 4)
        lockstep_generate(copies, [VARIANTS[v](m, args) for v, m in zip(args.variants, copies)], prompt, warm, kwarg)
        for r in range(args.rounds):
            caches = [VARIANTS[v](m, args) for v, m in zip(args.variants, copies)]
            clocks = lockstep_generate(copies, caches, prompt, args.steps, kwarg)
            del caches
            rows = [dict(context=context, round=r, cache=v, **summarise(c)) for v, c in zip(args.variants, clocks)]
            ref = next((row for row in rows if row["cache"] == "DynamicCache"), None)
            ref_clock = clocks[args.variants.index("DynamicCache")] if ref is not None else None
            for row, clock in zip(rows, clocks):
                if ref is not None:
                    row["step_ratio"] = step_ratio(clock, ref_clock)
                    row["p50_ratio"] = row["p50_us"] / ref["p50_us"]
                    row["mean_all_ratio"] = row["mean_all_us"] / ref["mean_all_us"]
                    row["mean_all_minus_gc_ratio"] = row["mean_all_minus_gc_us"] / ref["mean_all_minus_gc_us"]
                print(f"[{context} r{r}] {row['cache']:20} p50 {row['p50_us']:8.0f} us  mean-all "
                      f"{row['mean_all_us']:8.0f}  step ratio {row.get('step_ratio', 1):.3f}  ratio {row.get('p50_ratio', 1):.3f} / "
                      f"{row.get('mean_all_ratio', 1):.3f}", flush=True)
            result["rows"] += rows
            result.setdefault("steps_us", {})[f"{context}/{r}"] = {
                v: dict(wall=[round(w, 1) for w in c.wall_us[1:]], compacted=c.compacted[1:],
                        gc=[round(g, 1) for g in c.gc_us[1:]])
                for v, c in zip(args.variants, clocks)}
        if args.cprofile:
            first = result["cprofile_first_step"]
            pys = [PythonProfile(first, args.cprofile) for _ in args.variants]
            caches = [VARIANTS[v](m, args) for v, m in zip(args.variants, copies)]
            lockstep_generate(copies, caches, prompt, first + args.cprofile + 1, kwarg, pys)
            del caches
            result.setdefault("python_profiles", {})[str(context)] = {v: p.per_step() for v, p in zip(args.variants, pys)}
        if args.profile and context == args.contexts[0]:
            first = 8  # plain steps: the prefill compacted, the next compaction is compress_every steps away
            profiles = {v: op_profile(m, VARIANTS[v](m, args), prompt, kwarg, first, args.profile)
                        for v, m in zip(args.variants, copies)}
            result["profiles"] = {str(context): profiles}
            result["op_table"] = op_table(profiles)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(result)
    if "op_table" in result:
        text += f"\n## Per-step ATen ops at {args.contexts[0]} (torch.profiler, {args.profile} plain steps)\n\n"
        text += result["op_table"]
    for context, profiles in result.get("python_profiles", {}).items():
        text += (f"\n## Python functions per decode step at {context} (cProfile, {args.cprofile} steps from step "
                 f"{result['cprofile_first_step']}; cProfile inflates each call)\n\n")
        text += python_table(profiles)
    write_results(out, "lockstep_decode", result, text)
    return result


if __name__ == "__main__":
    main()
