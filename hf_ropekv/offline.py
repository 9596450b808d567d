"""Deprecated alias of ``examples/offline_assets.py``; removed in version 0.2.

The offline model and text helpers (SmolLM2 / Qwen2.5-Coder from PyPI GGUF packages, Debian documentation
text) serve the examples, benchmarks and tests, not the cache, so they left the installed package. In a
checkout this module still re-exports them, warning once; put ``examples/`` on ``sys.path`` and
``import offline_assets`` instead. An installed wheel has no ``examples/`` folder: importing this module then
raises an ``ImportError`` that says where the helpers live.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

_NEW_MODULE = "offline_assets"
# hf_ropekv/offline.py -> <checkout>/examples/offline_assets.py (resolve(): benchmarks import through symlinks).
_NEW_PATH = Path(__file__).resolve().parents[1] / "examples" / f"{_NEW_MODULE}.py"


def _load() -> ModuleType:
    """The ``offline_assets`` module: the one already imported, else the checkout's file."""
    if _NEW_MODULE in sys.modules:
        return sys.modules[_NEW_MODULE]
    if not _NEW_PATH.is_file():
        raise ImportError(
            "hf_ropekv.offline moved out of the library: the offline model and text helpers are now "
            "examples/offline_assets.py in the hf_ropekv source repository (not in the installed package). "
            "Copy that file or work from a checkout, then `import offline_assets` with examples/ on sys.path."
        )
    spec = importlib.util.spec_from_file_location(_NEW_MODULE, _NEW_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NEW_MODULE] = module  # one module object, whichever name imports it first
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NEW_MODULE]
        raise
    return module


_assets = _load()
warnings.warn(
    "hf_ropekv.offline is deprecated and will be removed in version 0.2: the offline helpers moved to "
    "examples/offline_assets.py (put examples/ on sys.path and `import offline_assets`).",
    DeprecationWarning,
    stacklevel=2,  # the importing code: warnings skips importlib's own frames
)

__all__ = list(_assets.__all__)
globals().update({name: getattr(_assets, name) for name in __all__})


def __getattr__(name: str):
    """Every other attribute (constants, private helpers) from ``offline_assets`` as well."""
    try:
        return getattr(_assets, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
