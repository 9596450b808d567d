"""Each decoder layer's query exactly as RoPE receives it, from the model's own rotary function.

While attached, the modeling module's ``apply_rotary_pos_emb`` is a pass-through (:mod:`.rotary`) and each attention
module's ``forward`` is wrapped (cheaper than hooks) so the pass-through knows which layer runs. This works for
every family, fused QKV projections and quantized linears included. A partial-rotary query slice ``q[..., :R]`` is
widened back to the whole head (the model's own tensor, no copy); the rotary pairs are the first ``R`` dims."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import torch
from torch import nn

from . import rotary
from .geometry import FULL, ModelGeometry

QUERY_NORM_NAMES = ("q_norm", "q_layernorm")
_ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")
_LAYER_LIST_NAMES = ("layers", "h")

QueryCallback = Callable[[int, torch.Tensor], None]


def find_attention_modules(model: nn.Module, geometry: ModelGeometry | None = None) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order (from the decoder's layer list, else from
    the ``...Attention`` modules' ``layer_idx``); ``ValueError`` if not one per layer is found."""
    modules = _from_decoder_layers(model) or _from_layer_idx(model)
    name = type(model).__name__
    if not modules:
        raise ValueError(
            f"hf_ropekv could not find the attention modules of {name}: no decoder layer list (`layers` or `h`) "
            "whose layers hold a `self_attn` / `attention` / `attn` / `self_attention` module. The RoPE scorer "
            "needs them for query statistics; RecencyScorer, KeyNormScorer and RandomScorer do not.")
    if geometry is not None and len(modules) != geometry.num_layers:
        raise ValueError(f"hf_ropekv could not find the attention module of every layer of {name}: found "
                         f"{len(modules)} for {geometry.num_layers} decoder layers.")
    return modules


def _from_decoder_layers(model: nn.Module) -> list[nn.Module]:
    candidates = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
            candidates.append(get_decoder())
    candidates += [model, *(getattr(model, name, None) for name in ("model", "transformer", "gpt_neox"))]
    for owner in candidates:
        for list_name in _LAYER_LIST_NAMES:
            layers = getattr(owner, list_name, None)
            if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
                continue
            found = [next((getattr(layer, n) for n in _ATTENTION_NAMES
                           if isinstance(getattr(layer, n, None), nn.Module)), None) for layer in layers]
            if None not in found:
                return found
    return []


