"""The model's own rotary application: where RoPE receives the query, and how it pairs dimensions.

Every RoPE family in transformers 5.x rotates queries and keys with a module-level function of its modeling
file, ``apply_rotary_pos_emb``, called from the attention module's forward. Two calling conventions exist:

- ``apply_rotary_pos_emb(q, k, cos, sin, ..., unsqueeze_dim=1)`` (Llama and almost every other family): the
  query is the first argument; it is ``[B, H, S, R]`` when ``unsqueeze_dim`` is 1, ``[B, S, H, R]`` when 2;
- ``apply_rotary_pos_emb(tensor, sin, cos)`` (GPT-J, CodeGen), and ``(x, cos, sin, unsqueeze_dim)``: one
  tensor per call, so the query is told apart by the order of the calls in the attention's source.

``R`` is what the caller hands over: the whole head, or only its rotary part on partial-rotary models.
This module finds that function (:func:`find_rotary_function`), calls it on probe vectors to learn the pair
layout and, where the rotary module has no ``inv_freq`` buffer, the frequencies (:func:`probe_rotary`).
"""

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

from .layouts import LAYOUTS, ROTATE_HALF

FUNCTION_NAME = "apply_rotary_pos_emb"


@dataclass(frozen=True)
class RotaryFunction:
    """The rotary function of a modeling module and how it is called.

    Attributes:
        module: the modeling module (``transformers.models.x.modeling_x``) whose global is the function.
        name: the global's name.
        function: the function itself (the unwrapped original).
        signature: its signature.
        paired: True for ``(q, k, cos, sin, ...)``, False for one tensor per call.
    """

    module: Any
    name: str
    function: Callable
    signature: inspect.Signature
    paired: bool

    def __deepcopy__(self, memo: dict) -> "RotaryFunction":
        return self  # immutable, and modules cannot be copied: a copied cache shares it

    @property
    def tensor_param(self) -> str:
        """Name of the parameter holding the query (paired) or the tensor (one per call)."""
        return next(iter(self.signature.parameters))

    def __post_init__(self) -> None:
        # Read once from the signature: the per-call path then touches plain values only (torch.compile traces
        # it without a graph break; a signature's mapping proxy would break it).
        object.__setattr__(self, "_call_layout", self._read_call_layout())
        object.__setattr__(self, "key", id(self.module))  # frames are filed by module; dynamo cannot id() a module

    def _read_call_layout(self) -> tuple[str, int | None, int]:
        """``(tensor_param, unsqueeze_dim's position or None, its default)``."""
        params = self.signature.parameters
        if "unsqueeze_dim" not in params:
            return self.tensor_param, None, 1 if self.paired else 2
        default = params["unsqueeze_dim"].default
        return self.tensor_param, list(params).index("unsqueeze_dim"), 1 if default is inspect.Parameter.empty else int(default)

    def query_and_heads_dim(self, args: tuple, kwargs: dict) -> tuple[Any, int]:
        """The query (or tensor) of one call and the dim holding its heads (1: ``[B, H, S, R]``, 2: ``[B, S, H, R]``).

        Read from the arguments directly: this runs for every layer of every forward while attached.
        (q, k, cos, sin): HF's [B, H, S, R]; (tensor, sin, cos): sin[:, :, None, :] broadcasts over dim 2.
        """
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
    """The plain function behind HuggingFace ``kernels``' wrapper of it, else ``function``.

    From transformers 5.25, whose dependencies include HuggingFace's ``kernels`` package, ``apply_rotary_pos_emb``
    is decorated with ``use_kernel_forward_from_hub``, which turns the function into an ``nn.Module`` instance
    (``kernels``' ``Func``) whose ``forward(*args, **kwargs)`` calls the original, closed over as ``func``. Calls
    still go through the module global (the wrapper); only the calling convention is read from the original.
    """
    if not isinstance(function, nn.Module):
        return function
    forward = getattr(type(function), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or cells is None or "func" not in code.co_freevars:
        return function
    inner = cells[code.co_freevars.index("func")].cell_contents
    return inner if callable(inner) and not isinstance(inner, nn.Module) else function


def query_call_index(attention_cls: type, function: RotaryFunction) -> int | None:
    """For one-tensor-per-call functions: which call of each attention forward rotates the query (0 or 1).

    Read from the forward's source: the calls in source order, each classified by its first argument's name
    (``q...`` / ``query...`` against ``k...`` / ``key...``). ``None`` if the source does not show a repeated
    (query, key) pattern.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(attention_cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    kinds = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == function.name and node.args:
            arg = node.args[0]
            name = arg.id if isinstance(arg, ast.Name) else ""
            kinds.append((node.lineno, node.col_offset, "q" if name.startswith("q") else "k" if name.startswith("k") else "?"))
    pattern = "".join(kind for *_, kind in sorted(kinds))
    for unit in ("qk", "kq"):
        if pattern and pattern == unit * (len(pattern) // 2):
            return unit.index("q")
    return None


# ---------------------------------------------------------------------- probing the model's own RoPE
@dataclass(frozen=True)
class RotaryProbe:
    """What calling the model's rotary application on basis vectors showed.

    Attributes:
        layout: ``"rotate_half"`` or ``"interleaved"``.
        inv_freq: float32 ``[F]``, the frequencies the rotation applies (from the rotary module's ``inv_freq``
            when it has one, else measured from the rotation angles).
    """

    layout: str
    inv_freq: torch.Tensor


def rotary_matrix(dims: int, layout: str, inv_freq: torch.Tensor, position: int) -> torch.Tensor:
    """float64 ``[dims, dims]``: row ``j`` is RoPE at ``position`` applied to the basis vector ``e_j``.

    Pair ``f`` (dims ``r``, ``i`` of ``layout``) turns by ``theta = omega_f * position``:
    ``e_r -> cos e_r + sin e_i`` and ``e_i -> -sin e_r + cos e_i`` (``x_f = x_r + i x_i`` times ``e^{i theta}``).
    Dims beyond the pairs stay as they are.
    """
    pairs = inv_freq.numel()
    stride, offset = (1, pairs) if layout == ROTATE_HALF else (2, 1)
    m = torch.eye(dims, dtype=torch.float64)
    theta = inv_freq.double() * position
    for f in range(pairs):
        r, i = f * stride, f * stride + offset
        c, s = math.cos(theta[f]), math.sin(theta[f])
        m[r, r], m[r, i], m[i, r], m[i, i] = c, s, -s, c
    return m


def probe_rotary(
    rotary: nn.Module,
    function: RotaryFunction,
    inv_freq: torch.Tensor | None,
    max_position: int | None,
    name: str,
) -> RotaryProbe:
    """Learn the pair layout (and, without ``inv_freq``, the frequencies) from the model's own RoPE.

    Raises:
        ValueError: if the rotation matches neither known layout, naming the model.
    """
    # Far enough that every pair turns by a visible angle, inside tables of precomputed positions (GPT-J).
    far = 1000 if max_position is None else max(2, min(1000, int(max_position) - 1))
    with torch.no_grad():
        candidates = []
        for at_far in _rotate_basis_widths(rotary, function, far):
            dims = at_far.shape[-1]
            for layout in LAYOUTS:
                if inv_freq is not None:
                    freqs = inv_freq
                else:
                    freqs = _measured_frequencies(rotary, function, layout, dims, far)
                if 2 * freqs.numel() > dims:
                    continue
                error = (at_far - rotary_matrix(dims, layout, freqs.float(), far)).abs().max().item()
                candidates.append((error, layout, freqs))
    matches = [c for c in candidates if c[0] < 1e-3]
    if not matches:
        raise ValueError(
            f"hf_ropekv does not recognise how '{name}' pairs the dimensions it rotates: its "
            f"{function.module.__name__}.{function.name} matches neither the rotate_half pairs (f, f + F) nor "
            "interleaved pairs (2f, 2f + 1). Use RecencyScorer, KeyNormScorer or RandomScorer instead."
        )
    _, layout, freqs = min(matches, key=lambda c: (c[0], c[1] != ROTATE_HALF))
    return RotaryProbe(layout=layout, inv_freq=freqs.detach().to("cpu", torch.float32).contiguous())


def _cos_sin(rotary: nn.Module, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary module at ``position``, divided by its attention scaling.

    At position 0 the sine is 0 and the cosine is the scaling (1, or YaRN's attention factor): that tells the
    two outputs apart whatever order the module returns them in, and gives the scaling to divide out (it
    multiplies every score of a head alike).
    """
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


def _rotate_basis(rotary: nn.Module, function: RotaryFunction, position: int, dims: int | None = None) -> torch.Tensor:
    """Row ``j``: the model's RoPE at ``position`` applied to ``e_j`` (float64 CPU ``[R, R]``).

    ``R`` is ``dims`` or the first width the function accepts: the rotary module's output width or twice it
    (GPT-J's table holds one entry per pair).
    """
    matrices = _rotate_basis_widths(rotary, function, position, None if dims is None else (dims,))
    return matrices[0]


def _rotate_basis_widths(
    rotary: nn.Module, function: RotaryFunction, position: int, widths: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """:func:`_rotate_basis` for every width the function accepts (the cos width and twice it)."""
    cos, sin = _cos_sin(rotary, position)
    heads_dim = 1 if function.paired else 2
    if "unsqueeze_dim" in function.signature.parameters:
        heads_dim = int(function.signature.parameters["unsqueeze_dim"].default)
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
        raise ValueError(
            f"hf_ropekv could not call {function.module.__name__}.{function.name} on a probe query ({'; '.join(tried)})."
        )
    return matrices


def _measured_frequencies(
    rotary: nn.Module, function: RotaryFunction, layout: str, dims: int, far: int
) -> torch.Tensor:
    """Frequencies read from rotation angles, as ``layout`` pairs dims: at position 1 (angles below pi), then
    refined at doubling positions up to ``far`` (each unwrapped by the previous estimate)."""
    pairs = dims // 2
    stride, offset = (1, pairs) if layout == ROTATE_HALF else (2, 1)
    real = torch.arange(pairs) * stride
    imag = real + offset

    def angles(position: int) -> torch.Tensor:
        m = _rotate_basis(rotary, function, position, dims)
        return torch.atan2(m[real, imag], m[real, real])

    omega = angles(1)
    position = 1
    while position * 2 <= far:
        position *= 2
        phase = angles(position)
        turns = torch.round((omega * position - phase) / (2 * math.pi))
        omega = (phase + 2 * math.pi * turns) / position
    return omega.clamp_min(0)


# ---------------------------------------------------------------------- intercepting it during a forward
class _Patch:
    """A modeling module's rotary global replaced by a pass-through that shows calls to active frames.

    ``module.name`` is what gets replaced: the module global itself, or, where the global is HuggingFace
    ``kernels``' ``nn.Module`` wrapper of the function (transformers 5.25), that instance's ``forward``. The global
    then stays the wrapper, which ``kernels`` needs: it rebuilds the wrapper from the global's type when a model is
    unpickled (``torch.load`` of a model saved while a cache was attached).
    """

    def __init__(self, module: Any, name: str, original: Callable, tensor_param: str, key: int) -> None:
        self.module, self.name, self.original = module, name, original
        self.users = 0
        # key: the modeling module's id, read here: the pass-through runs inside compiled forwards, where id(module)
        # cannot be traced

        def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
            # Only the outermost pass-through delivers: another may sit inside `original` (the global was
            # wrapped again by someone else, then by us). Runs for every layer of every forward: kept to a few
            # lookups (the state inline, one frame without a loop).
            state = _TRACED if torch.compiler.is_compiling() else _LOCAL.state
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


class _ThreadFrames(threading.local):
    def __init__(self) -> None:
        self.state = _FrameState()


_LOCAL = _ThreadFrames()  # eager forwards: one state per thread
#: The state of forwards being traced by torch.compile: dynamo does not trace thread-locals on every torch
#: version, and a traced forward pushes and pops its frames within the trace.
_TRACED = _FrameState()


def install(function: RotaryFunction) -> "_Patch":
    """Make the module global a pass-through; returns the patch to hand to :func:`uninstall`.

    Users share the pass-through that is in place; if the global is something else (first use, or someone
    replaced it since, e.g. a test's monkeypatch), a new pass-through wraps whatever is there now.
    """
    # The frame lists exist before any forward: torch.compile then guards on a layout that stays.
    for state in (_LOCAL.state, _TRACED):
        state.active.setdefault(function.key, [])
    target, name = function.module, function.name
    if isinstance(getattr(target, name), nn.Module):  # kernels' wrapper (see _Patch): its forward, not the global
        target, name = getattr(target, name), "forward"
    current = getattr(target, name)
    patch = getattr(current, "_hf_ropekv_patch", None)
    if patch is None:
        patch = _Patch(target, name, current, function.tensor_param, function.key)
        patch.wrapper._hf_ropekv_patch = patch  # type: ignore[attr-defined]
        setattr(target, name, patch.wrapper)
    patch.users += 1
    return patch


def uninstall(patch: "_Patch") -> None:
    """Undo one :func:`install`; the wrapped function is back once the patch has no user left (unless the
    global was replaced since: then it is left alone)."""
    patch.users -= 1
    if patch.users <= 0 and getattr(patch.module, patch.name, None) is patch.wrapper:
        if isinstance(patch.module, nn.Module):  # the wrapper's own forward again (no bound method left behind)
            del patch.module.__dict__[patch.name]
        else:
            setattr(patch.module, patch.name, patch.original)


def frame_stack(key: int) -> list[Any]:
    """The attention forwards in progress (innermost last) whose rotary function is filed under ``key``
    (``RotaryFunction.key``): this thread's, or those of the forward being traced. An attention forward pushes its
    frame here; ``frame.see(args, kwargs)`` then gets the rotary calls (``frame.attention``: the module)."""
    active = (_TRACED if torch.compiler.is_compiling() else _LOCAL.state).active
    stack = active.get(key)
    if stack is None:  # a thread that has not run a forward yet
        stack = active.setdefault(key, [])
    return stack


def pop_frame(frames: list[Any], frame: Any) -> None:
    """An attention forward ends: its frame leaves ``frames`` (its :func:`frame_stack`), wherever it is in it, should
    forwards end out of order."""
    if frames and frames[-1] is frame:  # the usual case: the innermost forward ends
        frames.pop()
        return
    for i in range(len(frames) - 1, -1, -1):
        if frames[i] is frame:
            del frames[i]
            break
