"""Where a decode step's time goes, inside ``model.generate``: host timers on the cache and on generate's calls,
per-step accounting against ``common.StepClock``'s stamps, and GPU kernel time from ``torch.profiler``.

Used by ``warmup.py``'s ``profile`` part. Nothing here changes what runs: the timers wrap bound methods of one
model or cache instance (``HostTimers.wrap``, undone by ``restore``) and only read ``time.perf_counter``.

What is timed, for a ``RopeKVCache``:

- ``cache.prepare``: ``RopeKVCache._forward_starts``, every decision of a forward taken on the host before it
  runs (with ``static=True``: the plan, the compaction when one is due, the arena's write slot and slot mask);
- ``cache.compact``: the compactor's ``compact`` (inside ``cache.prepare``; host time: kernels run async);
- ``cache.hooks``: the model attachment's pre-forward, post-forward (query statistics) and end-of-forward hooks;
- for a cache whose ``update`` runs eagerly (DynamicCache, eager RopeKVCache): ``cache.update``.

And for generate: ``generate.prepare_inputs`` (``prepare_inputs_for_generation``, which holds ``cache.prepare`` for
a static cache) and ``generate.forward_call`` (the compiled forward ``get_compiled_call`` returned, or the eager
``model.__call__`` via forward hooks, which hold ``cache.hooks``). The rest of a step's wall time is generate's
own loop: logits processing, the next-token bookkeeping and its stopping check (where it waits for the GPU).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from common import StepClock

#: hf_ropekv's mark on the generate methods it wraps (``hooks.generate_methods._WRAPPED_MARK``): copied onto a timer
#: that wraps one of them, so that the next cache does not wrap the timer again.
_HF_ROPEKV_MARK = "_hf_ropekv_continuation_check"


class HostTimers:
    """Accumulated host seconds and calls per name, of the bound methods wrapped with :meth:`wrap`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        totals, calls = self.totals, self.calls

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t0
                calls[name] += 1

        if getattr(fn, _HF_ROPEKV_MARK, False):
            setattr(timed_call, _HF_ROPEKV_MARK, True)
        return timed_call

    def wrap(self, owner: Any, attr: str, name: str, *, returns_callable: bool = False) -> None:
        """Time ``owner.attr`` (an instance attribute set over the bound method; undone by :meth:`restore`).

        ``returns_callable``: time the callable it returns instead (``get_compiled_call``)."""
        had = attr in vars(owner)
        previous = vars(owner).get(attr)
        original = getattr(owner, attr)
        if returns_callable:
            def factory(*args: Any, **kwargs: Any) -> Any:
                return self.timed(name, original(*args, **kwargs))

            if getattr(original, _HF_ROPEKV_MARK, False):
                setattr(factory, _HF_ROPEKV_MARK, True)
            setattr(owner, attr, factory)
        else:
            setattr(owner, attr, self.timed(name, original))

        def undo() -> None:
            if had:
                setattr(owner, attr, previous)
            else:
                delattr(owner, attr)

        self._undo.append(undo)

    def time_module_calls(self, module: nn.Module, name: str) -> None:
        """Time every eager call of ``module`` (first pre-hook to last hook), e.g. the uncompiled forward."""
        started: list[float] = []

        def pre(*_: Any) -> None:
            started.append(time.perf_counter())

        def post(*_: Any) -> None:
            if started:
                self.totals[name] += time.perf_counter() - started.pop()
                self.calls[name] += 1

        handles = [module.register_forward_pre_hook(pre, prepend=True),
                   module.register_forward_hook(post, always_call=True)]
        self._undo.append(lambda: [h.remove() for h in handles])

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


def instrument_cache(timers: HostTimers, cache: Any, *, eager_update: bool) -> None:
    """Time a cache's host work (see the module docstring); ``eager_update``: its ``update`` runs eagerly (never
    wrap the update of a cache whose step is compiled: it runs inside the graph)."""
    if hasattr(cache, "_forward_starts"):
        timers.wrap(cache, "_forward_starts", "cache.prepare")
        compactor = getattr(getattr(cache, "coordinator", None), "compactor", None)
        if compactor is not None:
            timers.wrap(compactor, "compact", "cache.compact")
        attachment = getattr(cache, "_attachment", None)
        if attachment is not None:
            for attr in ("_pre_forward", "_post_forward", "_forward_ends"):
                timers.wrap(attachment, attr, "cache.hooks")
    if eager_update:
        timers.wrap(cache, "update", "cache.update")


def instrument_generate(timers: HostTimers, model: nn.Module, *, compiled: bool) -> None:
    """Time generate's ``prepare_inputs_for_generation`` and its forward call (compiled or eager)."""
    timers.wrap(model, "prepare_inputs_for_generation", "generate.prepare_inputs")
    if compiled:
        timers.wrap(model, "get_compiled_call", "generate.forward_call", returns_callable=True)
    else:
        timers.time_module_calls(model, "generate.forward_call")


