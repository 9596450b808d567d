"""Triton kernels of hf_ropekv, each next to its plain-PyTorch twin.

Shipped as the package ``hf_ropekv.kernels``; only relative imports here.
Triton is optional: without it the ``*_reference`` functions still work and the
dispatchers fall back to them.
"""
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
