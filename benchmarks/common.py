"""What the four benchmark entry points share: importing hf_ropekv from a checkout, run metadata and result
folders, timing, memory readings, and random-weight models of published shapes.

Nothing here knows about a particular measurement; ``memory.py``, ``speed.py``, ``perplexity.py`` and
``task_accuracy.py`` compose these pieces. Importing it also puts ``examples/`` on ``sys.path``, for
``offline_assets`` (the offline SmolLM2 / Qwen2.5-Coder models and Debian texts).
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
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

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
def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options every entry point takes: where to write, which commit, a CPU dry run, the sdpa backends."""
    p.add_argument("--out", default=None,
                   help="output folder (default: benchmarks/results/<name>_<date>_<device>/, see results_dir)")
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


RESULTS = REPO / "benchmarks" / "results"


def device_slug(device: torch.device) -> str:
    """A short folder-name word for the device: ``cpu``, or the GPU's model (``h200``, ``a100-sxm4-80gb``)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return "-".join(re.findall(r"[a-z0-9]+", name)) or "cuda"


def results_dir(name: str, out: str | None, device: torch.device) -> Path:
    """The run's output folder, created: ``out`` when given, else ``benchmarks/results/<name>_<date>_<device>/``."""
    if out is None:
        date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        out_dir = RESULTS / f"{name}_{date}_{device_slug(device)}"
    else:
        out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def write_run_readme(out_dir: Path, meta: dict[str, Any], script: str, title: str, summary: str = "") -> None:
    """``README.md`` of a run folder: what ran, on which commit and device, with which command, and its files.

    ``script`` is the entry point's file name (``speed.py``); ``meta["argv"]`` its arguments."""
    command = " ".join(["python", f"benchmarks/{script}"] + [shlex.quote(a) for a in meta.get("argv", [])])
    files = sorted(p.name for p in out_dir.iterdir() if p.name != "README.md")
    lines = [
        f"# {title}",
        "",
        f"- commit: `{meta['commit']}`",
        f"- device: {meta['device']}",
        f"- command: `{command}`",
        f"- date: {meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}",
        f"- files: {', '.join(f'`{f}`' for f in files)}",
    ]
    if summary:
        lines += ["", summary.strip()]
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")


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
def stock_sdpa(model: torch.nn.Module) -> None:
    """Give ``model`` transformers' own sdpa back: a static RopeKVCache switches an sdpa model to hf_ropekv's
    grouped-query sdpa (``hf_ropekv.model.attention``) for the model's lifetime, which other caches must not get."""
    from hf_ropekv.model.attention import GROUPED_SDPA

    if model.config._attn_implementation == GROUPED_SDPA:
        model.config._attn_implementation = "sdpa"


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



# ---------------------------------------------------------------------------------------------- model shapes
# Random-weight models of real shapes, built fast and without a CPU copy: the model is created on the ``meta``
# device, then each decoder layer is materialised on the target device, initialised (normal(0, 0.02) matrices and
# embeddings, ones for norms, zeros for biases) and, if asked, weight-quantized with optimum-quanto right away.
# The peak while building is the finished model plus one layer. Random weights are exact for speed and memory,
# not for quality.

# Shapes of the published configs (config.json of each model), written out: the GPU machine has no hub access.
_QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=False,
    use_sliding_window=False,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        _QWEN3_COMMON,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        _QWEN3_COMMON,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        tie_word_embeddings=False,
    ),
    # Qwen3-1.7B's shape; its real config ties the embeddings, untied here (same cache behaviour, simpler build).
    "qwen3-1.7b": dict(
        _QWEN3_COMMON,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=False,
    ),
    # Dry-run stand-ins: same architecture, tiny.
    "tiny": dict(
        _QWEN3_COMMON,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # Large enough for quanto's int4 group size (128) and its bf16 "tinygemm" kernels, like the 32B model.
    "tiny-int4": dict(
        _QWEN3_COMMON,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    ),
}


def make_config(shape: str):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3", **SHAPES[shape])


