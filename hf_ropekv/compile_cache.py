"""Ship the compiled decode step: save torch's compile artifacts after a warm run, load them on a fresh machine.

A ``RopeKVCache(static=True)`` inside ``generate()`` compiles its decode step once per process (batch size, budget
and model shape fixed); on an H200 the first compile of a Qwen3-8B-shaped step took 40-80 s. Torch keeps what it
compiled in on-disk caches, so a second process on the same machine starts much faster. A fresh machine (a new
Colab runtime, a container) starts with empty caches; this module packs the artifacts of a warm process into one
file that such a machine can load before its first ``generate()``:

    # after a warm run (generate() with the static cache has compiled its step in this process)
    hf_ropekv.save_compile_artifacts("qwen3_b1_2048.ropekv-compile", model=model, cache=cache)
    # on the fresh machine, before the first generate()
    hf_ropekv.load_compile_artifacts("qwen3_b1_2048.ropekv-compile")

Where torch keeps its caches (torch 2.11; the environment variables are read when torch compiles, so set them
before the first compile):

- ``TORCHINDUCTOR_CACHE_DIR``: inductor's root, default ``/tmp/torchinductor_<user>``. It holds the FX graph
  cache (``fxgraph/``: compiled graphs, keyed by the graph, the inputs' shapes and strides, the torch version and
  the inductor config), the AOTAutograd cache (``aotautograd/``), generated Python and C++ code and autotuning
  results. ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE=0`` turn the two caches off.
- ``TRITON_CACHE_DIR``: compiled Triton kernels, default ``<TORCHINDUCTOR_CACHE_DIR>/triton`` when inductor
  compiles them (Triton's own default, for kernels compiled outside inductor: ``~/.triton/cache``).
- Dynamo's tracing is never cached: a fresh process traces the model again (seconds); what the caches save is
  inductor's lowering, code generation, kernel compilation and autotuning (most of a cold compile).

:func:`save_compile_artifacts` wraps ``torch.compiler.save_cache_artifacts()`` (the "mega-cache": every
artifact this process compiled or read from the caches above, Triton kernels bundled with their graphs) and
writes one file: a header naming the versions and device it was made with, then the artifact bytes.
:func:`load_compile_artifacts` checks the header against the running process (torch, Triton, transformers and
hf_ropekv versions, device name and compute capability, file integrity) and only then hands the bytes to
``torch.compiler.load_cache_artifacts``, which writes them into the caches above; the next compile finds them
there. Artifacts of other versions or another GPU would be ignored by torch at best (their cache keys differ)
and are at worst unusable kernels, so a mismatch is a warning and nothing is loaded (``strict=True``: an
error). :func:`read_compile_artifacts` reads only the header.

What the header records about the model (shape, dtype, budget, batch size) is for people and for
``load_compile_artifacts(..., model=, cache=)`` warnings; torch keys its caches by the graphs themselves, so
artifacts of another shape simply miss.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from .warnings import warn

__all__ = [
    "CompileArtifactsInfo",
    "CompileArtifactsMismatchError",
    "load_compile_artifacts",
    "read_compile_artifacts",
    "save_compile_artifacts",
]

#: The first bytes of every file :func:`save_compile_artifacts` writes.
MAGIC = b"HF_ROPEKV_COMPILE_ARTIFACTS\n"
#: The layout of the file: ``MAGIC``, the header's length (8 bytes, little-endian), the header (UTF-8 JSON), the
#: artifact bytes. Raised when the layout changes; older layouts are refused with a clear error.
FORMAT_VERSION = 1
_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 1 << 20

#: Header fields that must equal the running process's for the artifacts to be loaded.
CHECKED_FIELDS = ("torch", "triton", "transformers", "hf_ropekv", "device_name", "device_capability")


class CompileArtifactsMismatchError(RuntimeError):
    """``load_compile_artifacts(strict=True)``: the file was made with other versions or another device."""


@dataclass(frozen=True)
class CompileArtifactsInfo:
    """The header of a compile-artifacts file: what made it, and what it holds.

    Attributes:
        path: the file read (empty for a header not read from a file).
        format_version: the file layout (:data:`FORMAT_VERSION`).
        created: when it was written (UTC, ISO 8601).
        torch, triton, transformers, hf_ropekv: the versions of the process that compiled (``None``: not installed).
        python: the Python version (informational: not checked).
        device_name: ``torch.cuda.get_device_name`` of the device compiled for, or ``"cpu"``.
        device_capability: CUDA compute capability (``"9.0"``), ``None`` on the CPU.
        cuda: ``torch.version.cuda`` (informational: it is part of the torch version string).
        model: what the saver said about the model and cache (``model_type``, layers, heads, ``dtype``, ``budget``,
            ``batch_size``, ...); informational, see the module docstring.
        artifact_bytes: size of the artifact payload.
        sha256: hex digest of the payload, checked on load.
        artifacts: count of artifacts per kind (``inductor``, ``aot_autograd``, ``autotune``, ``pgo``, ...).
    """

    path: str
    format_version: int
    created: str
    torch: str
    triton: str | None
    transformers: str | None
    hf_ropekv: str
    python: str
    device_name: str
    device_capability: str | None
    cuda: str | None
    model: dict[str, Any] = field(default_factory=dict)
    artifact_bytes: int = 0
    sha256: str = ""
    artifacts: dict[str, int] = field(default_factory=dict)

    def mismatches(self, running: Mapping[str, Any] | None = None) -> list[str]:
        """``"field: file has X, running Y"`` for every :data:`CHECKED_FIELDS` entry that differs from ``running``
        (default: this process, see :func:`running_environment`)."""
        running = running_environment() if running is None else running
        out = []
        for name in CHECKED_FIELDS:
            theirs, ours = getattr(self, name), running.get(name)
            if theirs != ours:
                out.append(f"{name}: file has {theirs!r}, running {ours!r}")
        return out


# ---------------------------------------------------------------------------------------------- environment
def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_fields(device: torch.device | str | None) -> dict[str, Any]:
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return {"device_name": device.type, "device_capability": None}
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {"device_name": torch.cuda.get_device_name(index), "device_capability": f"{major}.{minor}"}


def running_environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """The versions and device of this process, as a header records them (``device``: default the current CUDA
    device when there is one, else the CPU)."""
    import transformers

    from . import __version__

    triton = _version("triton")
    if triton is None:
        triton = _version("pytorch-triton")  # torch's nightly wheels ship Triton under this name
    return {
        "torch": torch.__version__,
        "triton": triton,
        "transformers": transformers.__version__,
        "hf_ropekv": __version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        **_device_fields(device),
    }


def _describe(model: Any, cache: Any, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """What identifies the compiled step: the model's shape and dtype, the cache's budget and batch size."""
    out: dict[str, Any] = {}
    if model is not None:
        config = getattr(model, "config", model)
        for name in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size"):
            value = getattr(config, name, None)
            if value is not None:
                out[name] = value
        dtype = getattr(model, "dtype", None)
        if isinstance(dtype, torch.dtype):
            out["dtype"] = str(dtype).removeprefix("torch.")
    if cache is not None:
        for name in ("budget", "compress_every", "page_size", "static", "batch_size"):
            value = getattr(cache, name, None)
            if value is not None:
                out[name] = value
    if extra:
        out.update({str(k): v for k, v in extra.items()})
    return json.loads(json.dumps(out, default=str))  # plain JSON values only


# ---------------------------------------------------------------------------------------------- save
def save_compile_artifacts(
    path: str | os.PathLike,
    *,
    model: Any = None,
    cache: Any = None,
    extra: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> CompileArtifactsInfo:
    """Write every compile artifact of this process (``torch.compiler.save_cache_artifacts()``) to ``path``.

    Call it after a warm run: once ``generate()`` has compiled the decode step (a few tokens are enough). The
    file holds a header (versions, device, and what ``model``, ``cache`` and ``extra`` say about the workload)
    and the artifacts; :func:`load_compile_artifacts` loads it on another machine of the same kind.

    Args:
        path: the file to write (replaced if it exists; written to a temporary name first).
        model: the model (or its config): its shape and dtype go into the header.
        cache: the cache used: its budget, ``compress_every``, page size and batch size go into the header.
        extra: more JSON-able facts for the header (e.g. ``{"context": 4096}``).
        device: the device the step was compiled for; default the current CUDA device, else the CPU.

    Returns:
        The header written.

    Raises:
        RuntimeError: nothing was compiled (or read from torch's caches) in this process.
    """
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise RuntimeError(
            "save_compile_artifacts: this process has no compile artifacts to save. Run the compiled step first "
            "(e.g. a generate() of a few tokens with RopeKVCache(model, budget=..., static=True) on CUDA), then save."
        )
    payload, cache_info = saved
    header = {
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **running_environment(device),
        "model": _describe(model, cache, extra),
        "artifact_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "artifacts": {kind: len(keys) for kind, keys in getattr(cache_info, "artifacts", {}).items() if keys},
    }
    encoded = json.dumps(header, indent=1, sort_keys=True).encode("utf-8")
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(MAGIC)
        f.write(_LENGTH.pack(len(encoded)))
        f.write(encoded)
        f.write(payload)
    os.replace(temporary, path)
    return _info(header, path)


# ---------------------------------------------------------------------------------------------- read
def _info(header: Mapping[str, Any], path: Path) -> CompileArtifactsInfo:
    names = {f.name for f in dataclasses.fields(CompileArtifactsInfo)} - {"path"}
    missing = {"format_version", "torch", "hf_ropekv", "device_name", "sha256"} - set(header)
    if missing:
        raise ValueError(f"{path}: the compile-artifacts header lacks {sorted(missing)}; the file is damaged.")
    values = {name: header.get(name) for name in names}
    values["model"] = dict(header.get("model") or {})
    values["artifacts"] = dict(header.get("artifacts") or {})
    values["artifact_bytes"] = int(header.get("artifact_bytes") or 0)
    values["created"] = str(header.get("created") or "")
    values["python"] = str(header.get("python") or "")
    return CompileArtifactsInfo(path=str(path), **values)


def _read(path: str | os.PathLike, with_payload: bool) -> tuple[CompileArtifactsInfo, bytes | None]:
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            raise ValueError(
                f"{path} is not an hf_ropekv compile-artifacts file (it does not start with {MAGIC!r}). Write one "
                "with hf_ropekv.save_compile_artifacts; raw torch.compiler.save_cache_artifacts() bytes go to "
                "torch.compiler.load_cache_artifacts directly."
            )
        raw_length = f.read(_LENGTH.size)
        length = _LENGTH.unpack(raw_length)[0] if len(raw_length) == _LENGTH.size else -1
        if not 0 < length <= _MAX_HEADER:
            raise ValueError(f"{path}: the compile-artifacts header is truncated or damaged.")
        raw_header = f.read(length)
        try:
            header = json.loads(raw_header.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{path}: the compile-artifacts header is not readable ({err}); the file is damaged."
            ) from err
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the compile-artifacts header is not a JSON object; the file is damaged.")
        if header.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path} has compile-artifacts format {header.get('format_version')!r}; this hf_ropekv reads format "
                f"{FORMAT_VERSION}. Save the artifacts again with this version."
            )
        info = _info(header, path)
        if not with_payload:
            return info, None
        payload = f.read()
    if len(payload) != info.artifact_bytes or hashlib.sha256(payload).hexdigest() != info.sha256:
        raise ValueError(
            f"{path}: the artifact bytes do not match the header's size and checksum ({len(payload)} bytes read, "
            f"{info.artifact_bytes} recorded); the file is truncated or damaged."
        )
    return info, payload


def read_compile_artifacts(path: str | os.PathLike) -> CompileArtifactsInfo:
    """The header of a file written by :func:`save_compile_artifacts`, without reading or loading the artifacts.

    Raises:
        ValueError: not such a file, or its header is damaged or of another format version.
    """
    return _read(path, with_payload=False)[0]


# ---------------------------------------------------------------------------------------------- load
def load_compile_artifacts(
    path: str | os.PathLike,
    strict: bool = False,
    *,
    model: Any = None,
    cache: Any = None,
    device: torch.device | str | None = None,
) -> CompileArtifactsInfo | None:
    """Load the artifacts of ``path`` into torch's compile caches, if they were made for this environment.

    Call it before the first compile (before ``generate()`` with a static cache); the compile then finds the
    graphs and kernels in the caches instead of building them (the counters
    ``torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]`` and ``["aot_autograd"]["autograd_cache_hit"]``
    say so). Dynamo still traces the model.

    The header's torch, Triton, transformers and hf_ropekv versions and device name and compute capability must
    equal this process's (:data:`CHECKED_FIELDS`). On a mismatch nothing is loaded: a warning
    (:class:`~hf_ropekv.HfRopeKVWarning`) names every field that differs and ``None`` is returned, so a cold compile
    follows; with ``strict=True`` a :class:`CompileArtifactsMismatchError` is raised instead. If ``model`` or
    ``cache`` are given and differ from what the header records about the workload (shape, dtype, budget, batch
    size), the artifacts are still loaded (they are harmless) with a warning that they will probably not be used.

    Args:
        path: a file from :func:`save_compile_artifacts`.
        strict: raise instead of warning when versions or device differ.
        model, cache: the workload about to run, compared with the header's description (see above).
        device: the device to compare with; default the current CUDA device, else the CPU.

    Returns:
        The file's header (its ``artifacts`` counts what torch loaded), or ``None`` when nothing was loaded.

    Raises:
        ValueError: not a compile-artifacts file, or a damaged one (header, size or checksum); also when not strict.
        CompileArtifactsMismatchError: ``strict=True`` and versions or device differ.
    """
    info, payload = _read(path, with_payload=True)
    problems = info.mismatches(running_environment(device))
    if problems:
        message = (
            f"Compile artifacts {path} were made for another environment ({'; '.join(problems)}). torch would not "
            "reuse them here; save new ones from a warm run in this environment."
        )
        if strict:
            raise CompileArtifactsMismatchError(message)
        warn(message + " Nothing was loaded: the first generate() compiles from scratch.")
        return None
    if model is not None or cache is not None:
        ours = _describe(model, cache, None)
        differ = [f"{k}: file has {info.model[k]!r}, here {v!r}" for k, v in ours.items()
                  if k in info.model and info.model[k] != v]
        if differ:
            warn(f"Compile artifacts {path} were compiled for another workload ({'; '.join(differ)}); loaded, but "
                 "the compiled step will probably not find them (torch's cache keys include the shapes).")
    torch.compiler.load_cache_artifacts(payload)
    return info