def _from_layer_idx(model: nn.Module) -> list[nn.Module]:
    by_index: dict[int, nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if type(module).__name__.endswith("Attention") and isinstance(idx, int):
            if idx in by_index:
                raise ValueError(f"hf_ropekv could not find the attention modules of {type(model).__name__} "
                                 f"unambiguously: several attention modules claim layer_idx {idx}.")
            by_index[idx] = module
    if sorted(by_index) != list(range(len(by_index))):
        return []
    return [by_index[i] for i in range(len(by_index))]


class CaptureBase:
    """What both query captures share: the attention modules, held weakly (what is put on them points back at the
    capture), a forward's start and end, and ``with`` support (attach, then detach)."""

    def __init__(self, modules: list[nn.Module], geometry: ModelGeometry, callback: QueryCallback) -> None:
        self.geometry, self.callback = geometry, callback
        self._attention_refs = [weakref.ref(module) for module in modules]

    @property
    def attention_modules(self) -> list[nn.Module]:
        """The attention module of every decoder layer, in layer order (those still alive)."""
        return [module for module in (ref() for ref in self._attention_refs) if module is not None]

    def begin_forward(self, record: bool) -> None:
        """A forward starts (``record``: hand an eager decoding step's queries over at once, where supported)."""

    def finish_forward(self) -> None:
        """The forward finished."""

    def __enter__(self) -> Any:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()


class QueryCapture(CaptureBase):
    """Calls ``callback(layer_idx, q)`` with every layer's pre-RoPE query ``[B, S, H, D]`` (the model's own tensor:
    do not modify it) during forwards, while attached (``with QueryCapture(model, geometry, callback): ...``); raises
    ``ValueError`` when the attention modules, rotary function or rotary layout cannot be found."""

    def __init__(self, model: nn.Module, geometry: ModelGeometry, callback: QueryCallback) -> None:
        geometry.require_rotary_layout()
        modules = find_attention_modules(model, geometry)
        super().__init__(modules, geometry, callback)
        self._functions: list[rotary.RotaryFunction] = []
        for attn in modules:
            fn = rotary.find_rotary_function(type(attn).forward.__module__)
            if fn is None:
                raise ValueError(f"hf_ropekv could not find where {type(model).__name__} applies RoPE to its queries: "
                                 f"{type(attn).forward.__module__} has no apply_rotary_pos_emb(q, k, cos, sin) or "
                                 "apply_rotary_pos_emb(tensor, sin, cos). The RoPE scorer needs the queries; "
                                 "RecencyScorer, KeyNormScorer and RandomScorer (hf_ropekv.scorers) do not, and "
                                 "budget=None never evicts.")
            self._functions.append(fn)
        self._query_calls: list[int | None] = []
        for attn, fn in zip(modules, self._functions):
            index = None if fn.paired else rotary.query_call_index(type(attn), fn)
            if index is None and not fn.paired:
                raise ValueError(f"hf_ropekv could not tell which call of {fn.module.__name__}.{fn.name} rotates the "
                                 f"query in {type(attn).__name__}.forward of {type(model).__name__}. Use "
                                 "RecencyScorer, KeyNormScorer or RandomScorer (hf_ropekv.scorers), which need no "
                                 "query statistics.")
            self._query_calls.append(index)
        self._frames: list[_Frame] = []
        self._installed: list[rotary._Patch] = []

    def attach(self) -> "QueryCapture":
        """Install the pass-through and wrap the attention modules' forwards (idempotent)."""
        if self._frames:
            return self
        self._installed += [rotary.install(fn) for fn in dict.fromkeys(self._functions)]
        for layer_idx, ref in enumerate(self._attention_refs):
            attention = ref()
            if attention is None:
                continue
            frame = _Frame(self, attention, layer_idx, self._functions[layer_idx], self._query_calls[layer_idx])
            frame.wrap()
            self._frames.append(frame)
        return self

    def detach(self) -> None:
        """Unwrap the attention modules and give the rotary function back (idempotent)."""
        for frame in reversed(self._frames):
            frame.unwrap()
        self._frames = []
        for patch in self._installed:
            rotary.uninstall(patch)
        self._installed = []


class _Frame:
    """One layer's attention forward in progress: picks its query out of the rotary calls it makes."""

    def __init__(self, capture: QueryCapture, attention: nn.Module, layer_idx: int, function: rotary.RotaryFunction,
                 query_call: int | None) -> None:
        self._attention_ref = weakref.ref(attention)
        self.capture, self.layer_idx = capture, layer_idx
        self.function, self.query_call = function, query_call
        self.calls = 0
        self.full_attention = capture.geometry.layer_types[layer_idx] == FULL
        self.head_dim = capture.geometry.head_dim
        self.key = function.key

    @property
    def attention(self) -> nn.Module | None:
        return self._attention_ref()

    def __reduce__(self) -> tuple:
        # A copied model's attention forward (this frame's bound forward) becomes a pass-through of the copy.
        return _CopiedForward, (self.attention, self.inner)

    def wrap(self) -> None:
        """Make ``attention.forward`` this frame's :meth:`forward`, over whatever ran before."""
        attention = self.attention
        self.live = True
        # The class's forward is kept as the plain function: a bound method would hold the module from its __dict__.
        self.inner = attention.__dict__.get("forward")
        self.class_forward = type(attention).forward
        attention.forward = self.forward

    def run_inner(self, args: tuple, kwargs: dict) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return self.class_forward(self._attention_ref(), *args, **kwargs)

    def unwrap(self) -> None:
        """Give ``attention`` back the forward it had, or take this wrapper out of a chain that grew on top of it;
        an unreachable one just passes calls through."""
        self.live = False
        attention = self.attention
        if attention is None:
            return
        outer = _frame_of(attention.__dict__.get("forward"))
        if outer is self:
            if self.inner is not None:
                attention.forward = self.inner
            else:
                del attention.forward  # back to the class's forward
            return
        while outer is not None:
            if _frame_of(outer.inner) is self:
                outer.inner = self.inner
                return
            outer = _frame_of(outer.inner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.live:
            return self.run_inner(args, kwargs)  # detached: a pass-through
        frames = rotary.frame_stack(self.key)
        self.calls = 0
        frames.append(self)
        try:
            output = self.run_inner(args, kwargs)
        finally:
            rotary.pop_frame(frames, self)
        if self.calls == 0 and self.full_attention:
            raise ValueError(f"Layer {self.layer_idx} ({type(self.attention).__name__}) ran without rotating its query "
                             f"through {self.function.module.__name__}.{self.function.name}: it applies no RoPE (NoPE) "
                             "or applies it elsewhere, so hf_ropekv cannot gather its query statistics. Use "
                             "RecencyScorer, KeyNormScorer or RandomScorer (hf_ropekv.scorers), which need none.")
        return output

    def see(self, args: tuple, kwargs: dict) -> None:
        call, self.calls = self.calls, self.calls + 1
        if self.query_call is not None and call % 2 != self.query_call:
            return  # one tensor per call: this one is the key
        fn = self.function
        q, heads_dim = fn.query_and_heads_dim(args, kwargs)
        if not isinstance(q, torch.Tensor) or q.ndim != 4:
            raise ValueError(f"{fn.module.__name__}.{fn.name} received a query of shape "
                             f"{tuple(getattr(q, 'shape', ()))} in layer {self.layer_idx}; hf_ropekv expects a 4-D "
                             "[batch, heads, seq, dims] or [batch, seq, heads, dims] tensor.")
        self.capture.callback(self.layer_idx, _as_query(q, heads_dim, self.head_dim))


def _as_query(q: torch.Tensor, heads_dim: int, head_dim: int) -> torch.Tensor:
    """A query as RoPE received it, as ``[B, S, H, D]``; a rotary slice ``q[..., :R]`` (Persimmon, StableLM, Phi,
    GPT-J) as the whole head: the same storage seen ``head_dim`` wide, where the strides and the storage allow it."""
    if heads_dim == 1:
        q = q.transpose(1, 2)
    if q.shape[-1] >= head_dim or q.stride(-1) != 1:
        return q
    if any(stride < head_dim for size, stride in zip(q.shape[:-1], q.stride()[:-1]) if size > 1):
        return q  # a compact copy of the rotary part: nothing beyond it belongs to this head
    last = q.storage_offset() + sum((size - 1) * stride for size, stride in zip(q.shape[:-1], q.stride()[:-1]))
    if (last + head_dim) * q.element_size() > q.untyped_storage().nbytes():
        return q
    return q.as_strided((*q.shape[:-1], head_dim), q.stride(), q.storage_offset())


class _CopiedForward(_Frame):
    """What a copy of the model (deepcopy, pickle) gets for a frame's forward: on its first call it puts back the
    forward the module had before and runs it (the capture belongs to the original)."""

    def __init__(self, attention: nn.Module, inner: Any = None) -> None:
        self._attention_ref = weakref.ref(attention)
        self.inner, self.live = inner, False
        self.class_forward = type(attention).forward

    def restore(self) -> nn.Module:
        attention = self._attention_ref()
        if getattr(attention.__dict__.get("forward"), "__self__", None) is self:
            if self.inner is None:
                del attention.forward
            else:
                attention.forward = self.inner
        return attention

    def run_inner(self, args: tuple, kwargs: dict) -> Any:
        self.restore()
        return super().run_inner(args, kwargs)


def _frame_of(forward: Any) -> "_Frame | None":
    """The live capture frame whose bound :meth:`_Frame.forward` ``forward`` is, else None."""
    owner = getattr(forward, "__self__", None)
    if not isinstance(owner, _Frame) or isinstance(owner, _CopiedForward):
        return None
    return owner if getattr(forward, "__func__", None) is _Frame.forward else None
