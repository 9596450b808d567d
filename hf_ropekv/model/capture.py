"""Deliver each decoder layer's query exactly as RoPE receives it: at the model's own rotary function.

One mechanism for every family: while a capture is attached, the modeling module's ``apply_rotary_pos_emb``
global is replaced by a pass-through (``hf_ropekv.model.rotary``), and each attention module's ``forward`` is wrapped
so that the pass-through knows which layer is running. (A wrapper, not a pre-hook and a forward hook: hooks send
every call of the module through ``nn.Module``'s slow path, about 4 µs a layer and forward, a visible share of a
host-bound decoding step at batch 1.) The query it receives is the pre-RoPE query whatever produced it:
``q_proj``, a query norm (Qwen3, Gemma3, OLMo2, StableLM), or a fused QKV projection split by the model itself
(Phi-3, GPT-NeoX, Falcon, Persimmon, CodeGen). Nothing is recomputed and no linear is hooked, so weight-quantized
linears (bitsandbytes, quanto) work unchanged; head counts are those the tensors show (tensor parallelism
gives each rank its own heads).

Every query is handed to the callback as ``[B, S, H, D]``, the whole head: where a partial-rotary model hands
RoPE only a slice ``q[..., :R]`` of its query, the slice is widened back to the head it was cut from (the
model's own tensor, no copy). The rotary pairs are always the first ``R`` dims.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from . import rotary
from ..warnings import warn
from .geometry import FULL, ModelGeometry

QUERY_NORM_NAMES = ("q_norm", "q_layernorm")
_ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")
_LAYER_LIST_NAMES = ("layers", "h")

QueryCallback = Callable[[int, torch.Tensor], None]
#: ``(layers, queries, heads_dim)``: one decoding step's queries of ``layers``, each as the model handed it to RoPE
#: (``[B, 1, H, D]`` with ``heads_dim`` 2, ``[B, H, 1, D]`` with 1), the whole head.
StepCallback = Callable[[tuple, list, int], None]


def find_attention_modules(model: nn.Module, geometry: ModelGeometry | None = None) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order.

    Looks at the decoder's layer list (``layers`` or ``h``) and each layer's ``self_attn`` / ``attention`` /
    ``attn`` / ``self_attention``, then at any ``...Attention`` module with an integer ``layer_idx``.

    Raises:
        ValueError: if no such modules are found, or not one per decoder layer of ``geometry``.
    """
    modules = _from_decoder_layers(model) or _from_layer_idx(model)
    name = type(model).__name__
    if not modules:
        raise ValueError(
            f"hf_ropekv could not find the attention modules of {name}: no decoder layer list (`layers` or `h`) "
            "whose layers hold a `self_attn` / `attention` / `attn` / `self_attention` module. The RoPE scorer "
            "needs them for query statistics; RecencyScorer, KeyNormScorer and RandomScorer do not."
        )
    if geometry is not None and len(modules) != geometry.num_layers:
        raise ValueError(
            f"hf_ropekv could not find the attention module of every layer of {name}: found {len(modules)} "
            f"for {geometry.num_layers} decoder layers."
        )
    return modules


