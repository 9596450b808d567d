"""Triton, when installed (CPU-only installs run the plain-PyTorch references instead), and the launchers' checks."""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

HAS_TRITON = triton is not None
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["FLOAT_DTYPES", "HAS_TRITON", "check_device", "interpreting", "tl", "triton"]


def interpreting() -> bool:
    """Whether Triton runs its kernels interpreted (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(name: str, tensor: torch.Tensor) -> None:
    """Raise ``RuntimeError`` unless the kernel ``name`` can run: Triton installed, ``tensor`` on its device."""
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs Triton, which is not installed (use its plain-PyTorch *_reference twin)")
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
