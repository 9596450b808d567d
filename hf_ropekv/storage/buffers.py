"""The device buffers a recorded decode step captures, handed from one static cache of a model to the next.

CUDA graphs replay at fixed addresses, so a model keeps the buffers (arenas, step clock, statistics) of a static cache
that is gone, and its next static cache of the same shapes takes them over: same addresses, the recorded graph
replays (at new addresses inductor's CUDA-graph trees record again at every step). A buffer belongs to one live cache
at a time (its :class:`BufferLease`) and goes back to the model's pool, one free buffer per purpose, when that cache is
freed or reset (``hf_ropekv.detach`` frees the pool). A buffer of another shape is let go before a new one is made, so
a model never holds the arenas of a configuration that no longer runs.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any, Callable, Hashable

import torch
from torch import nn

Make = Callable[[], torch.Tensor]


def normal_tensors(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``function`` with inference mode off: the tensors it makes outlive the forward (a cache filled under
    ``torch.inference_mode()`` is continued outside it), and an inference tensor would refuse later in-place writes."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False):
            return function(*args, **kwargs)

    return wrapper

#: Purposes of a static sliding-window layer's leased keys and values (``hf_ropekv.cache.window.StaticWindowLayer``).
WINDOW_KEYS, WINDOW_VALUES = "window_keys", "window_values"


class BufferPool:
    """Free static buffers of one model, by purpose (what the buffer is for, and its device)."""

    _BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, BufferPool]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: nn.Module) -> "BufferPool":
        return cls._BY_MODEL.setdefault(model, cls())

    def __init__(self) -> None:
        self.free: dict[Hashable, torch.Tensor] = {}

    def put(self, purpose: Hashable, tensor: torch.Tensor) -> None:
        self.free[purpose] = tensor  # one per purpose: a second free buffer for it is let go


class BufferLease:
    """The static buffers one cache holds; they go back to its model's pool when the cache goes."""

    def __init__(self, owner: object, pool: BufferPool) -> None:
        self._pool = pool
        self._owner_id = id(owner)  # for __deepcopy__: the copy's owner is memo[id(owner)]
        # (purpose, tensor) pairs; a list, not a dict by id(): a compiled prefill allocates through take(), and
        # dynamo cannot trace id() of a tensor it creates.
        self._held: list[tuple[Hashable, torch.Tensor]] = []
        weakref.finalize(owner, _give_all_back, pool, self._held)

    def __deepcopy__(self, memo: dict) -> "BufferLease":
        """A copied cache's lease: copies of these buffers, given back to the same pool when the copied owner goes
        (the owner's ``__deepcopy__`` must have put its copy in ``memo`` first)."""
        owner = memo.get(self._owner_id)
        if owner is None:
            raise RuntimeError("A BufferLease is copied only with the cache that owns it (copy.deepcopy(cache)).")
        twin = BufferLease(owner, self._pool)
        memo[id(self)] = twin
        twin._held.extend((purpose, copy.deepcopy(tensor, memo)) for purpose, tensor in self._held)
        return twin

    @normal_tensors
    def take(self, purpose: Hashable, shape: tuple[int, ...], dtype: torch.dtype, make: Make) -> torch.Tensor:
        """A buffer for ``purpose`` of ``shape`` and ``dtype``: the pool's (zeroed) when it has one of them, else
        ``make()``; marked as a static address. A pooled buffer of another shape or dtype is let go first."""
        tensor = self._pool.free.pop(purpose, None)
        if tensor is not None and (tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype):
            tensor = None  # another configuration's: its memory goes before the new buffer is made
        if tensor is None:
            tensor = make()
        else:
            tensor.zero_()
        mark_static(tensor)
        self._held.append((purpose, tensor))
        return tensor

    def tensors(self) -> list[torch.Tensor]:
        return [tensor for _, tensor in self._held]

    def give_back(self, tensor: torch.Tensor | None) -> None:
        """Return a buffer this lease holds (the cache was reset); other tensors are ignored."""
        for i, (purpose, held) in enumerate(self._held):
            if held is tensor:
                del self._held[i]
                self._pool.put(purpose, held)
                return


@normal_tensors
def static_buffer(lease: BufferLease | None, purpose: Hashable, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A zeroed buffer at a static address: from ``lease`` (the pool of the model's previous static cache) when the
    layer has one, else a new one marked static."""
    make = functools.partial(torch.zeros, shape, dtype=dtype, device=device)
    if lease is not None:
        return lease.take(purpose, shape, dtype, make)
    tensor = make()
    mark_static(tensor)
    return tensor


_CUDA_BUILT = torch.backends.cuda.is_built()  # a CPU-only torch has no capture to ask about (its call raises)


def step_is_recorded() -> bool:
    """Whether the running forward is recorded to be replayed (traced by ``torch.compile`` or captured into a CUDA
    graph): it must then read per-step values from the static buffers (a host int would be baked in)."""
    return torch.compiler.is_compiling() or (
        _CUDA_BUILT and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def mark_static(*tensors: torch.Tensor) -> None:
    """Mark tensors a compiled step mutates in place as static addresses (inductor's CUDA graphs need every one
    marked); skipped inside a trace."""
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)


def _give_all_back(pool: BufferPool, held: list[tuple[Hashable, torch.Tensor]]) -> None:
    for purpose, tensor in held:
        pool.put(purpose, tensor)
    held.clear()