def _from_decoder_layers(model: nn.Module) -> list[nn.Module]:
    candidates = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            candidates.append(get_decoder())
        except (AttributeError, NotImplementedError, ValueError):
            pass
    candidates += [model, getattr(model, "model", None), getattr(model, "transformer", None)]
    candidates += [getattr(model, "gpt_neox", None)]
    for owner in candidates:
        for list_name in _LAYER_LIST_NAMES:
            layers = getattr(owner, list_name, None)
            if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
                continue
            found = []
            for layer in layers:
                attn = next((getattr(layer, n) for n in _ATTENTION_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
                if attn is None:
                    break
                found.append(attn)
            else:
                return found
    return []


def _from_layer_idx(model: nn.Module) -> list[nn.Module]:
    by_index: dict[int, nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if type(module).__name__.endswith("Attention") and isinstance(idx, int):
            if idx in by_index:
                raise ValueError(
                    f"hf_ropekv could not find the attention modules of {type(model).__name__} unambiguously: "
                    f"several attention modules claim layer_idx {idx}."
                )
            by_index[idx] = module
    if sorted(by_index) != list(range(len(by_index))):
        return []
    return [by_index[i] for i in range(len(by_index))]


class QueryCapture:
    """Calls ``callback(layer_idx, q)`` with every layer's pre-RoPE query ``[B, S, H, D]`` during forwards.

    The tensor handed over is the model's own (or a view of it): read it, do not modify it.

    Example::

        with QueryCapture(model, describe(model), lambda i, q: acc.add(i, q)):
            model(input_ids, use_cache=False)

    Raises (at construction, with the reason): ``ValueError`` when the attention modules, the rotary function
    or the rotary layout of the model cannot be found.
    """

    def __init__(
        self, model: nn.Module, geometry: ModelGeometry, callback: QueryCallback,
        step_callback: StepCallback | None = None,
    ) -> None:
        self.geometry = geometry
        self.callback = callback
        self.step_callback = step_callback  # optional: a recorded decoding step's queries in one call
        geometry.require_rotary_layout()
        modules = find_attention_modules(model, geometry)
        # Weak: the frames put on these modules point back at the capture, which must not keep them alive.
        self._attention_refs = [weakref.ref(module) for module in modules]
        self._functions = [_rotary_function_of(model, attn) for attn in modules]
        self._query_calls = [
            None if fn.paired else _query_call_of(model, attn, fn) for attn, fn in zip(modules, self._functions)
        ]
        self._frames: list[_Frame] = []
        self._installed: list[rotary._Patch] = []
        # The fast path of eager single-token forwards (begin_forward): which rotary call gives which layer's query.
        keys = {fn.key for fn in self._functions}
        self._key = keys.pop() if len(keys) == 1 else None  # one rotary function for every layer, or no fast path
        self._plan: tuple[tuple[int, int, bool] | None, ...] | None = None
        self._step: tuple[tuple[int, ...], tuple[int, ...], int] | None = None  # (query calls, layers, heads dim)
        self._plan_failed = False
        self._learning: list[tuple[torch.Tensor, int, int, bool]] | None = None
        self._recording: Recording | None = None
        self._bypassed = False  # the frames are out of the attention forwards (recorded decoding steps)

    @property
    def attention_modules(self) -> list[nn.Module]:
        """The attention module of every decoder layer, in layer order (those still alive)."""
        return [module for module in (ref() for ref in self._attention_refs) if module is not None]

    @property
    def attached(self) -> bool:
        return bool(self._frames)

    def attach(self) -> "QueryCapture":
        """Install the pass-through and wrap the attention modules' forwards (idempotent)."""
        if self._frames:
            return self
        for fn in dict.fromkeys(self._functions):
            self._installed.append(rotary.install(fn))
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
        self.begin_forward(False)  # the frames back in place, then out
        self._plan, self._plan_failed, self._step = None, False, None
        for frame in reversed(self._frames):
            frame.unwrap()
        self._frames = []
        for patch in self._installed:
            rotary.uninstall(patch)
        self._installed = []

    # ---------------------------------------------------------------- the fast path of eager decoding steps
    # A decoding step (one new token) is host-bound, and per layer the frame path costs a wrapped forward, a frame
    # pushed and popped, the checks of `see` and a chain of callbacks: on a Qwen3-8B-shaped model at batch 1 the
    # capture was most of what RopeKVCache adds to DynamicCache's step. Every decoding step makes the same rotary
    # calls in the same order, so the first one runs the checked frame path and learns which call gives which
    # layer's query (the plan); later ones only keep the first tensor of every call (rotary: Recording) and hand
    # the queries over when the forward has finished, as the frame path would have.
    def begin_forward(self, record: bool) -> None:
        """A forward of the capture's model starts; ``record``: it is an eager single-token forward whose queries
        the capture delivers (a non-static cache's decoding step). Ends any recording left by a forward that raised."""
        self._end_recording()
        if record and self._key is not None and not self._plan_failed and self._frames:
            state = rotary._LOCAL.state
            if self._plan is None:  # this forward takes the frame path and learns the plan
                self._learning = []
                limit = 4 * len(self._frames) + 16
            else:
                limit = len(self._plan)
            self._recording = state.recording = Recording(self._key, limit)
        # A recorded forward needs no frame: the attention modules skip their wrappers until a forward that does.
        self._bypass_frames(self._recording is not None and self._learning is None)

    def _end_recording(self) -> None:
        state = rotary._LOCAL.state
        if self._recording is not None and state.recording is self._recording:
            state.recording = None
        self._recording = self._learning = None

    def _bypass_frames(self, on: bool) -> None:
        """Take the frames out of the attention modules' forwards (``on``) or put them back; kept across forwards,
        so a run of decoding steps switches once. Each wrapper costs a call with the forward's arguments repacked
        per layer and step, a visible share of a host-bound decoding step."""
        if on == self._bypassed:
            return
        self._bypassed = on
        for frame in self._frames:
            frame.bypass(on)

    def finish_forward(self) -> None:
        """The forward finished without raising: a learning forward fixes the plan, a recorded one delivers."""
        recording, learning = self._recording, self._learning
        self._end_recording()
        if recording is None:
            return
        if learning is not None:
            self._plan = self._plan_from(recording.tensors, learning)
            self._plan_failed = self._plan is None
            self._step = self._step_from(self._plan)
        elif recording.tensors:
            self._deliver(recording.tensors)
        else:  # the forward ran compiled: its rotary calls were traced, past the recording and the bypassed frames
            self._plan, self._plan_failed = None, True
            self._bypass_frames(False)
            warn(
                "hf_ropekv: a decoding step of this model ran compiled with a growing RopeKVCache; its queries are "
                "left out of the online statistics, and later steps take the slower, checked path. A compiled "
                "decode wants RopeKVCache(model, budget=..., static=True)."
            )

    def _plan_from(self, calls: list[Any], learning: list[tuple[torch.Tensor, int, int, bool]]) -> tuple | None:
        """For every rotary call of the learning forward: ``(layer, heads dim, widen)`` of the query it gave the
        frames, or None (a key, a call outside the attention modules); None when a query cannot be told apart."""
        by_tensor = {id(q): entry for q, *entry in learning}
        plan = tuple(tuple(by_tensor[id(t)]) if id(t) in by_tensor else None for t in calls)
        if len(calls) >= 4 * len(self._frames) + 16 or sum(entry is not None for entry in plan) != len(learning):
            return None
        return plan

    @staticmethod
    def _step_from(plan: tuple | None) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """The plan as one step delivery, when every query comes whole and in one layout; else None."""
        queries = [(i, entry) for i, entry in enumerate(plan or ()) if entry is not None]
        if not queries or any(widen for _, (_, _, widen) in queries) or len({e[1] for _, e in queries}) != 1:
            return None
        return tuple(i for i, _ in queries), tuple(e[0] for _, e in queries), queries[0][1][1]

    def _deliver(self, calls: list[Any]) -> None:
        expected = len(self._plan)
        if len(calls) != expected:
            self._plan, self._plan_failed = None, True
            warn(
                f"hf_ropekv: a decoding step of this model made {len(calls)} rotary calls where earlier steps made "
                f"{expected}; its queries are left out of the online statistics, and later steps take "
                "the slower, checked path."
            )
            return
        if self.step_callback is not None and self._step is not None:
            indices, layers, heads_dim = self._step
            self.step_callback(layers, [calls[i] for i in indices], heads_dim)
            return
        for entry, q in zip(self._plan, calls):
            if entry is not None:
                layer_idx, heads_dim, _ = entry
                self.callback(layer_idx, _as_query(q, heads_dim, self.geometry.head_dim))

    def __enter__(self) -> "QueryCapture":
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()


class _Frame:
    """One layer's attention forward in progress: picks its query out of the rotary calls it makes."""

    def __init__(
        self, capture: QueryCapture, attention: nn.Module, layer_idx: int, function: rotary.RotaryFunction,
        query_call: int | None,
    ) -> None:
        # The module holds this frame (its forward): the frame holds the module weakly, so no cycle outlives it.
        self._attention_ref = weakref.ref(attention)
        self.capture, self.layer_idx = capture, layer_idx
        self.function, self.query_call = function, query_call
        self.calls = 0
        self.full_attention = capture.geometry.layer_types[layer_idx] == FULL
        self.head_dim = capture.geometry.head_dim
        self.key = function.key  # where the pass-through looks for the frames of this rotary function
        self.bypassed = False  # taken out of attention.forward for recorded decoding steps (QueryCapture.begin_forward)

    @property
    def attention(self) -> nn.Module | None:
        return self._attention_ref()

    def __reduce__(self) -> tuple:
        # A copied model's attention forward (this frame's bound forward) becomes a pass-through of the copy.
        return _CopiedForward, (self.attention, self.inner)

    # ---------------------------------------------------------------- the attention module's forward, wrapped
    def wrap(self) -> None:
        """Make ``attention.forward`` this frame's :meth:`forward` (an instance attribute over whatever ran before:
        the class's forward, or another capture's or library's wrapper)."""
        attention = self.attention
        if attention is None:
            return
        self.live = True
        # The forward to run inside: an instance attribute (another wrapper) as it is; the class's forward as the
        # plain function, called with the module (a bound method would hold the module from its own __dict__).
        self.inner = attention.__dict__.get("forward")
        self.had_instance_forward = self.inner is not None
        self.class_forward = type(attention).forward
        attention.forward = self.forward

    def run_inner(self, args: tuple, kwargs: dict) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return self.class_forward(self._attention_ref(), *args, **kwargs)

    def bypass(self, on: bool) -> None:
        """``on``: take this frame out of ``attention.forward`` while it is the outermost wrapper (under another one
        it stays, passing recorded calls through); off: wrap again, outermost, over whatever is there now."""
        attention = self.attention
        if attention is None:
            return
        if on:
            if _frame_of(attention.__dict__.get("forward")) is self:
                self.unwrap()
                self.bypassed = True
        elif self.bypassed:
            self.bypassed = False
            self.wrap()

    def unwrap(self) -> None:
        """Give ``attention`` back the forward it had, or, when another wrapper went on top since, take this one out
        of the chain; a wrapper that cannot be reached any more just passes calls through (``live`` off)."""
        self.live = False
        attention = self.attention
        if attention is None:
            return
        current = attention.__dict__.get("forward")
        if _frame_of(current) is self:
            if self.had_instance_forward:
                attention.forward = self.inner
            else:
                del attention.forward  # back to the class's forward
            return
        outer = _frame_of(current)
        while outer is not None:
            if _frame_of(outer.inner) is self:
                outer.inner, outer.had_instance_forward = self.inner, self.had_instance_forward
                return
            outer = _frame_of(outer.inner)

    # forward and see run for every layer of every forward while attached: each is a few lookups.
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.live or (self.capture._recording is not None and self.capture._learning is None
                             and not torch.compiler.is_compiling()):
            return self.run_inner(args, kwargs)  # detached, or a recorded decoding step: no frame
        frames = rotary.frame_stack(self.key)
        self.calls = 0
        frames.append(self)
        try:
            output = self.run_inner(args, kwargs)
        finally:
            rotary.pop_frame(frames, self)
        if self.calls == 0 and self.full_attention:
            name = type(self.attention).__name__
            raise ValueError(
                f"Layer {self.layer_idx} ({name}) ran without rotating its query through "
                f"{self.function.module.__name__}.{self.function.name}: it applies no RoPE (NoPE) or applies it "
                "elsewhere, so hf_ropekv cannot gather its query statistics. Use RecencyScorer, KeyNormScorer or "
                "RandomScorer (hf_ropekv.scorers), which need none."
            )
        return output

    def see(self, args: tuple, kwargs: dict) -> None:
        call = self.calls
        self.calls = call + 1
        if self.query_call is not None and call % 2 != self.query_call:
            return  # one tensor per call: this one is the key
        fn = self.function
        q, heads_dim = fn.query_and_heads_dim(args, kwargs)
        if not isinstance(q, torch.Tensor) or q.ndim != 4:
            raise ValueError(
                f"{fn.module.__name__}.{fn.name} received a query of shape "
                f"{tuple(getattr(q, 'shape', ()))} in layer {self.layer_idx}; hf_ropekv expects a 4-D "
                "[batch, heads, seq, dims] or [batch, seq, heads, dims] tensor."
            )
        learning = self.capture._learning
        if learning is not None:
            learning.append((q, self.layer_idx, heads_dim, q.shape[-1] < self.head_dim))
        self.capture.callback(self.layer_idx, _as_query(q, heads_dim, self.head_dim))


class Recording:
    """The rotary calls of one eager single-token forward: the first tensor of each, in call order (the rotary
    pass-through appends them while ``rotary._LOCAL.state.recording`` is this; at most ``limit``)."""

    __slots__ = ("key", "limit", "tensors")

    def __init__(self, key: int, limit: int) -> None:  # no reference to the capture: a thread's state holds this
        self.key, self.limit = key, limit
        self.tensors: list[Any] = []


def _as_query(q: torch.Tensor, heads_dim: int, head_dim: int) -> torch.Tensor:
    """A query as RoPE received it, as the callbacks take it: ``[B, S, H, D]``, the whole head."""
    if heads_dim == 1:
        q = q.transpose(1, 2)
    if q.shape[-1] < head_dim:  # only the rotary part: see _whole_head
        q = _whole_head(q, head_dim)
    return q


def _whole_head(q: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The whole query head when the model handed RoPE only its rotary part as a slice (``q[..., :R]``:
    Persimmon, StableLM, Phi, GPT-J): the same storage seen ``head_dim`` wide. The view is widened only when
    every other stride leaves room for ``head_dim`` elements and the storage holds them; otherwise ``q``."""
    if q.shape[-1] >= head_dim or q.stride(-1) != 1:
        return q
    if any(stride < head_dim for size, stride in zip(q.shape[:-1], q.stride()[:-1]) if size > 1):
        return q  # a compact copy of the rotary part: nothing beyond it belongs to this head
    last = q.storage_offset() + sum((size - 1) * stride for size, stride in zip(q.shape[:-1], q.stride()[:-1]))
    if (last + head_dim) * q.element_size() > q.untyped_storage().nbytes():
        return q
    return q.as_strided((*q.shape[:-1], head_dim), q.stride(), q.storage_offset())


class _CopiedForward(_Frame):
    """What a copy of the model (``copy.deepcopy``, pickle) gets for a frame's forward: the capture belongs to the
    original model, so on its first call it puts back the forward the module had before (``inner``, or the
    class's) and runs it. (A frame's bound ``forward`` is copied as ``_Frame.forward`` bound to the frame's copy:
    this subclass, never live, makes that call a pass-through.)"""

    def __init__(self, attention: nn.Module, inner: Any = None) -> None:  # noqa: super().__init__ is the capture's
        self._attention_ref = weakref.ref(attention)
        self.inner, self.had_instance_forward, self.live = inner, inner is not None, False
        self.class_forward = type(attention).forward

    def restore(self) -> nn.Module:
        attention = self._attention_ref()
        current = attention.__dict__.get("forward")
        if getattr(current, "__self__", None) is self:
            if self.inner is None:
                del attention.forward
            else:
                attention.forward = self.inner
        return attention

    def run_inner(self, args: tuple, kwargs: dict) -> Any:
        self.restore()
        return super().run_inner(args, kwargs)


def _frame_of(forward: Any) -> "_Frame | None":
    """The live capture frame whose :meth:`_Frame.forward` ``forward`` is (a bound method), else None."""
    owner = getattr(forward, "__self__", None)
    if not isinstance(owner, _Frame) or isinstance(owner, _CopiedForward):
        return None
    return owner if getattr(forward, "__func__", None) is _Frame.forward else None


def _rotary_function_of(model: nn.Module, attention: nn.Module) -> rotary.RotaryFunction:
    # The module whose globals the forward resolves the function name in (the forward may be inherited).
    fn = rotary.find_rotary_function(type(attention).forward.__module__)
    if fn is None:
        raise ValueError(
            f"hf_ropekv could not find where {type(model).__name__} applies RoPE to its queries: "
            f"{type(attention).forward.__module__} has no apply_rotary_pos_emb(q, k, cos, sin) or "
            "apply_rotary_pos_emb(tensor, sin, cos). The RoPE scorer needs the queries; RecencyScorer, "
            "KeyNormScorer and RandomScorer (hf_ropekv.scorers) do not, and budget=None never evicts."
        )
    return fn


def _query_call_of(model: nn.Module, attention: nn.Module, fn: rotary.RotaryFunction) -> int:
    index = rotary.query_call_index(type(attention), fn)
    if index is None:
        raise ValueError(
            f"hf_ropekv could not tell which call of {fn.module.__name__}.{fn.name} rotates the query in "
            f"{type(attention).__name__}.forward of {type(model).__name__}. Use RecencyScorer, KeyNormScorer or "
            "RandomScorer (hf_ropekv.scorers), which need no query statistics."
        )
    return index
