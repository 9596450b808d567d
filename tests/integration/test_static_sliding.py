"""RopeKVCache(static=True) on models with sliding-window layers, and the scorers it refuses (issue 27, item 4).

A static cache keeps a model's sliding-window layers as transformers' static sliding-window layers
(``hf_ropekv.cache.window.StaticWindowLayer``), advanced before each forward, with their own part of the mask.
References: with nothing evicted, ``DynamicCache`` (exactly); with eviction, the growing cache (``static=False``).
Compilation (marked ``compile``) is checked as in ``test_static_cache.py``: generate's own compilation with dynamo's
``eager`` backend on the CPU, ``fullgraph=True``, and ``error_on_recompile`` where a second graph would be a failure.
A hand-written compiled loop on ``qwen2_sliding`` is one case of ``test_static_cache.py``'s.

Tiny models (``conftest``): ``gemma2`` (sliding, full, sliding; eager attention, soft-capping), ``qwen2_sliding``
(full, then sliding from ``max_window_layers``), ``gemma3_text`` (sliding, sliding, full) and ``mistral_sliding``
(every layer sliding). Windows of 8 tokens; prompts and generations far longer, so every window rolls.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import StaticSlidingWindowLayer

from conftest import cache_kw, compiled, generate_new, padded_batch, tiny_model
from hf_ropekv import RopeKVCache, disable, enable
from hf_ropekv.enable import is_enabled
from hf_ropekv.scorers import H2OScorer, RKVScorer, SnapKVScorer

BUDGET, EVERY, WINDOW = 16, 4, 8
HYBRID = ("gemma2", "qwen2_sliding", "gemma3_text")


def generate(model, cache, ids, mask, new=48, **kwargs) -> torch.Tensor:
    return generate_new(model, cache, ids, mask, new, **kwargs)


def window_layers(cache: RopeKVCache) -> list:
    """The sliding-window layers: transformers' own StaticSlidingWindowLayer (a subclass of it), public as the
    cache's ``layers``."""
    return [layer for layer in cache.layers if isinstance(layer, StaticSlidingWindowLayer)]


COMPILE = [None, pytest.param(compiled(), marks=pytest.mark.compile)]


@pytest.mark.filterwarnings("ignore:budget=200 evicts nothing")
@pytest.mark.parametrize("compile_config", COMPILE, ids=["eager", "compiled"])
@pytest.mark.parametrize("arch", [*HYBRID, "mistral_sliding"])
def test_nothing_evicted_equals_dynamic_cache(arch: str, compile_config, fresh_dynamo) -> None:
    """A budget above everything: the static cache's tokens are DynamicCache's, eager and compiled, in a left-padded
    batch whose prompts (12, 9, 6) and 24 new tokens roll every window several times over."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, new=24)
    cache = RopeKVCache(model, budget=200, static=True)
    assert cache.is_compileable
    windows = window_layers(cache)
    kinds = getattr(model.config, "layer_types", None) or []
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    assert [layer.layer_idx for layer in windows] == (sliding or list(range(model.config.num_hidden_layers)))
    torch.testing.assert_close(generate(model, cache, ids, mask, new=24, compile_config=compile_config), expected,
                               atol=0, rtol=0)
    assert not cache.evicted
    assert cache.tokens_seen == ids.shape[1] + 24 - 1  # the last token is generated, never fed back
    for layer in windows:  # the window holds its last tokens, no more
        positions = cache.kept_positions(layer.layer_idx)
        assert positions.shape[-1] == WINDOW and positions[:, :, -1].eq(cache.tokens_seen - 1).all()
        assert positions[0, 0].tolist() == list(range(cache.tokens_seen - WINDOW, cache.tokens_seen))
    assert dict(fresh_dynamo["graph_break"]) == {}


@pytest.mark.parametrize("compile_config", COMPILE, ids=["eager", "compiled"])
@pytest.mark.parametrize("arch", HYBRID)
def test_eviction_keeps_what_the_growing_cache_keeps(arch: str, compile_config, fresh_dynamo) -> None:
    """With eviction, the static cache generates the growing cache's tokens (eager and compiled), keeps the same
    tokens in every layer, and stays bounded: full layers within budget + compress_every, windows within their
    window."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6, 3))
    reference = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
    expected = generate(model, reference, ids, mask)
    assert reference.num_compactions >= 8
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    torch.testing.assert_close(generate(model, cache, ids, mask, compile_config=compile_config), expected, atol=0,
                               rtol=0)
    assert cache.num_compactions == reference.num_compactions
    assert cache.tokens_kept <= BUDGET + EVERY < cache.tokens_seen
    windows = {layer.layer_idx for layer in window_layers(cache)}
    for layer in range(model.config.num_hidden_layers):
        mine, theirs = cache.kept_positions(layer), reference.kept_positions(layer)
        if layer in windows:  # a static window holds its last 8 tokens, a DynamicCache window the last 7
            assert mine.shape[-1] == WINDOW and torch.equal(mine[..., 1:], theirs[..., -(WINDOW - 1):]), layer
        else:
            assert torch.equal(mine, theirs) and mine.shape[-1] <= BUDGET + EVERY, layer


