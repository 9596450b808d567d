"""Every RoPE family of issue 14 on a tiny random config: layout detection, query capture, exactness, eviction.

- the rotary layout and frequencies hf_ropekv learns match the model's own RoPE applied to a random query
  (the complex numbers of the check are built here from index lists, independent of hf_ropekv);
- the captured pre-RoPE query equals the query recomputed by hand from each attention's input;
- ``RopeKVCache(model, budget=None)`` gives ``DynamicCache``'s tokens on a left-padded batch;
- with a budget and the default scorer (online statistics) the cache evicts and stays within
  ``budget + compress_every``.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import transformers
from transformers import DynamicCache

from conftest import padded_batch, rotary_is_patched
from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.model.capture import QueryCapture, find_attention_modules
from hf_ropekv.model.geometry import describe

_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
             pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
_GPTJ = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=128)

# name -> (config class, overrides, expected layout, expected rotary_dim)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "rotate_half", 16),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, intermediate_size=128, head_dim=32), "rotate_half", 32),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, intermediate_size=128), "rotate_half", 16),
    "phi4_mini": ("Phi3Config", dict(num_key_value_heads=2, intermediate_size=128, partial_rotary_factor=0.75),
                  "rotate_half", 12),
    "gpt_neox": ("GPTNeoXConfig", dict(intermediate_size=128, rotary_pct=0.25), "rotate_half", 4),
    "falcon_new": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False), "rotate_half", 16),
    "falcon_old": ("FalconConfig", dict(new_decoder_architecture=False, multi_query=True, alibi=False),
                   "rotate_half", 16),
    "persimmon": ("PersimmonConfig", dict(intermediate_size=128), "rotate_half", 8),
    "gptj": ("GPTJConfig", dict(_GPTJ, rotary_dim=8), "interleaved", 8),
    "codegen": ("CodeGenConfig", dict(_GPTJ, rotary_dim=8, n_ctx=512), "interleaved", 8),
    "cohere": ("CohereConfig", dict(num_key_value_heads=2, intermediate_size=128), "interleaved", 16),
    "glm": ("GlmConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "interleaved", 8),
    "glm4": ("Glm4Config", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "interleaved", 8),
    "helium": ("HeliumConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "interleaved", 16),
    "phi": ("PhiConfig", dict(intermediate_size=128), "rotate_half", 8),  # partial_rotary_factor 0.5
    # YaRN attention scaling multiplies cos and sin; sinks; eager only on 5.17.
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16, num_local_experts=4,
                                     layer_types=["full_attention", "full_attention"]), "rotate_half", 16),
}
NAMES = tuple(FAMILIES)


def family_model(name: str, seed: int = 0):
    cls, overrides, _, _ = FAMILIES[name]
    # transformers 5.17's GPT-J and CodeGen have eager attention only.
    attn_implementation = "eager" if name in ("gptj", "codegen", "gpt_oss") else "sdpa"
    kwargs = {**_BASE, **overrides}
    if name in ("gptj", "codegen"):
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
            kwargs.pop(key)
    config = getattr(transformers, cls)(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.float().eval()


def _pairs(layout: str, pairs: int) -> tuple[list[int], list[int]]:
    """Index lists of the real and imaginary dims, written out from the layout's definition."""
    if layout == "rotate_half":
        return list(range(pairs)), [f + pairs for f in range(pairs)]
    return [2 * f for f in range(pairs)], [2 * f + 1 for f in range(pairs)]


