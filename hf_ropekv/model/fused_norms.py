"""The model's RMSNorms in one kernel each (``hf_ropekv.kernels.rms_norm``), in the forwards of a cache whose
numbers already left ``DynamicCache``'s.

An eager RMSNorm is eight small kernels; a replayed decode step of Qwen3-8B runs 145 norms, about half of the
step's 2,300 kernels, each costing more launch than work. Only modules whose class computes transformers' Llama
RMSNorm are taken (its ``forward``'s source, which 140 families share word for word); each gets an instance
``forward`` that runs the one kernel while ``gate()`` is open and the class's own forward otherwise. The gate
(``SharedHooks``) opens for a forward of a cache that compacted or stores int8, where attention already runs
hf_ropekv's decode kernel: a cache that evicted nothing keeps ``DynamicCache``'s numbers bit for bit. Under
``torch.compile`` the class's forward runs (inductor fuses it by itself). A copy of the model (deepcopy, pickle)
gets pass-throughs to the class's forward instead.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import weakref
from typing import Callable

import torch
from torch import nn

from ..kernels import HAS_TRITON
from ..kernels.rms_norm import MAX_NORM_DIM, rms_norm

#: The body of transformers' ``LlamaRMSNorm.forward`` (its signature's annotations vary between families).
_LLAMA_RMS_NORM = """\
input_dtype = hidden_states.dtype
hidden_states = hidden_states.to(torch.float32)
variance = hidden_states.pow(2).mean(-1, keepdim=True)
hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
return self.weight * hidden_states.to(input_dtype)"""


@functools.cache  # by class: reading a forward's source costs milliseconds, and every cache attaches anew
def _computes_llama_rms_norm(cls: type) -> bool:
    try:
        lines = textwrap.dedent(inspect.getsource(cls.forward)).strip().splitlines()
    except (OSError, TypeError):
        return False
    body = "\n".join(line.strip() for line in lines[1:] if line.strip() and not line.strip().startswith("#"))
    return lines[0].startswith("def forward(self, hidden_states") and body == _LLAMA_RMS_NORM


def runs_the_kernel(tensor: torch.Tensor) -> bool:
    """Whether a norm of ``tensor`` may run the kernel: on CUDA (the interpreter would be far slower than eager)."""
    return tensor.is_cuda


def fusable_norms(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose class computes transformers' Llama RMSNorm over a row the kernel holds."""
    found = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if _computes_llama_rms_norm(type(module)) and isinstance(weight, torch.Tensor) and weight.dim() == 1 \
                and weight.numel() <= MAX_NORM_DIM and isinstance(getattr(module, "variance_epsilon", None), float):
            found.append(module)
    return found


class FusedNorms:
    """The one-kernel forwards of a model's RMSNorms, open while ``gate()`` returns True (see the module)."""

    @classmethod
    def of(cls, model: nn.Module, gate: Callable[[], bool]) -> "FusedNorms | None":
        """Attached fused norms of ``model``; None where no parameter is where the kernel runs, or without Triton."""
        if not HAS_TRITON or not any(runs_the_kernel(p) for p in model.parameters()):
            return None
        return cls(model, gate).attach()

    def __init__(self, model: nn.Module, gate: Callable[[], bool]) -> None:
        self._modules = [weakref.ref(m) for m in fusable_norms(model)]
        self._gate = gate

    def attach(self) -> "FusedNorms":
        for ref in self._modules:
            module = ref()
            if module is not None and "forward" not in vars(module):  # leave another library's forward in place
                module.forward = _NormForward(ref, self._gate)
        return self

    def detach(self) -> None:
        for ref in self._modules:
            module = ref()
            if module is not None and isinstance(vars(module).get("forward"), _NormForward):
                del module.forward


class _NormForward:
    """One norm's instance forward: the kernel while the gate is open on CUDA, the class's forward otherwise."""

    __slots__ = ("module_ref", "gate")

    def __init__(self, module_ref: "weakref.ref[nn.Module]", gate: Callable[[], bool]) -> None:
        self.module_ref, self.gate = module_ref, gate

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        module = self.module_ref()
        if not torch.compiler.is_compiling() and runs_the_kernel(hidden_states) and self.gate():
            return rms_norm(hidden_states, module.weight, module.variance_epsilon)
        return type(module).forward(module, hidden_states)

    def __reduce__(self) -> tuple:
        return _ClassForward, (self.module_ref(),)


class _ClassForward:
    """What a copied model's norm gets for a :class:`_NormForward`: its class's forward."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return type(self.module).forward(self.module, hidden_states)
