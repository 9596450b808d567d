"""Shared plumbing of the benchmark suite: importing hf_ropekv from a checkout, run metadata, timing, memory.

Nothing here knows about a particular measurement; ``suite.py`` composes these pieces. Importing it also puts
``examples/`` on ``sys.path``, for ``offline_assets`` (the offline SmolLM2 / Qwen2.5-Coder models and Debian texts).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

# Every benchmark is offline and quiet: set before anything imports transformers (scripts import this module first).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# The offline model and text helpers (``import offline_assets``) live beside the examples, outside the library.
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))


# ---------------------------------------------------------------------------------------------- import
def import_hf_ropekv():
    """Import ``hf_ropekv``: the installed package if there is one, else this checkout.

    A checkout keeps the Triton kernels in the top-level ``kernels/`` folder, installed as ``hf_ropekv.kernels``.
    Without ``pip install -e .`` (e.g. on a machine that only has a copy of the work tree) this builds a symlink
    farm in a temporary folder, ``hf_ropekv/*`` plus ``hf_ropekv/kernels -> kernels/``, and imports from it.
    """
    try:
        import hf_ropekv  # noqa: F401
        import hf_ropekv.kernels.compact  # noqa: F401
        import hf_ropekv.cache.cache  # noqa: F401

        return sys.modules["hf_ropekv"]
    except ImportError:
        for name in [m for m in sys.modules if m == "hf_ropekv" or m.startswith("hf_ropekv.")]:
            del sys.modules[name]
    farm = Path(tempfile.mkdtemp(prefix="hf_ropekv_farm_"))
    pkg = farm / "hf_ropekv"
    pkg.mkdir()
    for entry in (REPO / "hf_ropekv").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "kernels").symlink_to(REPO / "kernels")
    sys.path.insert(0, str(farm))
    importlib.invalidate_caches()
    return importlib.import_module("hf_ropekv")


def offline_assets():
    """``examples/offline_assets.py``: the offline SmolLM2 / Qwen2.5-Coder models and Debian texts (not library API)."""
    return importlib.import_module("offline_assets")


# ---------------------------------------------------------------------------------------------- command line
def add_run_args(p: argparse.ArgumentParser, out_default: str | None = None) -> None:
    """The options every GPU script takes: where to write, which commit, a CPU dry run, the sdpa backends."""
    p.add_argument("--out", default=out_default, required=out_default is None, help="output folder")
    p.add_argument("--commit", default=None, help="git commit of the code (the GPU machine may have no .git)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU, or a small GPU): a code check")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="disable torch's cuDNN sdpa backend (flash runs instead): cuDNN plans every new K/V length "
                   "on the host, which dominates eager decode steps of a growing cache (benchmarks/README.md)")


def apply_run_args(args: argparse.Namespace) -> None:
    """Process-wide settings the options of ``add_run_args`` ask for; call before any model runs."""
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)


def run_device(args: argparse.Namespace) -> torch.device:
    """Where a script of ``add_run_args`` runs: CUDA when there is one, the CPU for a ``--dry-run``."""
    return torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")


# ---------------------------------------------------------------------------------------------- metadata
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no .git here: pass --commit)"


def sdpa_backends() -> list[str]:
    """The torch sdpa backends enabled in this process. On Hopper, torch 2.11 runs bf16 decode attention through
    cuDNN, which builds a plan on the host for every K/V length it has not seen (~1 ms per layer on the H200)."""
    flags = {
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
        "flash": torch.backends.cuda.flash_sdp_enabled,
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
        "math": torch.backends.cuda.math_sdp_enabled,
    }
    return [name for name, enabled in flags.items() if enabled()]


def run_header(meta: dict[str, Any], what: str) -> str:
    """The line under a report's title: when, where and with which code and versions it was measured."""
    return (
        f"{meta['date']} · {meta['device']} · commit `{meta['commit'][:12]}` · torch {meta['torch']} · "
        f"transformers {meta['transformers']} · {what}"
    )


def write_results(out_dir: Path, stem: str, result: dict[str, Any], markdown: str | None = None) -> None:
    """``stem.json`` (every number) into ``out_dir``; with ``markdown``, also ``stem.md``, printed as well."""
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    if markdown is not None:
        (out_dir / f"{stem}.md").write_text(markdown)
        print(markdown)


def run_metadata(device: torch.device, commit: str | None, argv: list[str]) -> dict[str, Any]:
    import transformers

    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(commit),
        "argv": argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": _version("triton"),
        "optimum_quanto": _version("optimum-quanto"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "sdpa_backends": sdpa_backends(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(
            device=torch.cuda.get_device_name(device),
            device_total_memory_gib=round(props.total_memory / 2**30, 2),
            device_capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            multiprocessors=props.multi_processor_count,
        )
    else:
        meta.update(device=f"CPU ({meta['cpu']}, {os.cpu_count()} cores)", device_total_memory_gib=None)
    return meta


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """Timestamped, flushed progress lines, and the ``--max-minutes`` guard."""

    def __init__(self, max_minutes: float | None) -> None:
        self.start = time.perf_counter()
        self.max_seconds = None if not max_minutes else 60.0 * max_minutes

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)

    def out_of_time(self) -> bool:
        return self.max_seconds is not None and self.elapsed() > self.max_seconds


# ---------------------------------------------------------------------------------------------- timing
class StepTimer:
    """Wall time of one call: CUDA events around it on a GPU (the stream is drained first), perf_counter on CPU.

    Two diagnostics of the last call are kept beside it, to say where a slow step went: ``last_host_ms``, the
    time until the call returned on the host (close to the wall time when launching kernels is the bottleneck),
    and ``last_device_allocs``, how many times the CUDA caching allocator had to call ``cudaMalloc`` (each one
    synchronises; a cache whose tensors change size every step pays it).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.last_host_ms: float | None = None
        self.last_device_allocs: int | None = None

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        if self.cuda:
            torch.cuda.synchronize()
            allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            result = fn()
            end.record()
            self.last_host_ms = 1e3 * (time.perf_counter() - t0)
            end.synchronize()
            self.last_device_allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs
            return result, float(start.elapsed_time(end))
        t0 = time.perf_counter()
        result = fn()
        self.last_host_ms = 1e3 * (time.perf_counter() - t0)
        return result, self.last_host_ms

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def gpu_kernels(events: list[Any]) -> list[Any]:
    """The GPU kernels (and copies) among a profile's ``events``: device events that are not the device-side
    ranges of annotations (``ProfilerStep#``, ``record_function`` labels, inductor's graph calls), which carry
    the name of a host event and span the kernels they enclose."""
    host_names = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in host_names]


# ---------------------------------------------------------------------------------------------- memory
MIB = 2**20
GIB = 2**30


class Memory:
    """Allocator readings (CUDA) with a simulated cap on CPU dry runs.

    On CPU there is no allocator to read, so ``allocated`` is ``None`` and the "cap" of a dry run is enforced
    on the bytes the caller reports (``check_cpu_cap``) by raising ``torch.OutOfMemoryError``: that exercises
    the same search and fallback code paths as a real out-of-memory on the GPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.cpu_cap_bytes: int | None = None

    def clean(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def reserved(self) -> int | None:
        return torch.cuda.memory_reserved(self.device) if self.cuda else None

    def peak_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def peak_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device) if self.cuda else None

    def total(self) -> int | None:
        return torch.cuda.get_device_properties(self.device).total_memory if self.cuda else None

    def set_cap(self, cap_bytes: int | None) -> float | None:
        """Cap this process's allocator at ``cap_bytes`` (``None``: lift the cap). Returns the fraction set."""
        if not self.cuda:
            self.cpu_cap_bytes = cap_bytes
            return None
        self.clean()
        fraction = 1.0 if cap_bytes is None else min(1.0, cap_bytes / self.total())
        # The allocator cap wants an indexed device ("cuda" alone is refused).
        index = torch.device(self.device).index
        torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device() if index is None else index)
        return fraction

    def check_cpu_cap(self, used_bytes: int) -> None:
        if not self.cuda and self.cpu_cap_bytes is not None and used_bytes > self.cpu_cap_bytes:
            raise torch.OutOfMemoryError(
                f"dry run: {used_bytes} bytes exceed the simulated cap of {self.cpu_cap_bytes} bytes"
            )


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def tensor_bytes(obj: Any, seen: set) -> int:
    """Bytes of the storages behind ``obj`` (a tensor, a tensor subclass such as quanto's, or a container)."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter and flatten is not None:
            names, _ = flatten()
            return sum(tensor_bytes(getattr(obj, name), seen) for name in names)
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), str(obj.device))
        if key in seen or storage.data_ptr() == 0:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(item, seen) for item in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(item, seen) for item in obj.values())
    return 0


def cache_tensor_bytes(cache: Any) -> int:
    """Bytes held by every tensor attribute of a cache's layers (and their storage objects), counted once each."""
    seen: set = set()
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) or isinstance(value, (list, tuple, dict)):
                total += tensor_bytes(value, seen)
            elif hasattr(value, "__dict__") and not callable(value) and value is not cache:
                # e.g. hf_ropekv's PagedKV storage object
                for inner in vars(value).values():
                    if isinstance(inner, torch.Tensor):
                        total += tensor_bytes(inner, seen)
    return total


# ---------------------------------------------------------------------------------------------- generate timing
class StepClock:
    """A logits processor that records the host time at which each step's logits arrive; changes nothing.

    ``generate`` calls it once for the prefill's logits (``stamps[0]``) and once per decode step after that, and
    synchronises with the device once per step (its stopping check), so the gaps between stamps are the steps.
    ``LogitsProcessorList`` accepts any callable of ``(input_ids, scores)``.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def run_generate(
    model: torch.nn.Module,
    cache: Any,
    prompt: torch.Tensor,
    new_tokens: int,
    kwarg: str,
    clock: StepClock | None = None,
    **generate_kwargs: Any,
) -> dict[str, Any]:
    """Greedy ``generate`` of exactly ``new_tokens`` from ``prompt`` (all-ones mask) with ``cache``, timed by steps.

    Returns the tokens generated, the wall time, the time to the first logits (prefill) and ``steps_ms``: the
    gaps between successive logits, one per decode step. Pass ``clock`` to see how far a failed call got.
    ``generate_kwargs`` go to ``generate`` (e.g. ``prefill_chunk_size``, ``compile_config``).
    """
    from transformers import LogitsProcessorList

    clock = StepClock() if clock is None else clock
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([clock]),
        **{kwarg: cache},
        **generate_kwargs,
    )
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    steps_ms = [1e3 * (b - a) for a, b in zip(clock.stamps, clock.stamps[1:])]  # decode steps only
    return dict(
        new_tokens=out.shape[1] - prompt.shape[1],
        total_s=total,
        prefill_and_first_ms=1e3 * (clock.stamps[0] - t0),
        steps_ms=steps_ms,
    )


# ---------------------------------------------------------------------------------------------- model calls
def forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any, kwarg: str) -> torch.Tensor:
    """One forward over ``input_ids`` with ``cache``; returns the next greedy token of every row, ``[B, 1]``."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
    return out.logits[:, -1:].argmax(-1)


def fmt_bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= GIB:
        return f"{value / GIB:.2f} GiB"
    return f"{value / MIB:.1f} MiB"


def padded_prompts(batch: int, longest: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts, row ``i`` shorter by ``i * longest / (2 * batch)`` tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (batch, longest), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        pad = row * longest // (2 * batch)
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids.to(device), mask.to(device)
