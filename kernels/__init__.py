"""Triton kernels of hf_ropekv, each next to its plain-PyTorch twin, shipped as ``hf_ropekv.kernels`` (relative
imports only). Triton is optional: without it the ``*_reference`` functions still work and dispatchers use them."""

if __name__ == "kernels":  # pragma: no cover - exercised in a subprocess by tests
    # Python started in the repository root sees this folder as a top-level ``kernels``, shadowing HuggingFace's
    # ``kernels`` (transformers >= 5.25 imports it). Load the real one in this module's place (the import returns
    # what ``sys.modules`` holds); without it, look like no install at all (a namespace package: no file).
    import importlib
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _saved, _this = sys.path[:], sys.modules.pop("kernels")
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    try:
        sys.modules["kernels"] = importlib.import_module("kernels")
    except ImportError:
        sys.modules["kernels"] = _this
        del __file__
    finally:
        sys.path[:] = _saved
else:
    from .compact import compact_, compact_reference_, compact_triton_
    from .score import HAS_TRITON, score_keys_reference, score_keys_triton

    __all__ = ["HAS_TRITON", "compact_", "compact_reference_", "compact_triton_", "score_keys_reference",
               "score_keys_triton"]