def _models_own_rope(model, name: str, q: torch.Tensor, position: int) -> torch.Tensor:
    """The modeling module's own rotary function applied to ``q`` [1, H, 1, R] at ``position``."""
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    ids = torch.tensor([[position]])
    if name in ("gptj", "codegen"):  # (sin, cos) from the module; apply(tensor [B, S, H, R], sin, cos)
        if rotary is None:  # transformers 5.17: each attention holds a table of sines, then cosines
            attn = find_attention_modules(model)[0]
            module = importlib.import_module(type(attn).__module__)
            sin, cos = attn.embed_positions[ids].split(attn.embed_positions.shape[-1] // 2, dim=-1)
        else:
            module = importlib.import_module(type(rotary).__module__)
            sin, cos = rotary(q, ids)
        return module.apply_rotary_pos_emb(q.transpose(1, 2), sin, cos).transpose(1, 2)
    module = importlib.import_module(type(rotary).__module__)
    cos, sin = rotary(q, ids)
    # YaRN-style attention scaling (GPT-OSS) multiplies cos and sin; it scales every score of a head alike.
    return module.apply_rotary_pos_emb(q, q.clone(), cos, sin)[0] / getattr(rotary, "attention_scaling", 1.0)


@pytest.mark.parametrize("name", NAMES)
def test_detected_layout_matches_the_models_own_rope(name: str) -> None:
    model = family_model(name)
    geometry = describe(model)
    _, _, layout, rotary_dim = FAMILIES[name]
    assert (geometry.rotary_layout, geometry.rotary_dim) == (layout, rotary_dim)
    pairs = rotary_dim // 2
    gen = torch.Generator().manual_seed(7)
    for position in (3, 301):
        q = torch.randn(1, geometry.num_q_heads, 1, rotary_dim, generator=gen)
        with torch.no_grad():
            rotated = _models_own_rope(model, name, q, position).double()
        real, imag = _pairs(geometry.rotary_layout, pairs)
        z = torch.complex(q[..., real].double(), q[..., imag].double())
        angle = geometry.inv_freq.double() * position
        expected = z * torch.polar(torch.ones_like(angle), angle)
        got = torch.complex(rotated[..., real], rotated[..., imag])
        assert (got - expected).abs().max() < 1e-5, f"{name}: the detected layout is not the model's RoPE"
    if name in ("gptj", "codegen"):  # measured frequencies: the formula of their sin/cos table
        formula = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        torch.testing.assert_close(geometry.inv_freq.double(), formula, rtol=1e-6, atol=0)


def _hand_queries(model, name: str, hidden: torch.Tensor, attn) -> torch.Tensor:
    """[B, S, H, D] pre-RoPE queries recomputed from an attention module's input, per family."""
    B, S, _ = hidden.shape
    heads, head_dim = describe(model).num_q_heads, describe(model).head_dim
    if name in ("phi3", "phi4_mini"):
        return attn.qkv_proj(hidden)[..., : heads * head_dim].view(B, S, heads, head_dim)
    if name == "gpt_neox":
        return attn.query_key_value(hidden).view(B, S, heads, 3 * head_dim)[..., :head_dim]
    if name == "gpt_oss" or name == "phi":
        return attn.q_proj(hidden).view(B, S, heads, head_dim)
    if name.startswith("falcon"):
        fused = attn.query_key_value(hidden)
        if hasattr(attn, "_split_heads"):  # transformers <= 5.24
            return attn._split_heads(fused)[0].reshape(B, S, heads, head_dim)
        fused = fused.view(B, S, -1, head_dim)
        if attn.new_decoder_architecture:  # per KV group: its query heads, then its key and value
            return fused.view(B, S, attn.num_kv_heads, -1, head_dim)[..., :-2, :].reshape(B, S, heads, head_dim)
        if attn.multi_query:  # all query heads, then one key and one value
            return fused[:, :, :heads]
        return fused.view(B, S, heads, 3, head_dim)[..., 0, :]
    if name == "persimmon":  # QK layernorm on [B, S, H, D] (qk_layernorm is on by default)
        q = attn._split_heads(attn.query_key_value(hidden))[0]
        return attn.q_layernorm(q) if attn.qk_layernorm else q
    if name == "codegen":  # the projection is interleaved over 4 model-parallel shards: query first in each
        mp_num = 4
        local = heads * head_dim // mp_num
        return attn.qkv_proj(hidden).view(B, S, mp_num, 3 * local)[..., :local].reshape(B, S, heads, head_dim)
    q = attn.q_proj(hidden).view(B, S, heads, head_dim)
    if name == "qwen3":
        q = attn.q_norm(q)
    return q


@pytest.mark.parametrize("name", NAMES)
def test_captured_query_is_the_pre_rope_query(name: str) -> None:
    model = family_model(name)
    geometry = describe(model)
    attns = find_attention_modules(model, geometry)
    hidden: dict[int, torch.Tensor] = {}
    handles = [
        attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: hidden.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True,
        )
        for i, attn in enumerate(attns)
    ]
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    got: dict[int, torch.Tensor] = {}
    with torch.no_grad(), QueryCapture(model, geometry, lambda i, q: got.__setitem__(i, q.clone())):
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    assert sorted(got) == list(range(geometry.num_layers))
    with torch.no_grad():
        for i, attn in enumerate(attns):
            expected = _hand_queries(model, name, hidden[i], attn)
            assert got[i].shape[-1] == geometry.head_dim  # the whole head, also where RoPE gets only a slice
            torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-6)