@pytest.mark.parametrize("compile_config", COMPILE, ids=["eager", "compiled"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_unpinned_prompt_longer_than_the_arena(chunk: int | None, compile_config, fresh_dynamo) -> None:
    """A prompt of about 4x the arena, not pinned, in one forward (a temporary arena: the window part of the mask then
    sits after its longer slot mask) or in chunks of 8 (each chunk a multi-token window update): the growing
    cache's tokens, eager and compiled."""
    model = tiny_model("gemma2")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(60, 41))
    options = dict(budget=BUDGET, compress_every=EVERY, protect_prompt=False)
    extra = {} if chunk is None else {"prefill_chunk_size": chunk}
    expected = generate(model, RopeKVCache(model, **options), ids, mask, new=12, **extra)
    cache = RopeKVCache(model, **options, static=True)
    torch.testing.assert_close(generate(model, cache, ids, mask, new=12, compile_config=compile_config, **extra),
                               expected, atol=0, rtol=0)
    assert cache.num_compactions >= 3


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:budget=16 evicts nothing")
@pytest.mark.parametrize("arch", ["gemma2", "mistral_sliding"])
def test_compiled_step_is_one_graph(arch: str, fresh_dynamo) -> None:
    """Prompts shorter than the window (5 and 3 tokens): the windows fill, then roll, across compactions and a second
    cache, with one compiled graph and no recompile. transformers' own static sliding layer branches on its Python
    counter while the window fills; this one is advanced before the forward and does the same every step."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(5, 3))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY), ids, mask, new=30)
    torch._dynamo.config.error_on_recompile = True
    graphs = []
    for _ in range(2):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        torch.testing.assert_close(generate(model, cache, ids, mask, new=30, compile_config=compiled()), expected,
                                   atol=0, rtol=0)
        graphs.append(fresh_dynamo["stats"]["unique_graphs"])
        keys = [layer.keys for layer in window_layers(cache)]
        del cache
        gc.collect()
    torch._dynamo.config.error_on_recompile = False
    assert graphs == [1, 1]  # the decode step, served again to the second cache
    assert keys and all(torch.isfinite(k).all() for k in keys)


def test_beam_search_reorders_the_windows() -> None:
    model = tiny_model("gemma2")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    outs = []
    for static in (False, True):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=static)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, num_beams=3, do_sample=False,
                                   pad_token_id=0, **cache_kw(model, cache)))
        assert cache.num_compactions >= 2
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


def test_next_cache_takes_over_the_window_buffers() -> None:
    """The windows are leased like the arenas (purposes ``window_keys`` / ``window_values``): a new static cache of
    the same model and shapes takes over those of a freed one, at the same addresses, zeroed. Private: the pool is
    the mechanism checked."""
    from hf_ropekv.storage.buffers import WINDOW_KEYS, WINDOW_VALUES, BufferPool

    model = tiny_model("gemma2")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))

    def run():
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        out = generate(model, cache, ids, mask, new=12)
        return out, [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in window_layers(cache)]

    out, addresses = run()
    gc.collect()
    pooled = {purpose[:2] for purpose in BufferPool.of(model).free}
    assert {(WINDOW_KEYS, 0), (WINDOW_VALUES, 0), (WINDOW_KEYS, 2), (WINDOW_VALUES, 2)} <= pooled
    again, again_addresses = run()
    assert again_addresses == addresses
    torch.testing.assert_close(again, out, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:hf_ropekv.enable")
def test_enable_static_on_a_hybrid_model() -> None:
    model = tiny_model("gemma2")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY), ids, mask, new=20)
    enable(model, budget=BUDGET, compress_every=EVERY, static=True)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20,
                             do_sample=False, pad_token_id=0)
    finally:
        disable(model)
    torch.testing.assert_close(out[:, ids.shape[1] :], expected, atol=0, rtol=0)


ATTENTION_SCORERS = {
    "snapkv": lambda: SnapKVScorer(window=4),
    "h2o": lambda: H2OScorer(),
    "rkv": lambda: RKVScorer(window=4),
}


@pytest.mark.filterwarnings("ignore:hf_ropekv.enable")
@pytest.mark.parametrize("name", sorted(ATTENTION_SCORERS))
def test_attention_scorers_are_refused_with_the_fix(name: str) -> None:
    """SnapKV, H2O and R-KV need attention weights from the eager path: static=True refuses them when the cache is
    built, and enable(static=True) when it is called (not at the first generate()), naming the problem and the fix."""
    model = tiny_model("llama")
    scorer = ATTENTION_SCORERS[name]()
    expected = rf"static=True cannot run {type(scorer).__name__}.*attention weights.*static=False.*RoPE"
    with pytest.raises(ValueError, match=expected):
        RopeKVCache(model, budget=BUDGET, scorer=scorer, static=True)
    with pytest.raises(ValueError, match=expected):
        RopeKVCache(tiny_model("gemma2"), budget=BUDGET, scorer=scorer, static=True)
    with pytest.raises(ValueError, match=expected):
        enable(model, budget=BUDGET, scorer=scorer, static=True)
    assert not is_enabled(model) and "_prepare_cache_for_generation" not in model.__dict__  # nothing was installed
    enable(model, budget=BUDGET, scorer=scorer)  # the growing cache takes them
    disable(model)
    enable(model, budget=BUDGET, scorer=scorer, static="auto")  # "auto" stays growing with them
    disable(model)
    assert not RopeKVCache(model, budget=BUDGET, scorer=ATTENTION_SCORERS[name](), static=False).static


def test_one_token_prompt_with_online_statistics() -> None:
    """A prompt of one token is a single-token forward before any has finished: the online statistics have no sums
    yet to move into the static buffers (it raised KeyError: 0 in OnlineStatistics._fold_now)."""
    model = tiny_model("llama")
    prompt = torch.tensor([[5]])
    outs = []
    for static in (False, True):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=static)
        outs.append(model.generate(input_ids=prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                   pad_token_id=0, **cache_kw(model, cache)))
        assert cache.num_compactions >= 3
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


def test_every_layer_of_a_static_cache_attends_with_grouped_sdpa(monkeypatch) -> None:
    """A static cache's sliding-window layers attend as its full-attention layers do, through grouped sdpa (query
    heads folded per key/value head, no copy of the key/value heads), at every decoding step."""
    from hf_ropekv.model import attention

    model = tiny_model("qwen2_sliding")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    calls, grouped = [], attention.grouped_sdpa

    def spy(module, query, *args, **kwargs):
        calls.append((module.layer_idx, query.shape[2]))
        return grouped(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "grouped_sdpa", spy)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True), ids, mask, new=12)
    for layer in range(model.config.num_hidden_layers):  # every step after the prompt's
        assert sum(1 for idx, q in calls if idx == layer and q == 1) == 11, (layer, calls)
