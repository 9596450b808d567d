"""The model's own rotary function (``apply_rotary_pos_emb`` of its modeling module): where RoPE receives the query,
and how it pairs dimensions.

Two calling conventions exist: ``(q, k, cos, sin, ..., unsqueeze_dim=1)`` (almost every family; the query is
``[B, H, S, R]`` with ``unsqueeze_dim`` 1, ``[B, S, H, R]`` with 2) and one tensor per call, ``(tensor, sin, cos)``
(GPT-J, CodeGen), where the query is told apart by the order of the calls in the attention's source. This module
finds the function, probes it to learn the pair layout (and frequencies where the rotary module has no
``inv_freq``), and patches it with a pass-through that shows each call to the attention forwards in progress."""

from __future__ import annotations

import ast
import inspect
import math
import sys
import textwrap
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .layouts import LAYOUTS, ROTATE_HALF, pair_strides

FUNCTION_NAME = "apply_rotary_pos_emb"


@dataclass(frozen=True)
class RotaryFunction:
    """The rotary function (unwrapped) of a modeling ``module`` and how it is called (``paired``: ``(q, k, cos,
    sin, ...)``; else one tensor per call)."""

    module: Any
    name: str
    function: Callable
    signature: inspect.Signature
    paired: bool

    def __deepcopy__(self, memo: dict) -> "RotaryFunction":
        return self  # immutable, and modules cannot be copied

    def __post_init__(self) -> None:
        # Plain values read once (torch.compile traces the per-call path without a graph break; dynamo cannot id()
        # a module, so frames are filed by the module's id taken here). The first parameter holds the query.
        params = self.signature.parameters
        default = params["unsqueeze_dim"].default if "unsqueeze_dim" in params else 1 if self.paired else 2
        index = list(params).index("unsqueeze_dim") if "unsqueeze_dim" in params else None
        heads_dim = 1 if default is inspect.Parameter.empty else int(default)
        object.__setattr__(self, "_call_layout", (next(iter(params)), index, heads_dim))
        object.__setattr__(self, "key", id(self.module))

    def query_and_heads_dim(self, args: tuple, kwargs: dict) -> tuple[Any, int]:
        """The query (or tensor) of one call and its heads' dim (1: ``[B, H, S, R]``, 2: ``[B, S, H, R]``)."""
        name, index, default = self._call_layout
        q = args[0] if args else kwargs.get(name)
        if "unsqueeze_dim" in kwargs:
            return q, int(kwargs["unsqueeze_dim"])
        if index is not None and len(args) > index:
            return q, int(args[index])
        return q, default


def find_rotary_function(module_name: str) -> RotaryFunction | None:
    """The rotary function of the modeling module ``module_name``, or ``None`` when it has none we understand."""
    module = sys.modules.get(module_name)
    function = getattr(module, FUNCTION_NAME, None) if module is not None else None
    if not callable(function):
        return None
    original = _hub_kernel_original(getattr(function, "_hf_ropekv_original", function))
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return None
    names = list(signature.parameters)
    if "cos" not in names or "sin" not in names or names[0] in ("cos", "sin"):
        return None
    paired = names.index("cos") >= 2 and names.index("sin") >= 2  # (q, k, cos, sin, ...)
    return RotaryFunction(module, FUNCTION_NAME, original, signature, paired)