def shape_summary(config) -> dict[str, Any]:
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "q_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab": config.vocab_size,
    }


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Layers x (K and V) x KV heads x head_dim x element size: one token of a full cache, one row."""
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element


def _quanto_qtype(name: str):
    from optimum.quanto import qint4, qint8

    return {"int4": qint4, "int8": qint8}[name]


@torch.no_grad()
def _init_module_params(module: nn.Module, std: float, generator: torch.Generator) -> None:
    for name, param in module.named_parameters(recurse=False):
        if "norm" in name or (param.ndim == 1 and "bias" not in name):
            param.fill_(1.0)
        elif "bias" in name:
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)


@torch.no_grad()
def build_random_model(
    config,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantize: str | None = None,
    int4_grouping: str = "auto",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> nn.Module:
    """A random-weight ``AutoModelForCausalLM`` of ``config`` on ``device``, in eval mode, sdpa attention.

    Args:
        quantize: ``None``, ``"int8"`` or ``"int4"``: quantize every decoder layer's linears with optimum-quanto
            (``quantize`` + ``freeze``) as soon as it is built; the embeddings and ``lm_head`` stay in ``dtype``
            (transformers' ``QuantoConfig`` also leaves ``lm_head`` alone).
        int4_grouping: ``"auto"``: quanto's own choice (groups of 128 along the input features; with bf16 weights on
            a CUDA GPU of compute capability >= 8 or on CPU that selects its "tinygemm" kernels, torch's
            ``_weight_int4pack_mm``); ``"per-channel"``: one scale per output channel, which keeps quanto's generic
            int4 tensor (dequantize, then matmul): a fallback where tinygemm is not available.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    layers = model.get_decoder().layers
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    qtype = _quanto_qtype(quantize) if quantize else None
    if qtype is not None:
        from optimum.quanto import freeze
        from optimum.quanto import quantize as quanto_quantize

    for index, layer in enumerate(layers):
        layer.to_empty(device=device)
        for module in layer.modules():
            _init_module_params(module, std, generator)
        if qtype is not None:
            quanto_quantize(layer, weights=qtype)
            if int4_grouping == "per-channel":
                for module in layer.modules():
                    if hasattr(module, "weight_group_size"):
                        module.weight_group_size = None
            freeze(layer)
        if log and (index + 1) % max(1, len(layers) // 4) == 0:
            log(f"  built {index + 1}/{len(layers)} layers" + (f" ({quantize})" if quantize else ""))

    for module in model.modules():
        if id(module) in in_layers:
            continue
        metas = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)) if t.is_meta]
        if metas:
            module.to_empty(device=device, recurse=False)
            _init_module_params(module, std, generator)

    # Rotary embeddings hold computed (non-persistent) buffers: rebuild them on the device instead of leaving the
    # uninitialised memory to_empty gave them.
    for parent in model.modules():
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq") and hasattr(child, "rope_type"):
                with torch.device(device):
                    setattr(parent, child_name, type(child)(config=child.config))

    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftovers:
        raise RuntimeError(f"random model build left tensors on the meta device: {leftovers[:5]}")
    model.eval()
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (quantized tensors counted by their real storage)."""
    seen: set = set()
    return sum(tensor_bytes(t, seen) for t in list(model.parameters()) + list(model.buffers()))


def random_frequency_stats(model: nn.Module, seed: int = 0):
    """Query statistics of the right shape for ``model``, drawn at random.

    The weights are random, so statistics calibrated on text would mean nothing either; scoring costs the same.
    ``E|q_f| >= |E q_f|`` holds, as for real statistics.
    """
    from hf_ropekv import FrequencyStats
    from hf_ropekv.statistics import frequency_stats as stats_module
    from hf_ropekv.model.geometry import describe

    geometry = describe(model)
    gen = torch.Generator().manual_seed(seed)
    shape = (geometry.num_layers, geometry.num_q_heads, geometry.rotary_dim // 2)
    q_mean = torch.complex(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    q_abs = q_mean.abs() + torch.rand(shape, generator=gen)
    metadata = {
        **stats_module.geometry_metadata(geometry),
        "tokens": 0,
        "source": "random (benchmark: random-weight model)",
        "format_version": stats_module.FORMAT_VERSION,
    }
    return FrequencyStats(q_mean=q_mean, q_abs_mean=q_abs, metadata=metadata)