def _generate(model, cache, ids, mask, new_tokens: int) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, **{cache_kwarg(model): cache})


@pytest.mark.parametrize("name", NAMES)
def test_nothing_evicted_equals_dynamic_cache(name: str) -> None:
    model = family_model(name)
    ids, mask = padded_batch(128, lengths=(12, 9, 6))
    with torch.no_grad():
        reference = _generate(model, DynamicCache(config=model.config), ids, mask, 12)
        ours = _generate(model, RopeKVCache(model, budget=None), ids, mask, 12)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("name", NAMES)
def test_default_scorer_evicts_within_bound(name: str) -> None:
    model = family_model(name)
    ids, mask = padded_batch(128, lengths=(12, 9, 6))
    cache = RopeKVCache(model, budget=20, compress_every=8)
    with torch.no_grad():
        out = _generate(model, cache, ids, mask, 30)
    assert out.shape == (3, 12 + 30)
    assert cache.evicted and cache.num_compactions >= 1
    assert cache.tokens_kept <= 20 + 8
    assert cache.tokens_seen == 12 + 30 - 1
    stats = cache.scorer.stats
    q_mean, q_abs_mean = stats.for_layer(cache.geometry.full_attention_layers[0])
    assert math.isfinite(float(q_abs_mean.sum())) and float(q_abs_mean.sum()) > 0
    # The scorer reads the pair layout from the statistics (absent means rotate_half): it must be the model's.
    assert stats.metadata.get("rotary_layout", "rotate_half") == FAMILIES[name][2]


@pytest.mark.parametrize("name", NAMES)
def test_static_cache_gives_the_growing_caches_tokens(name: str) -> None:
    """``static=True`` (a fixed arena, sized before the first forward where transformers can tell the heads) keeps
    what the growing cache keeps, on every family. On transformers 5.17 multi-query Falcon's arena was sized from
    the config's head count, not the one head its attention hands the cache, and the first write failed."""
    model = family_model(name)
    ids, mask = padded_batch(128, lengths=(12, 9, 6))
    with torch.no_grad():
        growing = _generate(model, RopeKVCache(model, budget=20, compress_every=8, static=False), ids, mask, 30)
        static_cache = RopeKVCache(model, budget=20, compress_every=8, static=True)
        static = _generate(model, static_cache, ids, mask, 30)
    assert torch.equal(static, growing) and static_cache.num_compactions >= 1


@pytest.mark.parametrize("name", NAMES)
def test_geometry_heads_are_what_the_cache_receives(name: str) -> None:
    """KV heads of the geometry = heads of the keys handed to the cache (Falcon broadcasts in its new layout)."""
    model = family_model(name)
    cache = RopeKVCache(model, budget=None)
    ids, mask = padded_batch(128, lengths=(5, 3))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): cache})
    layer = cache.layers[0]
    assert layer.keys.shape[1] == cache.geometry.num_kv_heads
    assert cache.geometry.num_q_heads % cache.geometry.num_kv_heads == 0


def test_alibi_falcon_is_refused_with_the_reason() -> None:
    config = transformers.FalconConfig(**{**_BASE, "alibi": True})
    with pytest.raises(ValueError, match="ALiBi"):
        RopeKVCache(config, budget=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="ALiBi"):
        RopeKVCache(model, budget=64)