class TimedClock(StepClock):
    """A ``StepClock`` that also snapshots ``timers`` at every stamp, so each step gets its share of each timer."""

    def __init__(self, timers: HostTimers) -> None:
        super().__init__()
        self.timers = timers
        self.snapshots: list[dict[str, float]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.snapshots.append(self.timers.snapshot())
        return super().__call__(input_ids, scores)

    def steps(self) -> list[dict[str, float]]:
        """Per decode step (gap between successive logits): ``wall_ms`` and each timer's ms within it."""
        out = []
        for i in range(1, len(self.stamps)):
            before, after = self.snapshots[i - 1], self.snapshots[i]
            step = {"wall_ms": 1e3 * (self.stamps[i] - self.stamps[i - 1])}
            for name, total in after.items():
                step[name] = 1e3 * (total - before.get(name, 0.0))
            out.append(step)
        return out


def host_split(step: dict[str, float]) -> dict[str, float]:
    """One step's wall time split: the cache's host work, transformers' input preparation and forward call (the
    cache's parts taken out) and the rest of generate's loop (which includes waiting for the GPU)."""
    cache = step.get("cache.prepare", 0.0) + step.get("cache.hooks", 0.0) + step.get("cache.update", 0.0)
    prepare = step.get("generate.prepare_inputs", 0.0) - step.get("cache.prepare", 0.0)
    forward = step.get("generate.forward_call", 0.0) - step.get("cache.hooks", 0.0) - step.get("cache.update", 0.0)
    wall = step["wall_ms"]
    return {
        "wall_ms": wall,
        "cache_ms": cache,
        "compact_ms": step.get("cache.compact", 0.0),
        "transformers_prepare_ms": max(0.0, prepare),
        "forward_call_ms": max(0.0, forward),
        "generate_loop_ms": wall - cache - max(0.0, prepare) - max(0.0, forward),
        "cache_share": cache / wall if wall > 0 else 0.0,
    }


class ProfilingClock(StepClock):
    """A ``StepClock`` that runs ``torch.profiler`` over decode steps ``[start, start + steps)`` of one generate,
    after the compile of the first step: the GPU kernels those steps launched, without the prefill's."""

    def __init__(self, device: torch.device, start: int, steps: int) -> None:
        super().__init__()
        self.device, self.start, self.steps = device, start, steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.window: tuple[float, float] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        index = len(self.stamps)  # 0: the prefill's logits; i: after decode step i
        if index == self.start + self.steps:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.profiler.stop()
            self.window = (self.window[0], time.perf_counter()) if self.window else None
        out = super().__call__(input_ids, scores)
        if index == self.start:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.window = (time.perf_counter(), 0.0)
            self.profiler.start()
        return out

    def kernel_summary(self) -> dict[str, Any]:
        """GPU kernel time over the profiled steps: the sum of kernel durations and the time at least one ran
        (their union), per step; ``None`` values on the CPU."""
        if self.window is None or self.window[1] == 0.0:
            return {"profiled_steps": 0, "error": "the profiled window did not close (too few steps)"}
        wall_ms = 1e3 * (self.window[1] - self.window[0])
        result: dict[str, Any] = {"profiled_steps": self.steps, "profiled_wall_ms_per_step": wall_ms / self.steps,
                                  "kernel_ms_per_step": None, "gpu_busy_ms_per_step": None, "kernels_per_step": None}
        if self.device.type != "cuda":
            return result
        intervals = []
        by_kind: dict[str, list[float]] = {}
        for event in self.profiler.events():
            if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
                intervals.append((event.time_range.start, event.time_range.end))
                entry = by_kind.setdefault(kernel_kind(event.name), [0.0, 0])
                entry[0] += event.time_range.end - event.time_range.start
                entry[1] += 1
        total = sum(end - start for start, end in intervals)
        busy, current_end = 0.0, None
        current_start = None
        for start, end in sorted(intervals):
            if current_end is None or start > current_end:
                if current_end is not None:
                    busy += current_end - current_start
                current_start, current_end = start, end
            else:
                current_end = max(current_end, end)
        if current_end is not None:
            busy += current_end - current_start
        result.update(kernel_ms_per_step=total / 1e3 / self.steps, gpu_busy_ms_per_step=busy / 1e3 / self.steps,
                      kernels_per_step=len(intervals) / self.steps,
                      kernel_kinds=sorted(({"kind": kind, "ms_per_step": us / 1e3 / self.steps,
                                            "per_step": count / self.steps} for kind, (us, count) in by_kind.items()),
                                          key=lambda row: -row["ms_per_step"]))
        return result


#: Kernel-name fragments to kinds, first match wins: what a decode step's GPU time is spent on.
KERNEL_KINDS = (
    ("fmha", "attention (sdpa)"), ("flash", "attention (sdpa)"), ("attention", "attention (sdpa)"),
    ("nvjet", "matmul (GEMV / GEMM)"), ("gemv", "matmul (GEMV / GEMM)"), ("gemm", "matmul (GEMV / GEMM)"), ("sm90_xmma", "matmul (GEMV / GEMM)"),
    ("cutlass", "matmul (GEMV / GEMM)"), ("cublas", "matmul (GEMV / GEMM)"), ("splitk", "matmul (GEMV / GEMM)"),
    ("triton_red", "inductor reductions (norms, softmax)"), ("triton_per", "inductor reductions (norms, softmax)"),
    ("triton_poi", "inductor pointwise (rope, activations, copies)"), ("_score", "hf_ropekv scoring"),
    ("memcpy", "copies"), ("memset", "copies"), ("copy", "copies"), ("elementwise", "eager pointwise"),
    ("reduce", "eager reductions"),
)


def kernel_kind(name: str) -> str:
    """A coarse kind for a CUDA kernel's name (``KERNEL_KINDS``); unknown names keep their first 60 characters."""
    lowered = name.lower()
    for fragment, kind in KERNEL_KINDS:
        if fragment in lowered:
            return kind
    return name[:60]
