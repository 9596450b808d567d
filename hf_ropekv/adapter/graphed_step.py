"""A static cache's decode step replayed from a CUDA graph of the eager forward: fast decoding with no compile.

The step reads only the cache's static buffers (``storage.buffers``) and gets every per-step value through generate's
inputs (ids, positions, the slot mask the cache builds before the step). So the first decode step of a static cache
on one CUDA device runs eagerly (its real result) and is then captured; later steps copy their inputs into the
captured ones and replay it. The graph runs eager's own kernels, so the tokens equal the eager static cache's
(recording takes ~0.1 s against 8-60 s of compile; steps are ~9 % slower than compiled ones).

:class:`GraphedDecodeStep` stands where generate would call its compiled forward, one per model. It calls ``model(...)``
with ``model.forward`` routed to the replay for the calling thread only, so the model's hooks still run eagerly around
every step. A graph is kept per cache, input signature and address of the tensors the cache's step reads, and goes
with its cache. Off CUDA, for a model spread over devices or ranks, or when a capture fails, steps run eagerly, with
one warning."""

from __future__ import annotations

import functools
import threading
import types
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..warnings import warn

_MISSING = object()
#: Graphs one cache may record (one per input signature: a batch size, a mask layout); past it, the signature is
#: changing from step to step, and replaying would mean recording at every step: the cache then decodes eagerly.
MAX_GRAPHS_PER_CACHE = 8


class _Recorded:
    """One captured decode step: the graph, the inputs it reads and the output it writes, kept without the cache
    it names (a reference would keep the cache and its graphs alive for the model's life); a replay puts it back."""

    __slots__ = ("graph", "inputs", "output_type", "fields", "cache_fields")

    def __init__(self, graph: Any, inputs: list[torch.Tensor], output: Any, cache: Any) -> None:
        self.graph, self.inputs, self.output_type = graph, inputs, type(output)
        self.cache_fields = tuple(name for name, value in output.items() if value is cache)
        self.fields = {name: value for name, value in output.items() if value is not cache}

    def replay(self, inputs: list[torch.Tensor], cache: Any) -> Any:
        for recorded, new in zip(self.inputs, inputs):
            recorded.copy_(new)
        self.graph.replay()
        # Fresh tensors out: the next replay overwrites the graph's own output.
        fields = {name: clone_tensors(value) for name, value in self.fields.items()}
        return self.output_type(**fields, **{name: cache for name in self.cache_fields})


class _CacheGraphs:
    def __init__(self) -> None:
        self.graphs: dict[tuple, _Recorded] = {}
        self.refused: str | None = None  # why this cache decodes eagerly


