"""The one place that knows how transformers versions differ (5.17 through the newest 5.x).

- ``cache.update(k, v, layer_idx)``: 5.17-5.23 pass nothing more; 5.24+ pass ``kwargs=`` (the attention
  module's kwargs, holding ``position_ids``).
- 5.24 renamed the forward/generate argument ``past_key_values`` to ``cache`` (the old name still works).
- ``Cache.crop(n)``: ``n < 0`` removes ``-n`` tokens and ``n == 0`` removes none on every version (generate's
  assisted decoding calls ``crop(-rejected)``, often ``crop(0)``). A positive ``n`` was the length to keep,
  deprecated through 5.19 (``DynamicLayer`` returns early when ``n >= length``); from 5.20 it raises.
- ``model._get_static_cache_init_shape()`` (5.17+, private): the per-rank key shape generate uses to initialise a
  ``StaticCache`` before a compiled prefill; an int pair on 5.17, per-layer lists on newer versions.
- ``StaticSlidingWindowLayer(max_cache_len, sliding_window)`` (5.17+): same constructor and Python counter
  (``cumulative_length_int``) on 5.17 and 5.24; 5.24 adds ``crop`` and an ``is_croppable`` property over
  ``_is_croppable``, 5.17 has neither (and its ``lazy_initialization`` sets ``dtype``). ``init_static_sliding_layer``
  runs the constructor; ``hf_ropekv.cache.window`` overrides every method whose behaviour differs.
- Attention functions: ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` on every version;
  5.24 folds grouped query heads for a masked decoding token in eager mode only (``pack_gqa``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401 - same on every version

TRANSFORMERS_VERSION = Version(transformers.__version__)

#: First version whose ``DynamicLayer.crop`` refuses a positive ``n`` (checked in the 5.19 and 5.20 wheels).
_POSITIVE_CROP_REFUSED_FROM = Version("5.20")

#: Keyword names under which a model's forward may receive the cache, newest first.
CACHE_KWARGS = ("cache", "past_key_values")


def cache_from_forward_kwargs(kwargs: dict[str, Any]) -> Any:
    """The cache object passed to a model forward, under either name."""
    for name in CACHE_KWARGS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def position_ids_from_update(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``position_ids`` of the new tokens if this transformers version hands them to ``Cache.update``."""
    inner = kwargs.get("kwargs")
    if isinstance(inner, dict) and isinstance(inner.get("position_ids"), torch.Tensor):
        return inner["position_ids"]
    if isinstance(kwargs.get("position_ids"), torch.Tensor):
        return kwargs["position_ids"]
    return None