def _hub_kernel_original(function: Callable) -> Callable:
    """The plain function inside HuggingFace ``kernels``' ``nn.Module`` wrapper of it (transformers >= 5.25 decorates
    ``apply_rotary_pos_emb`` with ``use_kernel_forward_from_hub``), else ``function``."""
    if not isinstance(function, nn.Module):
        return function
    forward = getattr(type(function), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or cells is None or "func" not in code.co_freevars:
        return function
    inner = cells[code.co_freevars.index("func")].cell_contents
    return inner if callable(inner) and not isinstance(inner, nn.Module) else function


def query_call_index(attention_cls: type, function: RotaryFunction) -> int | None:
    """For one-tensor-per-call functions: which call of each attention forward rotates the query (0 or 1), read
    from the forward's source (first arguments named ``q...`` against ``k...``); ``None`` if unclear."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(attention_cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    kinds = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == function.name and node.args:
            name = node.args[0].id if isinstance(node.args[0], ast.Name) else ""
            kind = "q" if name.startswith("q") else "k" if name.startswith("k") else "?"
            kinds.append((node.lineno, node.col_offset, kind))
    pattern = "".join(kind for *_, kind in sorted(kinds))
    for unit in ("qk", "kq"):
        if pattern and pattern == unit * (len(pattern) // 2):
            return unit.index("q")
    return None


def rotary_matrix(dims: int, layout: str, inv_freq: torch.Tensor, position: int) -> torch.Tensor:
    """float64 ``[dims, dims]``: row ``j`` is RoPE of ``layout`` at ``position`` applied to the basis vector ``e_j``."""
    pairs = inv_freq.numel()
    stride, offset = pair_strides(layout, pairs)
    m = torch.eye(dims, dtype=torch.float64)
    theta = inv_freq.double() * position
    for f in range(pairs):
        r, i = f * stride, f * stride + offset
        c, s = math.cos(theta[f]), math.sin(theta[f])
        m[r, r], m[r, i], m[i, r], m[i, i] = c, s, -s, c
    return m


def probe_rotary(rotary: nn.Module, function: RotaryFunction, inv_freq: torch.Tensor | None, max_position: int | None,
                 name: str) -> tuple[torch.Tensor, str]:
    """``(inv_freq float32 [F], layout)`` learned from the model's own RoPE on basis vectors (the frequencies are
    measured when ``inv_freq`` is None); ``ValueError`` if the rotation matches neither layout."""
    # Far enough that every pair turns by a visible angle, inside tables of precomputed positions (GPT-J).
    far = 1000 if max_position is None else max(2, min(1000, int(max_position) - 1))
    with torch.no_grad():
        candidates = []
        for at_far in _rotate_basis(rotary, function, far):
            dims = at_far.shape[-1]
            for layout in LAYOUTS:
                freqs = inv_freq if inv_freq is not None else _measured_frequencies(rotary, function, layout, dims, far)
                if 2 * freqs.numel() > dims:
                    continue
                error = (at_far - rotary_matrix(dims, layout, freqs.float(), far)).abs().max().item()
                candidates.append((error, layout, freqs))
    matches = [c for c in candidates if c[0] < 1e-3]
    if not matches:
        raise ValueError(
            f"hf_ropekv does not recognise how '{name}' pairs the dimensions it rotates: its "
            f"{function.module.__name__}.{function.name} matches neither the rotate_half pairs (f, f + F) nor "
            "interleaved pairs (2f, 2f + 1). Use RecencyScorer, KeyNormScorer or RandomScorer instead.")
    _, layout, freqs = min(matches, key=lambda c: (c[0], c[1] != ROTATE_HALF))
    return freqs.detach().to("cpu", torch.float32).contiguous(), layout


def _cos_sin(rotary: nn.Module, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary module at ``position``, divided by its attention scaling (at position 0 the sine
    is 0 and the cosine is the scaling: that tells the outputs apart whatever their order)."""
    buffer = next(iter(rotary.buffers()), None)
    device = buffer.device if buffer is not None else torch.device("cpu")
    x = torch.ones(1, 1, 1, dtype=torch.float32, device=device)
    kwargs = {}
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # one set of frequencies per layer kind
        kinds = [n[: -len("_inv_freq")] for n, _ in rotary.named_buffers() if n.endswith("_inv_freq")]
        kwargs["layer_type"] = "full_attention" if "full_attention" in kinds or not kinds else kinds[0]
    first, second = (t.float() for t in rotary(x, torch.tensor([[position]], device=device), **kwargs))
    zero_first, zero_second = (t.float() for t in rotary(x, torch.tensor([[0]], device=device), **kwargs))
    if bool((zero_second == 0).all()):
        cos, sin, scale = first, second, zero_first
    else:
        cos, sin, scale = second, first, zero_second
    return cos / scale, sin / scale


