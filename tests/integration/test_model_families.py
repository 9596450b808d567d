"""Every RoPE family hf_ropekv supports, on a tiny random config (``conftest.FAMILIES``): layout detection,
calibration, exactness, eviction, the static cache.

- the rotary layout and frequencies hf_ropekv learns match the model's own RoPE applied to a random query
  (the complex numbers of the check are built here from index lists, independent of hf_ropekv);
- ``calibrate`` gives the statistics of the pre-RoPE queries recomputed by hand from each attention's input
  (``conftest.PreRopeQueries``), query norms included; the online statistics are checked the same way in
  ``test_statistics_follow_queries.py``;
- ``RopeKVCache(model, budget=None)`` gives ``DynamicCache``'s tokens on a left-padded batch;
- with a budget and the default scorer (online statistics) the cache evicts and stays within
  ``budget + compress_every``, and ``static=True`` keeps what the growing cache keeps.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import DynamicCache

from conftest import (FAMILIES, FAMILY_NAMES, PreRopeQueries, attention_modules, cache_kw, family_model, padded_batch,
                      query_pairs)
from hf_ropekv import RopeKVCache, calibrate
from hf_ropekv.model.geometry import describe

NAMES = FAMILY_NAMES


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
            attn = attention_modules(model)[0]
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


@pytest.mark.parametrize("name", NAMES)
def test_the_probes_cpu_copy_of_the_rotary_module_gives_the_same_geometry(name: str) -> None:
    """A model on a GPU is probed through a CPU copy of its rotary module (``geometry._cpu_copy``): every family's
    module copies, shares its config, owns its tensors, and the probe of the copy learns what the module gives."""
    from hf_ropekv.model.geometry import _cpu_copy, _frequencies_and_layout, _rotary_module

    model = family_model(name)
    config = model.config.get_text_config(decoder=True)
    rotary = _rotary_module(model, config, name)
    copied = _cpu_copy(rotary)
    assert copied is not rotary and getattr(copied, "config", None) is getattr(rotary, "config", None)
    assert not {t.data_ptr() for t in copied.buffers()} & {t.data_ptr() for t in rotary.buffers()}
    got, want = _frequencies_and_layout(copied, config, name), _frequencies_and_layout(rotary, config, name)
    assert got[1:] == want[1:] and torch.equal(got[0], want[0])


@pytest.mark.parametrize("name", NAMES)
def test_calibrated_statistics_are_those_of_the_pre_rope_queries(name: str) -> None:
    """calibrate() of two sequences: the means of ``q_f`` and ``|q_f|`` over every token, per layer and query head,
    where ``q`` is recomputed by hand from each attention's input, in the model's pair layout. Query norms
    (Qwen3, Persimmon: randomised) must be applied; the whole head is scored, also where RoPE gets a slice."""
    model = family_model(name)
    geometry = describe(model)
    pairs = geometry.rotary_dim // 2
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    stats = calibrate(model, None, ids, progress=False)
    with PreRopeQueries(model) as recorded, torch.no_grad():
        for row in ids:  # each sequence alone: no padding
            model(input_ids=row[None], use_cache=False)
    for layer in range(geometry.num_layers):
        q = torch.cat([forward[layer] for forward in recorded.forwards], dim=1)  # [1, 14, H, D]
        z = query_pairs(q[0], FAMILIES[name][2], pairs)  # [14, H, F]
        torch.testing.assert_close(stats.q_mean[layer], z.mean(0).to(torch.complex64), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats.q_abs_mean[layer], z.abs().mean(0).float(), rtol=1e-4, atol=1e-5)
    assert stats.tokens == 14 and stats.metadata.get("rotary_layout", "rotate_half") == FAMILIES[name][2]


def _generate(model, cache, ids, mask, new_tokens: int) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, **cache_kw(model, cache))


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
    # The scorer reads the pair layout from the statistics (absent means rotate_half): it must be the model's.
    assert cache.scorer.stats.metadata.get("rotary_layout", "rotate_half") == FAMILIES[name][2]


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
        model(input_ids=ids, attention_mask=mask, **cache_kw(model, cache))
    assert cache.kept_positions(0).shape == (2, cache.geometry.num_kv_heads, 5)
    assert cache.geometry.num_q_heads % cache.geometry.num_kv_heads == 0
