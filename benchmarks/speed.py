#!/usr/bin/env python
"""Speed of decoding inside ``model.generate()``: DynamicCache eager, compiled StaticCache and the default
``RopeKVCache(model, budget)``, paired in one process at every point (the host drifts up to 2x between processes).

    python benchmarks/speed.py --points 1x4096,1x32768,32x4096 --commit SHA --max-minutes 8
    python benchmarks/speed.py --points none --e2e --commit SHA        # end to end in fresh processes only
    python benchmarks/speed.py --dry-run --out /tmp/speed.json         # a tiny random model on the CPU

The RopeKVCache is the library's default with ``protect_prompt=False`` (the prompts are longer than the budget).
A random-weight model of a published shape (Qwen3-8B by default, bf16 on CUDA; exact for speed), cuDNN's sdpa off
(it plans every new K/V length on the host). At each point (batch x prompt tokens) every cache is warmed up once
(compiles, graph recordings), then timed ``--repeats`` times in alternation: greedy ``generate()`` of
``--new-tokens`` tokens from random ids. A decode step is the gap between two successive logits, each stamped once
the device has computed it (the first decode step is left out; compaction steps count): p50 and p90; prefill = time
to the first logits. One more run per cache goes under ``torch.profiler`` for ``--profile-steps`` steps: GPU time
per step by kernel class (attention, matmul, other), GPU busy time, host time = step wall - GPU busy (the GPU
waiting for the host), and the kernels that took the most GPU time, one by one (``top_kernels``: what remains of a
step, kernel by kernel).

``--e2e``: a fresh process per cache (the order reversed every other round, ``--e2e-rounds``) runs one generation of
``--e2e-new-tokens`` tokens at ``--e2e-point``, timed from the cache's construction: time to first token and end to
end, what a user who starts Python waits for (the model build itself is left out: the same for every cache). An
untimed process per cache runs first, so the timed ones find bytecode and kernel caches as a second run does.

Writes one JSON: ``rows`` (point, cache, step and profile figures) and ``e2e``; after every cache and point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import common  # first: makes the run offline before transformers is imported
import policies
from report import speed_table

CACHES = {"dynamic": "DynamicCache eager", "static": "StaticCache compiled", "ropekv": "RopeKVCache default",
          "ropekv-int8": "RopeKVCache kv_bits=8", "quantized": "QuantizedCache (quanto int4)"}
#: The caches a run times by default; a run that times ``ropekv-int8`` is named ``speed_int8`` (its own table).
DEFAULT_CACHES = ("dynamic", "static", "ropekv")
ATTENTION = ("attention", "attn", "fmha", "flash", "sdpa", "softmax")
MATMUL = ("gemm", "gemv", "nvjet", "cutlass", "cublas", "xmma", "splitk", "matmul", "_mm")


def make_cache(name: str, model: torch.nn.Module, prompt_len: int, new_tokens: int, args: argparse.Namespace) -> Any:
    """A fresh cache; ``StaticCache`` sized for the run (its attention reads every slot it has)."""
    from transformers import DynamicCache, StaticCache

    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "static":  # generate compiles the decode step of a compileable cache by itself on CUDA
        return StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
    if name == "quantized":
        return policies.quanto_cache(model)
    return policies.make_cache(model, args.budget, "int8" if name == "ropekv-int8" else "default",
                               protect_prompt=False)


def random_prompt(model: torch.nn.Module, batch: int, length: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (batch, length), device=device, generator=gen)


def kernel_class(name: str) -> str:
    """attention, matmul or other, from a CUDA kernel's name."""
    lowered = name.lower()
    if any(k in lowered for k in ATTENTION):
        return "attention"
    return "matmul" if any(k in lowered for k in MATMUL) else "other"


#: Kernels per cache and point whose GPU time a result file lists one by one (the profile of what remains).
TOP_KERNELS = 30