def cache_kwarg(model: Any) -> str:
    """The keyword ``model.forward`` / ``generate`` takes the cache under: ``cache`` from 5.24, else ``past_key_values``.

    Passing the new name avoids 5.24's deprecation warning; the old one still works there, so it is also the
    answer when the signature cannot be read.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def falcon_broadcasts_kv_heads() -> bool:
    """Whether Falcon's new decoder architecture hands the cache its keys broadcast to every query head (up to
    transformers 5.24, whose ``FalconAttention`` split the fused projection with ``_split_heads``), rather than its
    ``num_kv_heads`` grouped heads (5.25 on)."""
    from transformers.models.falcon import modeling_falcon

    return hasattr(modeling_falcon.FalconAttention, "_split_heads")


def register_attention(name: str, function: Any) -> None:
    """Register ``function`` as attention implementation ``name``, with the sdpa mask (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def static_init_shape(model: Any, num_layers: int) -> tuple[list[int], list[int]] | None:
    """Per decoder layer, the ``(kv heads, head_dim)`` of its keys on this rank, as transformers itself works them
    out to initialise a ``StaticCache`` before a compiled prefill (ints on 5.17, per-layer lists on newer
    versions); ``None`` where it cannot tell (layers on several devices, MLA, uneven tensor-parallel shards)."""
    if getattr(getattr(model, "config", None), "model_type", None) == "falcon":
        # transformers' helper reads the config's num_key_value_heads, which is not what Falcon's attention hands
        # the cache on every version (multi-query: 1 head, config: every head, on 5.17; the new architecture up to
        # 5.24: its keys broadcast to every query head): the arenas are then sized at the prefill, from the keys.
        return None
    get_shape = getattr(model, "_get_static_cache_init_shape", None)
    shape = get_shape() if callable(get_shape) else None
    if shape is None:
        return None
    heads, head_dim = shape
    heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * num_layers
    head_dim = list(head_dim) if isinstance(head_dim, (list, tuple)) else [head_dim] * num_layers
    return heads, head_dim


def init_static_sliding_layer(layer: Any, sliding_window: int) -> None:
    """Run transformers' ``StaticSlidingWindowLayer.__init__`` on ``layer`` for a window of ``sliding_window`` tokens
    (its storage is then exactly the window: ``max_cache_len == sliding_window``), on every 5.x that has it."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    StaticSlidingWindowLayer.__init__(layer, max_cache_len=sliding_window, sliding_window=sliding_window)
    layer.cumulative_length_int = 0  # the Python counter both versions keep; the static driver advances it
    layer.dtype = None  # 5.17 sets it at allocation only; read before it by nothing here, defined on every version


def crop_target(length: int, n: int) -> int:
    """Tokens a layer holding ``length`` keeps after transformers' ``crop(n)``, under this version's convention.

    Raises:
        ValueError: for a positive ``n`` on transformers 5.20 and later, as ``DynamicCache`` does.
    """
    n = int(n)  # assisted decoding passes a 0-d tensor on some versions
    if n > 0:
        if TRANSFORMERS_VERSION >= _POSITIVE_CROP_REFUSED_FROM:
            raise ValueError(
                f"crop({n}): transformers {transformers.__version__} takes the number of tokens to remove as a "
                f"negative int (crop(-k)); a positive length to keep is no longer accepted."
            )
        return min(n, length)
    return max(0, length + n)


class SinusoidTableRotary(torch.nn.Module):
    """Stands in for the rotary module of GPT-J and CodeGen before transformers 5.2x gave them one: their
    attention modules hold an ``embed_positions`` table (``[max_positions, R]``: sines, then cosines). Called
    like the newer ``GPTJRotaryEmbedding``: ``(x, position_ids) -> (sin, cos)``."""

    def __init__(self, table: torch.Tensor, modeling_module: str) -> None:
        super().__init__()
        self.register_buffer("embed_positions", table, persistent=False)
        self.modeling_module = modeling_module  # where the family's apply_rotary_pos_emb lives

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sincos = self.embed_positions[position_ids].to(x.dtype)
        return tuple(torch.split(sincos, sincos.shape[-1] // 2, dim=-1))  # type: ignore[return-value]


def sinusoid_table_rotary(model_or_config: Any, config: Any) -> SinusoidTableRotary | None:
    """A :class:`SinusoidTableRotary` for models whose attention keeps a sin/cos table (GPT-J / CodeGen on
    transformers < 5.2x), from the model or, given a config, from the modeling module's table builder."""
    import importlib

    if isinstance(model_or_config, torch.nn.Module):
        for module in model_or_config.modules():
            table = getattr(module, "embed_positions", None)
            if isinstance(table, torch.Tensor) and table.ndim == 2 and hasattr(module, "rotary_dim"):
                return SinusoidTableRotary(table, type(module).__module__)
        return None
    name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        modeling = importlib.import_module(name)
    except ImportError:
        return None
    build = getattr(modeling, "create_sinusoidal_positions", None)
    if build is None or not hasattr(config, "rotary_dim"):
        return None
    dim = config.rotary_dim or config.hidden_size
    return SinusoidTableRotary(build(config.max_position_embeddings, dim), name)
