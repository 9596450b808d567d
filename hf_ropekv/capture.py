"""Deliver each decoder layer's query exactly as RoPE receives it, from forward hooks (no recomputation).

The query RoPE rotates is the output of the attention module's query norm on QK-norm models (``q_norm``:
Qwen3, Gemma3, OLMo2; ``q_layernorm``: StableLM), else the output of ``q_proj``. Hooks sit on those
modules' outputs only, so weight-quantized linears (bitsandbytes, quanto) work unchanged.

Layouts seen in transformers 5.17 / 5.24: ``q_proj`` gives ``[B, S, H*D]``; Qwen3 applies ``q_norm`` to
``[B, S, H, D]``; Gemma3 and StableLM apply it after ``transpose(1, 2)``, to ``[B, H, S, D]``; OLMo2 to
``[B, S, H*D]``. Every one is handed to the callback as ``[B, S, H, D]``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .model_info import ModelGeometry

QUERY_NORM_NAMES = ("q_norm", "q_layernorm")
_ATTENTION_NAMES = ("self_attn", "attention", "attn")

QueryCallback = Callable[[int, torch.Tensor], None]


def find_attention_modules(model: nn.Module, geometry: ModelGeometry | None = None) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order.

    Looks at the decoder's ``layers`` first (``model.get_decoder().layers[i].self_attn``), then at any module
    with a ``q_proj`` and an integer ``layer_idx``.

    Raises:
        ValueError: if no such modules are found, or not one per decoder layer of ``geometry``.
    """
    modules = _from_decoder_layers(model) or _from_layer_idx(model)
    name = type(model).__name__
    if not modules:
        raise ValueError(
            f"hf_ropekv could not find the query projection of {name}: no decoder layer has an attention module "
            "with a `q_proj` linear (fused QKV projections are not supported). Supported: Llama, Qwen2/3, "
            "Mistral, Gemma3 and other models whose attention has q_proj."
        )
    if geometry is not None and len(modules) != geometry.num_layers:
        raise ValueError(
            f"hf_ropekv could not find the query projection of every layer of {name}: found {len(modules)} "
            f"attention modules with `q_proj` for {geometry.num_layers} decoder layers."
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
    candidates += [model, getattr(model, "model", None)]
    for owner in candidates:
        layers = getattr(owner, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            continue
        found = []
        for layer in layers:
            attn = next((getattr(layer, n) for n in _ATTENTION_NAMES if hasattr(layer, n)), None)
            if attn is None or not isinstance(getattr(attn, "q_proj", None), nn.Module):
                break
            found.append(attn)
        else:
            return found
    return []


def _from_layer_idx(model: nn.Module) -> list[nn.Module]:
    by_index: dict[int, nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(getattr(module, "q_proj", None), nn.Module) and isinstance(idx, int):
            if idx in by_index:
                raise ValueError(
                    f"hf_ropekv could not find the query projection of {type(model).__name__} unambiguously: "
                    f"several attention modules claim layer_idx {idx}."
                )
            by_index[idx] = module
    if sorted(by_index) != list(range(len(by_index))):
        return []
    return [by_index[i] for i in range(len(by_index))]


def query_source(attention: nn.Module) -> tuple[str, nn.Module]:
    """``(attribute name, module)`` whose output is the pre-RoPE query: the query norm if any, else q_proj."""
    for name in QUERY_NORM_NAMES:
        module = getattr(attention, name, None)
        if isinstance(module, nn.Module):
            return name, module
    return "q_proj", attention.q_proj


class QueryCapture:
    """Forward hooks that call ``callback(layer_idx, q)`` with every layer's pre-RoPE query ``[B, S, H_q, D]``.

    The tensor handed over is the module's own output (or a view of it): read it, do not modify it.

    Example::

        with QueryCapture(model, describe(model), lambda i, q: acc.add(i, q)):
            model(input_ids, use_cache=False)
    """

    def __init__(self, model: nn.Module, geometry: ModelGeometry, callback: QueryCallback) -> None:
        self.geometry = geometry
        self.callback = callback
        self.attention_modules = find_attention_modules(model, geometry)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> "QueryCapture":
        """Register the hooks (idempotent)."""
        if self._handles:
            return self
        for layer_idx, attention in enumerate(self.attention_modules):
            name, source = query_source(attention)
            if name == "q_proj":
                self._handles.append(source.register_forward_hook(self._projection_hook(layer_idx)))
            else:
                where = f"{type(attention).__name__}.{name}"
                layout = _NormLayout(self.geometry.num_q_heads, self.geometry.head_dim, where)
                self._handles.append(source.register_forward_pre_hook(layout.see_input))
                self._handles.append(source.register_forward_hook(self._norm_hook(layer_idx, layout)))
        return self

    def detach(self) -> None:
        """Remove the hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "QueryCapture":
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def _projection_hook(self, layer_idx: int) -> Callable:
        heads, head_dim = self.geometry.num_q_heads, self.geometry.head_dim

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if output.shape[-1] != heads * head_dim:
                raise ValueError(
                    f"q_proj of layer {layer_idx} returned {tuple(output.shape)}; expected last dim "
                    f"{heads} heads x {head_dim} = {heads * head_dim}."
                )
            self.callback(layer_idx, output.unflatten(-1, (heads, head_dim)))

        return hook

    def _norm_hook(self, layer_idx: int, layout: "_NormLayout") -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self.callback(layer_idx, layout.to_bshd(output))

        return hook


class _NormLayout:
    """Turns a query-norm output into ``[B, S, H, D]`` whichever layout the model normalises in.

    ``[B, S, H, D]`` and ``[B, H, S, D]`` are told apart by which of dims 1 and 2 has ``H`` entries. When both
    do (``S == H``) the layout found on an earlier call is used, else the strides of the norm's input: the
    input is a view of the ``q_proj`` output, so heads-first means ``transpose(1, 2)`` was applied.
    """

    def __init__(self, heads: int, head_dim: int, name: str) -> None:
        self.heads, self.head_dim, self.name = heads, head_dim, name
        self.heads_first: bool | None = None  # learned from the first unambiguous call
        self._input_heads_first = False

    def see_input(self, module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.ndim == 4:
            self._input_heads_first = x.stride(1) < x.stride(2)

    def to_bshd(self, q: torch.Tensor) -> torch.Tensor:
        h, d = self.heads, self.head_dim
        if q.ndim == 3 and q.shape[-1] == h * d:  # normalised before the head split (OLMo2)
            return q.unflatten(-1, (h, d))
        if q.ndim == 4 and q.shape[-1] == d and h in (q.shape[1], q.shape[2]):
            if q.shape[1] == h and q.shape[2] == h:
                heads_first = self.heads_first if self.heads_first is not None else self._input_heads_first
            else:
                heads_first = q.shape[1] == h
                self.heads_first = heads_first
            return q.transpose(1, 2) if heads_first else q
        raise ValueError(
            f"{self.name} returned a query of shape {tuple(q.shape)}; hf_ropekv expects [batch, seq, {h}, {d}], "
            f"[batch, {h}, seq, {d}] or [batch, seq, {h * d}]."
        )