class ProfilingClock(common.StepClock):
    """A step clock that runs ``torch.profiler`` over decode steps ``[start, start + steps)`` of one generate."""

    def __init__(self, device: torch.device, start: int, steps: int) -> None:
        super().__init__()
        self.device, self.start, self.steps = device, start, steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.window: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        index = len(self.stamps)  # 0: the prefill's logits; i: after decode step i
        scores = super().__call__(input_ids, scores)  # waits for the device, then stamps
        if index in (self.start, self.start + self.steps):
            self.window.append(self.stamps[-1])
            if index == self.start:
                self.profiler.start()
            else:
                self.profiler.stop()
        return scores

    def summary(self) -> dict[str, Any]:
        """Per step: GPU ms by kernel class, GPU busy ms (the union of kernel intervals), host ms (wall - busy),
        and the ``TOP_KERNELS`` kernels that took the most GPU time (name, class, launches and ms per step)."""
        wall = 1e3 * (self.window[1] - self.window[0]) / self.steps
        if self.device.type != "cuda":
            return {"gpu_ms": None, "gpu_busy_ms": None, "host_ms": wall, "kernels_per_step": None, "top_kernels": []}
        intervals, by_class = [], {"attention": 0.0, "matmul": 0.0, "other": 0.0}
        by_name: dict[str, list[float]] = {}
        for event in self.profiler.events():
            if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
                start, end = event.time_range.start, event.time_range.end
                intervals.append((start, end))
                by_class[kernel_class(event.name)] += end - start
                named = by_name.setdefault(event.name[:120], [0, 0.0])
                named[0], named[1] = named[0] + 1, named[1] + end - start
        busy, reached = 0.0, float("-inf")  # the union of the intervals: count only what passes the last end
        for start, end in sorted(intervals):
            busy += max(0.0, end - max(start, reached))
            reached = max(reached, end)
        busy_ms = busy / 1e3 / self.steps
        top = sorted(by_name.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
        return {"gpu_ms": {k: v / 1e3 / self.steps for k, v in by_class.items()}, "gpu_busy_ms": busy_ms,
                "host_ms": max(0.0, wall - busy_ms), "kernels_per_step": len(intervals) / self.steps,
                "top_kernels": [{"name": name, "class": kernel_class(name), "per_step": count / self.steps,
                                 "ms": total / 1e3 / self.steps} for name, (count, total) in top]}


def measure_point(model: torch.nn.Module, batch: int, length: int, args: argparse.Namespace,
                  device: torch.device, log: common.Clock) -> list[dict[str, Any]]:
    """Every cache at one point: warm-up, alternated timed runs, one profiled run."""
    prompt = random_prompt(model, batch, length, device)
    timed: dict[str, list[dict[str, Any]]] = {name: [] for name in args.caches}
    errors: dict[str, str] = {}
    for round_ in range(-1, args.repeats):  # round -1: the warm-up
        for name in args.caches if round_ % 2 else reversed(args.caches):
            if name in errors:
                continue
            try:
                cache = make_cache(name, model, length, args.new_tokens, args)
                run = common.run_generate(model, cache, prompt, args.new_tokens)
                if round_ >= 0:
                    timed[name].append(run)
            except Exception as err:  # noqa: BLE001 - one cache failing must not lose the others
                errors[name] = f"{type(err).__name__}: {str(err)[:300]}"
                log(f"  {name} failed: {errors[name]}")
    rows = []
    for name in args.caches:
        steps = [s for run in timed[name] for s in run["steps_ms"][1:]]
        row: dict[str, Any] = {"point": f"{batch}x{length}", "cache": name, "label": CACHES[name],
                               "error": errors.get(name)}
        if steps:
            row.update(decode_p50_ms=common.percentile(steps, 50), decode_p90_ms=common.percentile(steps, 90),
                       steps=len(steps), prefill_ms=common.percentile([r["first_logits_ms"] for r in timed[name]], 50))
            clock = ProfilingClock(device, start=2, steps=args.profile_steps)
            cache = make_cache(name, model, length, args.new_tokens, args)  # the timed runs' size: no recompile
            common.run_generate(model, cache, prompt, args.profile_steps + 3, clock)
            row.update(clock.summary())
            log(f"  {name}: p50 {row['decode_p50_ms']:.2f} ms, p90 {row['decode_p90_ms']:.2f} ms, "
                f"prefill {row['prefill_ms']:.0f} ms, host {row['host_ms']:.2f} ms/step")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- end to end
def e2e_child(args: argparse.Namespace) -> None:
    """One generation with one cache in this fresh process: construction to first token, and to the end."""
    device, dtype = run_device(args)
    model = common.build_random_model(args.shape, dtype=dtype, device=device)
    batch, length = parse_points(args.e2e_point)[0]
    prompt = random_prompt(model, batch, length, device)
    common.sync(device)
    t0 = time.perf_counter()
    cache = make_cache(args.child, model, length, args.e2e_new_tokens, args)
    run = common.run_generate(model, cache, prompt, args.e2e_new_tokens)
    total = time.perf_counter() - t0
    print("E2E " + json.dumps({"point": args.e2e_point, "cache": args.child, "label": CACHES[args.child],
                               "new_tokens": run["new_tokens"], "ttft_s": (total - run["total_s"])
                               + run["first_logits_ms"] / 1e3, "total_s": total,
                               "step_p50_ms": common.percentile(run["steps_ms"][1:], 50)}), flush=True)


def e2e(args: argparse.Namespace, log: common.Clock) -> list[dict[str, Any]]:
    """Each cache of ``--e2e-caches`` in a fresh process per round, the order reversed every other round.

    First one untimed process per cache generates a few tokens: it writes the Python bytecode (to a folder of its
    own: the GPU machine sets PYTHONDONTWRITEBYTECODE, which a pip install does not) and fills torch's and Triton's
    on-disk caches, so the timed processes start as a second run on the same machine does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="speed_pycache_")

    def child(name: str, *extra: str) -> dict[str, Any]:
        command = [sys.executable, __file__, "--child", name, *[a for a in args.argv if a != "--e2e"], *extra]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.e2e_timeout, env=env, check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("E2E ")), None)
        return json.loads(line[4:]) if line else {"point": args.e2e_point, "cache": name, "error": proc.stderr[-500:]}

    for name in args.e2e_caches:
        child(name, "--e2e-new-tokens", "8")
    out = []
    for round_ in range(args.e2e_rounds):
        for name in args.e2e_caches if round_ % 2 == 0 else reversed(args.e2e_caches):
            if log.out_of_time():
                return out
            out.append({**child(name), "round": round_})
            log(f"  e2e {name} round {round_}: {out[-1].get('total_s', 'failed')}")
    return out


# ---------------------------------------------------------------------------------------------- command line
def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1x4096,32x4096"`` -> ``[(1, 4096), (32, 4096)]``; ``"none"`` -> ``[]``."""
    if text.strip().lower() in ("", "none"):
        return []
    return [(int(b), int(n)) for b, n in (item.lower().split("x") for item in text.split(","))]


def run_device(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    cuda = torch.cuda.is_available() and not args.dry_run
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    return torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(common.SHAPES))
    p.add_argument("--points", default="1x4096,1x32768,32x4096", help="BATCHxPROMPT,... ('none': e2e only)")
    p.add_argument("--caches", default=",".join(DEFAULT_CACHES), help=f"from {','.join(CACHES)}")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per cache and point, alternated")
    p.add_argument("--profile-steps", type=int, default=32)
    p.add_argument("--e2e", action="store_true", help="also end to end, each cache in a fresh process")
    p.add_argument("--e2e-point", default="1x4096")
    p.add_argument("--e2e-caches", default="dynamic,ropekv")
    p.add_argument("--e2e-new-tokens", type=int, default=2000)
    p.add_argument("--e2e-rounds", type=int, default=1)
    p.add_argument("--e2e-timeout", type=float, default=300)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:  # tiny sizes; points given on the command line stay
        args.shape, args.budget, args.new_tokens, args.profile_steps = "tiny", 32, 12, 4
        args.e2e_point, args.e2e_new_tokens = "1x48", 16
        args.points = "1x48,2x64" if args.points == p.get_default("points") else args.points
    args.argv = argv
    args.caches = [c for c in args.caches.split(",") if c]
    args.e2e_caches = [c for c in args.e2e_caches.split(",") if c]
    unknown = set(args.caches + args.e2e_caches) - set(CACHES)
    if unknown:
        p.error(f"unknown caches {sorted(unknown)}; choose from {','.join(CACHES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        e2e_child(args)
        return 0
    device, dtype = run_device(args)
    log = common.Clock(args.max_minutes)
    name = "speed_int8" if "ropekv-int8" in args.caches else "speed"
    path = common.out_path(name, args.out, device)
    result = {**common.run_metadata(name, "speed.py", argv, device, args.commit), "rows": [], "e2e": [],
              "settings": {"shape": args.shape, "dtype": str(dtype), "budget": args.budget,
                           "new_tokens": args.new_tokens, "repeats": args.repeats, "cudnn_sdpa": False,
                           "protect_prompt": False, "e2e_new_tokens": args.e2e_new_tokens}, "not_run": []}
    model = common.build_random_model(args.shape, dtype=dtype, device=device)
    log(f"{args.shape} built on {device}")
    for batch, length in parse_points(args.points):
        if log.out_of_time():
            result["not_run"].append(f"{batch}x{length}")
            continue
        log(f"point {batch}x{length}")
        result["rows"] += measure_point(model, batch, length, args, device, log)
        common.write_json(path, result)
    if args.e2e:
        del model
        result["e2e"] = e2e(args, log)
    common.write_json(path, result)
    print(speed_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