def _cohere2(**overrides):
    kwargs = {**_BASE, "num_key_value_heads": 2, "intermediate_size": 128, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"], **overrides}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.Cohere2Config(**kwargs)).float().eval()


def test_nope_full_attention_layers_refuse_the_rope_scorer_but_work_otherwise() -> None:
    """Cohere2 rotates only in its sliding layers: its full-attention keys carry no phase to score."""
    from hf_ropekv import RecencyScorer

    model = _cohere2()
    geometry = describe(model)
    assert geometry.rotary_layout is None and "NoPE" in geometry.rotary_problem
    with pytest.raises(ValueError, match="NoPE.*RecencyScorer"):
        RopeKVCache(model, budget=20)
    ids, mask = padded_batch(128, lengths=(12, 9, 6))
    with torch.no_grad():
        reference = _generate(model, DynamicCache(config=model.config), ids, mask, 10)
        assert torch.equal(_generate(model, RopeKVCache(model, budget=None), ids, mask, 10), reference)
        cache = RopeKVCache(model, budget=20, compress_every=8, scorer=RecencyScorer())
        _generate(model, cache, ids, mask, 30)
    assert cache.evicted and cache.tokens_kept <= 28


def test_capture_refuses_a_full_attention_layer_that_ran_without_rope() -> None:
    """The run-time check behind the config-based one: a layer that never called the rotary function."""
    import dataclasses

    model = _cohere2()
    geometry = dataclasses.replace(describe(model), rotary_layout="interleaved", rotary_problem=None)
    with torch.no_grad(), QueryCapture(model, geometry, lambda i, q: None):
        with pytest.raises(ValueError, match="Layer 1 .* without rotating its query"):
            model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_multi_head_latent_attention_is_refused_with_the_reason() -> None:
    config = transformers.DeepseekV3Config(**{**_BASE, "num_key_value_heads": 4, "intermediate_size": 128,
                                              "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                                              "qk_nope_head_dim": 8, "v_head_dim": 16})
    with pytest.raises(ValueError, match="multi-head latent attention"):
        RopeKVCache(config, budget=None)


def test_rotary_function_is_restored_and_shared_by_captures() -> None:
    """The pass-through is installed once per modeling module while any capture is attached, then removed."""
    model = family_model("llama")
    geometry = describe(model)
    module = importlib.import_module(type(find_attention_modules(model)[0]).forward.__module__)
    original = module.apply_rotary_pos_emb

    def patched() -> bool:  # (and HuggingFace kernels' nn.Module of the function, 5.25, stays the global)
        assert module.apply_rotary_pos_emb is original or not isinstance(original, torch.nn.Module)
        return rotary_is_patched(module)

    seen: list[list[int]] = [[], []]
    first = QueryCapture(model, geometry, lambda i, q: seen[0].append(i)).attach()
    second = QueryCapture(model, geometry, lambda i, q: seen[1].append(i)).attach()
    assert patched()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    first.detach()
    assert patched()  # the second capture still needs it
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    second.detach()
    assert not patched() and module.apply_rotary_pos_emb is original
    assert seen == [[0, 1], [0, 1, 0, 1]]


@pytest.mark.parametrize("order", ["first_in_first_out", "last_in_first_out"])
def test_captures_wrap_and_unwrap_attention_forwards_in_any_order(order: str) -> None:
    """A capture wraps each attention module's forward (no hooks); detached in either order, every module gets its
    class's forward back, a detached capture sees nothing more, and a forward that raised leaves no frame behind."""
    from hf_ropekv.model import rotary

    model = family_model("llama")
    geometry = describe(model)
    attention = find_attention_modules(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    seen: list[list[int]] = [[], []]
    captures = [QueryCapture(model, geometry, lambda i, q, k=k: seen[k].append(i)).attach() for k in range(2)]
    assert all("forward" in module.__dict__ for module in attention)
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in attention)
    original = attention[1].__dict__["forward"].__self__.inner  # the first capture's wrapper, under the second's
    attention[1].__dict__["forward"].__self__.inner = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, use_cache=False)
    attention[1].__dict__["forward"].__self__.inner = original
    key = rotary.find_rotary_function(type(attention[0]).forward.__module__).key
    assert rotary.frame_stack(key) == []  # the raising forward popped its frames
    first, second = captures if order == "first_in_first_out" else captures[::-1]
    first.detach()
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    second.detach()
    assert not any("forward" in module.__dict__ for module in attention)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    live = 1 if first is captures[0] else 0
    assert seen[live] == [0, 0, 1] and seen[1 - live] == [0]  # layer 0 of the raising forward, then one forward


def test_query_layout_follows_unsqueeze_dim() -> None:
    """(q, k, cos, sin, position_ids, unsqueeze_dim): heads at dim 1 by default, at dim 2 when unsqueeze_dim=2."""
    import sys
    import types

    from hf_ropekv.model import rotary

    module = types.ModuleType("hf_ropekv_test_fake_modeling")

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q, k

    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[module.__name__] = module
    try:
        fn = rotary.find_rotary_function(module.__name__)
        q = torch.randn(1, 2, 3, 4)
        assert fn.paired and fn.query_and_heads_dim((q, q, None, None), {}) == (q, 1)
        assert fn.query_and_heads_dim((q, q, None, None, None, 2), {})[1] == 2
        assert fn.query_and_heads_dim((), dict(q=q, k=q, cos=None, sin=None, unsqueeze_dim=2)) == (q, 2)
    finally:
        del sys.modules[module.__name__]
