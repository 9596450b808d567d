"""The one place that knows how transformers versions differ (5.17 through the newest 5.x):

- ``cache.update`` gets ``kwargs=`` (holding ``position_ids``) from 5.24; 5.24 renamed ``past_key_values`` to ``cache``;
- ``Cache.crop(n)`` with a positive ``n`` (the length to keep) is refused from 5.20;
- ``_get_static_cache_init_shape()`` (private) returns ints on 5.17 and per-layer lists later;
- ``StaticSlidingWindowLayer`` gains ``crop`` and ``is_croppable`` in 5.24 (``hf_ropekv.cache.window`` overrides
  every method whose behaviour differs);
- GPT-J and CodeGen keep a sin/cos table instead of a rotary module before 5.2x."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import StaticSlidingWindowLayer
from transformers.integrations import sdpa_attention

TRANSFORMERS_VERSION = Version(transformers.__version__)
sdpa_attention_forward = sdpa_attention.sdpa_attention_forward  # the same on every version

#: First version whose ``DynamicLayer.crop`` refuses a positive ``n``.
_POSITIVE_CROP_REFUSED_FROM = Version("5.20")

#: Keyword names under which a model's forward may receive the cache, newest first.
CACHE_KWARGS = ("cache", "past_key_values")


def cache_from_forward_kwargs(kwargs: dict[str, Any]) -> Any:
    """The cache a forward was given, under either of :data:`CACHE_KWARGS` (None: none)."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def position_ids_from_update(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``position_ids`` of the new tokens if this transformers version hands them to ``Cache.update``."""
    for source in (kwargs.get("kwargs"), kwargs):
        if isinstance(source, dict) and isinstance(source.get("position_ids"), torch.Tensor):
            return source["position_ids"]
    return None


def cache_kwarg(model: Any) -> str:
    """The keyword ``model.forward`` / ``generate`` takes the cache under: ``cache`` from 5.24 (no deprecation
    warning), else ``past_key_values`` (which still works there)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def falcon_broadcasts_kv_heads() -> bool:
    """Whether Falcon's new decoder architecture hands the cache its keys broadcast to every query head (up to
    5.24) rather than its ``num_kv_heads`` heads (5.25 on)."""
    from transformers.models.falcon import modeling_falcon

    return hasattr(modeling_falcon.FalconAttention, "_split_heads")


def register_attention(name: str, function: Any) -> None:
    """Register ``function`` as attention implementation ``name``, with the sdpa mask (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def static_init_shape(model: Any, num_layers: int) -> tuple[list[int], list[int]] | None:
    """Per decoder layer, the ``(kv heads, head_dim)`` of its keys on this rank as transformers works them out for a
    ``StaticCache``; ``None`` where it cannot tell."""
    if getattr(getattr(model, "config", None), "model_type", None) == "falcon":
        # The helper reads num_key_value_heads, which is not what Falcon hands the cache on every version: the
        # arenas are sized at the prefill instead, from the keys.
        return None
    get_shape = getattr(model, "_get_static_cache_init_shape", None)
    shape = get_shape() if callable(get_shape) else None
    if shape is None:
        return None
    heads, head_dim = (list(value) if isinstance(value, (list, tuple)) else [value] * num_layers for value in shape)
    return heads, head_dim


def init_static_sliding_layer(layer: Any, sliding_window: int) -> None:
    """Run transformers' ``StaticSlidingWindowLayer.__init__`` on ``layer`` for a window of ``sliding_window``
    tokens (its storage is exactly the window)."""
    StaticSlidingWindowLayer.__init__(layer, max_cache_len=sliding_window, sliding_window=sliding_window)
    layer.cumulative_length_int = 0  # the Python counter every version keeps; the static driver advances it
    layer.dtype = None  # 5.17 sets it at allocation only


def crop_target(length: int, n: int) -> int:
    """Tokens a layer holding ``length`` keeps after transformers' ``crop(n)`` (``n < 0`` removes ``-n``; a positive
    ``n`` is the length to keep, a ``ValueError`` from 5.20 as in ``DynamicCache``)."""
    n = int(n)  # assisted decoding passes a 0-d tensor on some versions
    if n > 0:
        if TRANSFORMERS_VERSION >= _POSITIVE_CROP_REFUSED_FROM:
            raise ValueError(f"crop({n}): transformers {transformers.__version__} takes the number of tokens to remove "
                             "as a negative int (crop(-k)); a positive length to keep is no longer accepted.")
        return min(n, length)
    return max(0, length + n)


class SinusoidTableRotary(torch.nn.Module):
    """The rotary module of GPT-J and CodeGen before transformers gave them one, from their attention's
    ``embed_positions`` table (``[max_positions, R]``: sines, then cosines): ``(x, position_ids) -> (sin, cos)``."""

    def __init__(self, table: torch.Tensor, modeling_module: str) -> None:
        super().__init__()
        self.register_buffer("embed_positions", table, persistent=False)
        self.modeling_module = modeling_module  # where the family's apply_rotary_pos_emb lives

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sincos = self.embed_positions[position_ids].to(x.dtype)
        return tuple(torch.split(sincos, sincos.shape[-1] // 2, dim=-1))  # type: ignore[return-value]


def modeling_module(config: Any) -> Any:
    """The modeling module beside a config's (``.../configuration_x.py`` -> ``.../modeling_x.py``), or None."""
    try:
        return importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None


def sinusoid_table_rotary(model_or_config: Any, config: Any) -> SinusoidTableRotary | None:
    """A :class:`SinusoidTableRotary` for a model (or config) whose attention keeps a sin/cos table, else None."""
    if isinstance(model_or_config, torch.nn.Module):
        for module in model_or_config.modules():
            table = getattr(module, "embed_positions", None)
            if isinstance(table, torch.Tensor) and table.ndim == 2 and hasattr(module, "rotary_dim"):
                return SinusoidTableRotary(table, type(module).__module__)
        return None
    modeling = modeling_module(config)
    build = getattr(modeling, "create_sinusoidal_positions", None)
    if build is None or not hasattr(config, "rotary_dim"):
        return None
    dim = config.rotary_dim or config.hidden_size
    return SinusoidTableRotary(build(config.max_position_embeddings, dim), modeling.__name__)
