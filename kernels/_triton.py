"""Triton, when installed: CPU-only installs run the plain-PyTorch references instead."""

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "tl", "triton"]