class GraphedDecodeStep:
    """generate's decode-step forward of static caches, one per model (see the module); ``recordings`` counts graphs."""

    def __init__(self, model: nn.Module) -> None:
        self._model_ref = weakref.ref(model)
        self._caches: dict[int, _CacheGraphs] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.recordings = 0
        # model.forward is routed through _route while any thread runs a step; each thread's cache is in _local.
        self._local = threading.local()
        self._lock = threading.Lock()
        self._recording = threading.Lock()
        self._active = 0
        self._previous: Any = _MISSING

    def __call__(self, cache: Any, /, *args: Any, **kwargs: Any) -> Any:
        # (positional-only: transformers >= 5.24 passes the cache to the forward as ``cache=``)
        model = self._model_ref()
        if model is None:
            raise ReferenceError("The model of this hf_ropekv graphed decode step no longer exists.")
        self._route_forward(model, on=True)
        self._local.cache = cache
        try:
            return model(*args, **kwargs)  # its hooks run eagerly, around _route
        finally:
            self._local.cache = None
            self._route_forward(model, on=False)

    def _route_forward(self, model: nn.Module, on: bool) -> None:
        """Put ``model.forward`` through :meth:`_route` while at least one step runs; then give back what it had (an
        instance forward, such as another library's wrapper, or the class's)."""
        with self._lock:
            if on:
                self._active += 1
                if self._active == 1:
                    self._previous = previous = model.__dict__.get("forward", _MISSING)
                    real = previous if previous is not _MISSING else types.MethodType(type(model).forward, model)
                    # Bound in: a forward that picked the route up just before it was taken off still reaches it.
                    route = functools.partial(self._route, real)
                    route.__wrapped__ = real  # generate checks its kwargs against the forward's signature
                    model.forward = route
                return
            self._active -= 1
            if self._active == 0:
                if self._previous is _MISSING:
                    model.__dict__.pop("forward", None)
                else:
                    model.forward = self._previous
                self._previous = _MISSING

    def _route(self, real: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        cache, self._local.cache = getattr(self._local, "cache", None), None  # one step per call
        if cache is None:  # another thread's forward, or one this step did not start
            return real(*args, **kwargs)
        return self._forward(cache, real, *args, **kwargs)

    def graphs_of(self, cache: Any) -> int:
        state = self._caches.get(id(cache))
        return 0 if state is None else len(state.graphs)

    def _forward(self, cache: Any, inner: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        state = self._caches.get(id(cache))
        if state is None:
            state = self._caches[id(cache)] = _CacheGraphs()
            weakref.finalize(cache, self._caches.pop, id(cache), None)  # the graphs (and their memory) go with it
        if state.refused is not None:
            return inner(*args, **kwargs)
        inputs = tensor_leaves(args, kwargs)
        device = inputs[0].device if inputs else torch.device("cpu")
        if not state.graphs:  # before a cache's first recording
            reason = not_capturable(self._model_ref(), device)
            if reason is not None:
                self._refuse(state, reason)
                return inner(*args, **kwargs)
        # The attention path changes at the first eviction (sdpa, then the decode kernel): a graph of each.
        key = (input_signature(args, kwargs), tuple(t.data_ptr() for t in cache._recorded_step_tensors()),
               cache.num_compactions > 0)
        recorded = state.graphs.get(key)
        if recorded is not None:
            return recorded.replay(inputs, cache)
        if len(state.graphs) >= MAX_GRAPHS_PER_CACHE:
            self._refuse(state, f"its decode steps came with {MAX_GRAPHS_PER_CACHE + 1} different input signatures "
                                "(shapes, strides or values), so every step would record a graph")
            return inner(*args, **kwargs)
        with self._recording:  # one capture at a time: they share the side stream
            return self._record(cache, state, key, inner, args, kwargs, device)

    def _record(self, cache: Any, state: _CacheGraphs, key: tuple, inner: Callable[..., Any], args: tuple,
                kwargs: dict, device: torch.device) -> Any:
        """Run the step eagerly (its result, and the warm-up a capture needs), then capture it on the same stream."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            output = inner(*args, **kwargs)
            recorded_args, recorded_kwargs = pytree.tree_map(clone_tensors, (args, kwargs))
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the capture forbids unsafe CUDA calls (a sync, a cudaMalloc) in this thread only
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                recorded_output = inner(*recorded_args, **recorded_kwargs)
        except Exception as err:  # noqa: BLE001 - whatever the model does that a capture refuses: decode eagerly
            self._refuse(state, f"capturing its decode step failed ({type(err).__name__}: {err})")
            return output
        finally:
            current.wait_stream(stream)
        state.graphs[key] = _Recorded(graph, tensor_leaves(recorded_args, recorded_kwargs), recorded_output, cache)
        self.recordings += 1
        return output

    @staticmethod
    def _refuse(state: _CacheGraphs, reason: str) -> None:
        state.refused = reason
        warn(f"hf_ropekv: this static RopeKVCache decodes eagerly, without CUDA graphs: {reason}.")


def not_capturable(model: nn.Module, device: torch.device) -> str | None:
    """Why this model's decode step cannot be one CUDA graph, or None: a capture records one device's stream, so
    layers on another device or other ranks' collectives would run once and never replay."""
    if device.type != "cuda":
        return f"the model runs on {device.type}; CUDA graphs need CUDA"
    devices = {str(p.device) for p in model.parameters()}
    if len(devices) > 1:
        return f"the model spans {len(devices)} devices ({', '.join(sorted(devices))}); a CUDA graph holds one"
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:
        return "the model runs distributed (tensor parallelism); CUDA graphs of it are untried"
    return None


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """What a graph is valid for: the inputs' structure (a mask may come as a dict per layer type), each tensor's
    shape, dtype, device and strides, and every other value (objects, the cache among them, by identity)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.device, value.stride())
        return value if isinstance(value, (int, float, str, bool, type(None))) else ("id", id(value))

    return str(spec), tuple(one(leaf) for leaf in leaves)


def tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Every tensor of a forward's inputs, in :func:`input_signature`'s order: what a replay copies in."""
    return [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]


def clone_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(clone_tensors(item) for item in value)
    return value
