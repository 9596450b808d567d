"""Random-weight models of real shapes, built fast and without a CPU copy.

The model is created on the ``meta`` device (no memory, no init), then each decoder layer is materialised on the
target device, initialised (normal(0, 0.02) for matrices and embeddings, ones for norms, zeros for biases)
and, if asked, weight-quantized with optimum-quanto right away, before the next layer exists. The peak while
building is therefore the finished model plus one bf16 layer: a Qwen3-32B shape quantized to int4 is built
inside a 24 GB cap. Random weights are exact for speed and memory (not for quality).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

# Shapes of the published configs (config.json of each model), written out: the GPU machine has no hub access.
_QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=False,
    use_sliding_window=False,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        _QWEN3_COMMON,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        _QWEN3_COMMON,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        tie_word_embeddings=False,
    ),
    # Qwen3-1.7B's shape; its real config ties the embeddings, untied here (same cache behaviour, simpler build).
    "qwen3-1.7b": dict(
        _QWEN3_COMMON,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=False,
    ),
    # Dry-run stand-ins: same architecture, tiny.
    "tiny": dict(
        _QWEN3_COMMON,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # Qwen3-8B's depth (36 layers, so as many hooks and per-layer ops as the real model) with negligible compute:
    # the host's work per decode step (benchmarks/host_overhead.py).
    "tiny-deep": dict(
        _QWEN3_COMMON,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    # Large enough for quanto's int4 group size (128) and its bf16 "tinygemm" kernels, like the 32B model.
    "tiny-int4": dict(
        _QWEN3_COMMON,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    ),
}


def make_config(shape: str):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3", **SHAPES[shape])


def shape_summary(config) -> dict[str, Any]:
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "q_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab": config.vocab_size,
    }


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Layers x (K and V) x KV heads x head_dim x element size: one token of a full cache, one row."""
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element


def _quanto_qtype(name: str):
    from optimum.quanto import qint4, qint8

    return {"int4": qint4, "int8": qint8}[name]


@torch.no_grad()
def _init_module_params(module: nn.Module, std: float, generator: torch.Generator) -> None:
    for name, param in module.named_parameters(recurse=False):
        if "norm" in name or (param.ndim == 1 and "bias" not in name):
            param.fill_(1.0)
        elif "bias" in name:
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)


@torch.no_grad()
def build_random_model(
    config,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantize: str | None = None,
    int4_grouping: str = "auto",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> nn.Module:
    """A random-weight ``AutoModelForCausalLM`` of ``config`` on ``device``, in eval mode, sdpa attention.

    Args:
        quantize: ``None``, ``"int8"`` or ``"int4"``: quantize every decoder layer's linears with optimum-quanto
            (``quantize`` + ``freeze``) as soon as it is built; the embeddings and ``lm_head`` stay in ``dtype``
            (transformers' ``QuantoConfig`` also leaves ``lm_head`` alone).
        int4_grouping: ``"auto"``: quanto's own choice (groups of 128 along the input features; with bf16 weights on
            a CUDA GPU of compute capability >= 8 or on CPU that selects its "tinygemm" kernels, torch's
            ``_weight_int4pack_mm``); ``"per-channel"``: one scale per output channel, which keeps quanto's generic
            int4 tensor (dequantize, then matmul): a fallback where tinygemm is not available.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    layers = model.get_decoder().layers
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    qtype = _quanto_qtype(quantize) if quantize else None
    if qtype is not None:
        from optimum.quanto import freeze
        from optimum.quanto import quantize as quanto_quantize

    for index, layer in enumerate(layers):
        layer.to_empty(device=device)
        for module in layer.modules():
            _init_module_params(module, std, generator)
        if qtype is not None:
            quanto_quantize(layer, weights=qtype)
            if int4_grouping == "per-channel":
                for module in layer.modules():
                    if hasattr(module, "weight_group_size"):
                        module.weight_group_size = None
            freeze(layer)
        if log and (index + 1) % max(1, len(layers) // 4) == 0:
            log(f"  built {index + 1}/{len(layers)} layers" + (f" ({quantize})" if quantize else ""))

    for module in model.modules():
        if id(module) in in_layers:
            continue
        metas = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)) if t.is_meta]
        if metas:
            module.to_empty(device=device, recurse=False)
            _init_module_params(module, std, generator)

    # Rotary embeddings hold computed (non-persistent) buffers: rebuild them on the device instead of leaving the
    # uninitialised memory to_empty gave them.
    for parent in model.modules():
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq") and hasattr(child, "rope_type"):
                with torch.device(device):
                    setattr(parent, child_name, type(child)(config=child.config))

    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftovers:
        raise RuntimeError(f"random model build left tensors on the meta device: {leftovers[:5]}")
    model.eval()
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (quantized tensors counted by their real storage)."""
    from common import tensor_bytes

    seen: set = set()
    return sum(tensor_bytes(t, seen) for t in list(model.parameters()) + list(model.buffers()))


def random_frequency_stats(model: nn.Module, seed: int = 0):
    """Query statistics of the right shape for ``model``, drawn at random.

    The weights are random, so statistics calibrated on text would mean nothing either; scoring costs the same.
    ``E|q_f| >= |E q_f|`` holds, as for real statistics.
    """
    from hf_ropekv import FrequencyStats
    from hf_ropekv.statistics import frequency_stats as stats_module
    from hf_ropekv.model.geometry import describe

    geometry = describe(model)
    gen = torch.Generator().manual_seed(seed)
    shape = (geometry.num_layers, geometry.num_q_heads, geometry.rotary_dim // 2)
    q_mean = torch.complex(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    q_abs = q_mean.abs() + torch.rand(shape, generator=gen)
    metadata = {
        **stats_module.geometry_metadata(geometry),
        "tokens": 0,
        "source": "random (benchmark: random-weight model)",
        "format_version": stats_module.FORMAT_VERSION,
    }
    return FrequencyStats(q_mean=q_mean, q_abs_mean=q_abs, metadata=metadata)