def _rotate_basis(rotary: nn.Module, function: RotaryFunction, position: int,
                  widths: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """Per width the function accepts (``widths``, or the cos width and twice it: GPT-J's table holds one entry per
    pair), float64 CPU ``[R, R]`` whose row ``j`` is the model's RoPE at ``position`` applied to ``e_j``."""
    cos, sin = _cos_sin(rotary, position)
    heads_dim = function._call_layout[2]  # that of a call which does not name it
    tried, matrices = [], []
    for dims in widths or tuple(dict.fromkeys((cos.shape[-1], 2 * cos.shape[-1]))):
        basis = torch.eye(dims, dtype=torch.float32, device=cos.device)
        probe = basis[None, :, None, :] if heads_dim == 1 else basis[None, None, :, :]
        args = (probe, probe.clone()) if function.paired else (probe,)
        try:
            out = function.function(*args, cos=cos, sin=sin)
        except RuntimeError as err:  # the rotary part has another width
            tried.append(str(err).splitlines()[0])
            continue
        rotated = out[0] if isinstance(out, (tuple, list)) else out
        if rotated.shape != probe.shape:
            tried.append(f"width {dims} came back as {tuple(rotated.shape)}")
            continue
        rotated = rotated[0, :, 0, :] if heads_dim == 1 else rotated[0, 0, :, :]
        matrices.append(rotated.double().cpu())
    if not matrices:
        raise ValueError(f"hf_ropekv could not call {function.module.__name__}.{function.name} on a probe query "
                         f"({'; '.join(tried)}).")
    return matrices


def _measured_frequencies(rotary: nn.Module, function: RotaryFunction, layout: str, dims: int,
                          far: int) -> torch.Tensor:
    """Frequencies read from rotation angles at position 1, refined at doubling positions up to ``far``."""
    pairs = dims // 2
    stride, offset = pair_strides(layout, pairs)
    real = torch.arange(pairs) * stride
    imag = real + offset

    def angles(position: int) -> torch.Tensor:
        m = _rotate_basis(rotary, function, position, (dims,))[0]
        return torch.atan2(m[real, imag], m[real, real])

    omega = angles(1)
    position = 1
    while position * 2 <= far:
        position *= 2
        phase = angles(position)
        turns = torch.round((omega * position - phase) / (2 * math.pi))
        omega = (phase + 2 * math.pi * turns) / position
    return omega.clamp_min(0)


class _Patch:
    """A modeling module's rotary global replaced by a pass-through that shows calls to the active frames. Where the
    global is ``kernels``' ``nn.Module`` wrapper (transformers 5.25), its ``forward`` is replaced instead: the global
    stays the wrapper, which ``kernels`` rebuilds from its type when a model is unpickled."""

    def __init__(self, module: Any, name: str, original: Callable, key: int) -> None:
        self.module, self.name, self.original = module, name, original
        self.users = 0

        def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
            # Only the outermost pass-through delivers (another may sit inside `original`). Runs for every layer of
            # every forward: a few lookups.
            state = _TRACED if torch.compiler.is_compiling() else _LOCAL
            if state.depth == 0:
                frames = state.active.get(key)
                if frames:
                    if len(frames) == 1:
                        frames[0].see(args, kwargs)
                    else:
                        innermost = frames[-1].attention
                        for frame in frames:  # every capture attached to this attention module sees the call
                            if frame.attention is innermost:
                                frame.see(args, kwargs)
            state.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                state.depth -= 1

        apply_rotary_pos_emb._hf_ropekv_original = original  # type: ignore[attr-defined]
        self.wrapper = apply_rotary_pos_emb


class _FrameState:
    """Attention forwards in progress, per modeling module (innermost last), and the pass-throughs' nesting."""

    def __init__(self) -> None:
        self.active: dict[int, list[Any]] = {}
        self.depth = 0


class _ThreadFrames(_FrameState, threading.local):
    """Eager forwards: one state per thread."""


_LOCAL = _ThreadFrames()
#: Forwards traced by torch.compile (dynamo does not trace thread-locals on every torch version).
_TRACED = _FrameState()


def install(function: RotaryFunction) -> "_Patch":
    """Make the module global a pass-through (shared with its other users, or a new one over whatever is there
    now); returns the patch to hand to :func:`uninstall`."""
    # The frame lists exist before any forward: torch.compile then guards on a layout that stays.
    for state in (_LOCAL, _TRACED):
        state.active.setdefault(function.key, [])
    target, name = function.module, function.name
    if isinstance(getattr(target, name), nn.Module):  # kernels' wrapper (see _Patch): its forward, not the global
        target, name = getattr(target, name), "forward"
    current = getattr(target, name)
    patch = getattr(current, "_hf_ropekv_patch", None)
    if patch is None:
        patch = _Patch(target, name, current, function.key)
        patch.wrapper._hf_ropekv_patch = patch  # type: ignore[attr-defined]
        setattr(target, name, patch.wrapper)
    patch.users += 1
    return patch


def uninstall(patch: "_Patch") -> None:
    """Undo one :func:`install`: the original is back once the patch has no user left (unless the global was
    replaced since: then it is left alone)."""
    patch.users -= 1
    if patch.users <= 0 and getattr(patch.module, patch.name, None) is patch.wrapper:
        if isinstance(patch.module, nn.Module):  # the wrapper's own forward again (no bound method left behind)
            del patch.module.__dict__[patch.name]
        else:
            setattr(patch.module, patch.name, patch.original)


def frame_stack(key: int) -> list[Any]:
    """The attention forwards in progress (innermost last) of the rotary function filed under ``key``, this thread's
    or those being traced; each frame gets the rotary calls through ``frame.see(args, kwargs)``."""
    active = (_TRACED if torch.compiler.is_compiling() else _LOCAL).active
    stack = active.get(key)
    if stack is None:  # a thread that has not run a forward yet
        stack = active.setdefault(key, [])
    return stack


def pop_frame(frames: list[Any], frame: Any) -> None:
    """An attention forward ends: its frame leaves ``frames``, wherever it is (forwards may end out of order)."""
    if frames and frames[-1] is frame:
        frames.pop()
        return
    for i in range(len(frames) - 1, -1, -1):
        if frames[i] is frame:
            del frames[i]
            break
