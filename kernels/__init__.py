"""Triton kernels of hf_ropekv, each next to its plain-PyTorch twin; shipped as the package ``hf_ropekv.kernels``.

Only relative imports here. Triton is optional: without it the ``*_reference`` functions still work and the
dispatchers fall back to them.
"""

if __name__ == "kernels":  # pragma: no cover - exercised in a subprocess by tests
    # Python or Jupyter started in the repository root sees this folder as a top-level ``kernels``, which shadows
    # HuggingFace's ``kernels`` package (transformers >= 5.25 imports it). Stand aside: load the real one in this
    # module's place (the import system returns what ``sys.modules`` holds once this code has run); without it, look
    # like what transformers takes for no install at all (a namespace package: no file, no version).
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

    __all__ = [
        "HAS_TRITON",
        "compact_",
        "compact_reference_",
        "compact_triton_",
        "score_keys_reference",
        "score_keys_triton",
    ]
