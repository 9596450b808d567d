"""What the cache needs to know about a model: attention geometry, layer kinds, RoPE frequencies and pair layout,
read from its own config and rotary module (so scaled and partial RoPE come out as the model applies them)."""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.configuration_utils import PretrainedConfig

if TYPE_CHECKING:  # annotations only: importing it loads transformers' model-loading code
    from transformers import PreTrainedModel

from .. import _compat
from .rotary import find_rotary_function, probe_rotary

FULL = "full_attention"
SLIDING = "sliding_attention"
_SUPPORTED_LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry and RoPE setting of a decoder-only model. ``layer_types`` holds ``"full_attention"`` or
    ``"sliding_attention"`` per layer, ``sliding_windows`` a sliding layer's window (else ``None``); the RoPE fields are
    those of the full-attention layers, ``inv_freq`` a float32 CPU ``[F]`` (``rotary_dim = 2F`` may be below
    ``head_dim``). ``rotary_layout`` is ``None`` when it could not be learned, with the reason in ``rotary_problem``
    (then only scorers without query statistics work)."""

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_windows: tuple[int | None, ...]
    rope_type: str
    rope_theta: float | None
    rope_parameters: dict[str, Any] = field(hash=False)
    inv_freq: torch.Tensor = field(hash=False, repr=False)
    rotary_layout: str | None = "rotate_half"
    rotary_problem: str | None = None

    def require_rotary_layout(self) -> str:
        """The rotary layout, or ``ValueError`` with the reason it is unknown and the scorers that still work."""
        if self.rotary_layout is None:
            raise ValueError(
                f"{self.rotary_problem} The RoPE scorer needs it; RecencyScorer, KeyNormScorer, RandomScorer "
                "(hf_ropekv.scorers) work without query statistics, and budget=None never evicts.")
        return self.rotary_layout

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element


_SHARED_GEOMETRY: "weakref.WeakKeyDictionary[nn.Module, ModelGeometry]" = weakref.WeakKeyDictionary()


def shared_geometry(model: nn.Module, geometry: ModelGeometry) -> ModelGeometry:
    """One geometry object per model while it stays the same, so that a compiled forward (which guards on the
    identity of what it reads) is not recompiled for every new cache."""
    def key(g: ModelGeometry) -> tuple:
        return tuple(getattr(g, f.name) for f in fields(g) if f.name != "inv_freq") + (g.inv_freq.tolist(),)

    known = _SHARED_GEOMETRY.get(model)
    if known is not None and key(known) == key(geometry):
        return known
    _SHARED_GEOMETRY[model] = geometry
    return geometry


def describe(model_or_config: PreTrainedModel | PretrainedConfig) -> ModelGeometry:
    """The attention geometry and RoPE frequencies of a decoder-only RoPE model (or its config). Raises ``TypeError``
    for anything else, and ``ValueError`` naming the problem for models the cache cannot hold (encoder-decoder,
    cross-attention, no RoPE, layer kinds other than full and sliding attention)."""
    config = model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config
    if not isinstance(config, PretrainedConfig):
        raise TypeError("Expected a transformers PreTrainedModel or PretrainedConfig, got "
                        f"{type(model_or_config).__name__}. Pass the model itself (recommended) or `model.config`.")
    config = config.get_text_config(decoder=True)  # multimodal configs nest the decoder's
    name = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"hf_ropekv supports decoder-only models; '{name}' is an encoder-decoder model. Use a "
                         "decoder-only RoPE model (Llama, Qwen2/3, Mistral, Gemma3, ...).")
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"'{name}' is configured with cross-attention (add_cross_attention=True); hf_ropekv only "
                         "compresses self-attention caches of decoder-only models.")
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(
            f"'{name}' uses multi-head latent attention (kv_lora_rank={config.kv_lora_rank}: DeepSeek-V2/V3 style), "
            "whose keys hold a non-rotary part before a shared rotary part; hf_ropekv does not support it yet.")
    if getattr(config, "alibi", False):
        raise ValueError(
            f"'{name}' is configured with ALiBi position biases (alibi=True), not rotary position embeddings; "
            "hf_ropekv scores keys from RoPE geometry and needs a RoPE model (Falcon with alibi=False, Llama, ...).")
    num_layers, num_q_heads = config.num_hidden_layers, config.num_attention_heads
    if name != "falcon":
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    elif getattr(config, "new_decoder_architecture", False):  # Falcon: the KV heads the cache receives, per layout
        # up to transformers 5.24 the attention broadcast its num_kv_heads keys to every query head first
        num_kv_heads = num_q_heads if _compat.falcon_broadcasts_kv_heads() else config.num_kv_heads
    else:
        num_kv_heads = 1 if getattr(config, "multi_query", False) else config.num_kv_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads

    window = getattr(config, "sliding_window", None)
    # Without layer_types, Mistral-style configs make every layer sliding through that one field.
    default_kind = SLIDING if window is not None and getattr(config, "use_sliding_window", True) else FULL
    layer_types = tuple(getattr(config, "layer_types", None) or [default_kind] * num_layers)
    unsupported = sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(f"'{name}' has layers of kind {unsupported}; hf_ropekv handles only full and sliding-window "
                         "attention layers.")
    sliding_windows = tuple(window if t == SLIDING else None for t in layer_types)

    rotary = _rotary_module(model_or_config, config, name)
    inv_freq, layout, problem = _frequencies_and_layout(rotary, config, name)
    nope = [i for i in _layers_without_rope(config, layer_types) if layer_types[i] == FULL]
    if nope and layout is not None:
        layout, problem = None, (f"'{name}' applies no RoPE in its full-attention layers {nope} (NoPE layers), so "
                                 "their keys carry no rotary phase for the RoPE scorer to read.")
    if 2 * inv_freq.numel() > head_dim:
        raise ValueError(f"'{name}': rotary dim {2 * inv_freq.numel()} exceeds head_dim {head_dim}.")
    rope = _full_attention_rope_parameters(config)
    return ModelGeometry(
        model_type=name, num_layers=num_layers, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        layer_types=layer_types, sliding_windows=sliding_windows, rope_type=str(rope.get("rope_type", "default")),
        rope_theta=rope.get("rope_theta"), rope_parameters=json.loads(json.dumps(rope, default=str)),
        inv_freq=inv_freq, rotary_layout=layout, rotary_problem=problem)


def _layers_without_rope(config: PretrainedConfig, layer_types: tuple[str, ...]) -> list[int]:
    """Layers whose attention skips RoPE, as the config tells it (the capture checks it at run time too)."""
    flags = getattr(config, "no_rope_layers", None)  # SmolLM3, Llama 4: 1 = RoPE, 0 = NoPE
    if isinstance(flags, (list, tuple)) and len(flags) == len(layer_types):
        return [i for i, use in enumerate(flags) if not use]
    # Cohere2 and EXAONE 4 rotate only in their sliding-window layers once a window is configured.
    if getattr(config, "model_type", None) in ("cohere2", "exaone4") and getattr(config, "sliding_window", None):
        return [i for i, kind in enumerate(layer_types) if kind != SLIDING]
    return []


def _frequencies_and_layout(rotary: nn.Module, config: PretrainedConfig,
                            name: str) -> tuple[torch.Tensor, str | None, str | None]:
    """``(inv_freq, layout, problem)`` from the rotary module's buffer and a probe of the model's own RoPE."""
    if any(b.is_meta for b in rotary.buffers()):  # not materialised: rebuild it from the config
        rebuilt = _rotary_from_config(config)
        rotary = rotary if rebuilt is None else rebuilt
    rotary = _on_cpu(rotary)
    buffer = _full_attention_inv_freq(rotary)
    function = find_rotary_function(getattr(rotary, "modeling_module", type(rotary).__module__))
    if function is None:
        problem = (f"hf_ropekv could not find how '{name}' applies RoPE: {type(rotary).__module__} has no "
                   "apply_rotary_pos_emb(q, k, cos, sin) or apply_rotary_pos_emb(tensor, sin, cos).")
    else:
        try:
            inv_freq, layout = probe_rotary(rotary, function, None if buffer is None else buffer.float(),
                                            getattr(config, "max_position_embeddings", None), name)
            return inv_freq, layout, None
        except ValueError as err:
            problem = str(err)
    if buffer is None:
        raise ValueError(f"Could not find the RoPE frequencies (inv_freq) of '{name}' on {type(rotary).__name__}: "
                         f"{problem}")
    return buffer.detach().to("cpu", torch.float32).contiguous(), None, problem


def _on_cpu(rotary: nn.Module) -> nn.Module:
    """The rotary module to probe: a CPU copy of one on another device. Probing on a GPU launches float32 kernels the
    model never runs (in a fresh process each is loaded first: about 0.1 s of the first token on an H100) and waits
    for them; the CPU gives the same frequencies and layout."""
    devices = {t.device.type for t in (*rotary.buffers(), *rotary.parameters())}
    return rotary if devices <= {"cpu"} or "meta" in devices else _cpu_copy(rotary)


def _cpu_copy(rotary: nn.Module) -> nn.Module:
    """A copy of ``rotary`` on the CPU sharing its config (``rotary`` itself if it cannot be copied)."""
    # The copy's tensors are made on the CPU directly (a copy on the GPU would be a kernel too); the config is shared.
    memo: dict[int, Any] = {id(value): value for value in vars(rotary).values() if isinstance(value, PretrainedConfig)}
    tensors = (*rotary.buffers(), *(v for v in vars(rotary).values() if isinstance(v, torch.Tensor)))
    memo.update((id(t), t.detach().to("cpu", copy=True)) for t in tensors)
    memo.update((id(p), nn.Parameter(p.detach().to("cpu", copy=True), p.requires_grad)) for p in rotary.parameters())
    try:
        return copy.deepcopy(rotary, memo)
    except (TypeError, RuntimeError):  # a module that cannot be copied is probed where it is
        return rotary


def _full_attention_rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and FULL in params and isinstance(params[FULL], dict):
        params = params[FULL]  # per-layer-type RoPE (Gemma3)
    params = dict(params)
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _rotary_module(model_or_config: PreTrainedModel | PretrainedConfig, config: PretrainedConfig,
                   name: str) -> nn.Module:
    """The model's own rotary-embedding module (from the model, or built from the config on CPU)."""
    if isinstance(model_or_config, nn.Module):
        rotary = next((m for m in model_or_config.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    else:
        rotary = _rotary_from_config(config)
    if rotary is None:
        rotary = _compat.sinusoid_table_rotary(model_or_config, config)  # GPT-J / CodeGen before 5.2x
    if rotary is not None:
        return rotary
    raise ValueError(f"'{name}' has no rotary position embedding (RoPE); hf_ropekv reads a model's attention geometry "
                     "from its rotary embedding, so it refuses this model whatever the scorer. Keep transformers' "
                     "DynamicCache for it, or use a RoPE model (Llama, Qwen2/3, Mistral, Gemma3, ...).")


def _rotary_from_config(config: PretrainedConfig) -> nn.Module | None:
    """The family's rotary-embedding module built from ``config`` on the CPU (None if its class is not found)."""
    module = _compat.modeling_module(config)
    if module is None:
        return None
    candidates = [obj for attr, obj in vars(module).items()
                  if attr.endswith("RotaryEmbedding") and isinstance(obj, type) and issubclass(obj, nn.Module)]
    # Prefer the text model's class when a modeling file defines several (e.g. vision + text).
    candidates.sort(key=lambda c: ("Vision" in c.__name__, len(c.__name__)))
    if not candidates:
        return None
    with torch.device("cpu"):
        return candidates[0](config=config)


def _full_attention_inv_freq(rotary: nn.Module) -> torch.Tensor | None:
    # A model whose layers are all sliding windows still has frequencies: take those.
    names = ["inv_freq", f"{FULL}_inv_freq"] + [n for n, _ in rotary.named_buffers() if n.endswith("_inv_freq")]
    for attr in names:
        value = getattr(rotary, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    return None  # GPT-J / CodeGen keep a sin/cos table: the probe measures the frequencies
