"""Misuse found while generating gets a clear error that names the problem and the fix, and leaves the cache
consistent. (Misuse refused at construction: tests/unit/test_errors.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import cache_kw, leftovers, padded_batch, tiny_model
from hf_ropekv import RopeKVCache


def test_pinned_prompt_must_fit_budget() -> None:
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(30, 20))
    cache = RopeKVCache(model, budget=16, compress_every=4)
    with pytest.raises(ValueError, match="prompt has 30 tokens but budget=16.*protect_prompt=False"):
        model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=4, pad_token_id=0)
    # Unpinned, the same prompt is compressed like any other tokens.
    cache = RopeKVCache(model, budget=16, compress_every=4, protect_prompt=False)
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=4, pad_token_id=0)
    assert cache.tokens_kept <= 20


def test_protected_tokens_beyond_budget_are_refused() -> None:
    """Window guards that cannot all be honoured raise instead of silently dropping protected tokens."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(10, 10))
    cache = RopeKVCache(model, budget=16, compress_every=8, window=7)
    with pytest.raises(ValueError, match="protected .* only 16 can be kept"):
        model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=30, pad_token_id=0)


def test_reused_cache_for_another_batch_is_refused() -> None:
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(8, 8), seed=1)
    other, other_mask = padded_batch(model.config.vocab_size, lengths=(20, 20), seed=2)
    cache = RopeKVCache(model, budget=64)
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="do not start with them.*conversation.*fresh RopeKVCache"):
        model.generate(input_ids=other, attention_mask=other_mask, **cache_kw(model, cache), max_new_tokens=4,
                       pad_token_id=0)
    three, three_mask = padded_batch(model.config.vocab_size, lengths=(20, 20, 20), seed=3)
    with pytest.raises(ValueError, match="fresh RopeKVCache"):
        model.generate(input_ids=three, attention_mask=three_mask, **cache_kw(model, cache), max_new_tokens=4,
                       pad_token_id=0)


def test_crop_after_eviction_is_refused_but_allowed_before() -> None:
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(6, 6))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0, do_sample=False)
    cache, reference = RopeKVCache(model, budget=64), DynamicCache(config=model.config)
    out = model.generate(**cache_kw(model, cache), **kw)
    model.generate(**cache_kw(model, reference), **kw)
    cache.crop(-3)
    reference.crop(-3)
    assert cache.tokens_seen == reference.get_seq_length() == 7
    # After the rollback both caches continue identically from token 7.
    step = dict(input_ids=out[:, 7:8], attention_mask=torch.ones(2, 8, dtype=mask.dtype),
                position_ids=torch.full((2, 1), 7))
    with torch.no_grad():
        got = model(**cache_kw(model, cache), **step).logits
        want = model(**cache_kw(model, reference), **step).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    cache = RopeKVCache(model, budget=12, compress_every=4)
    model.generate(**cache_kw(model, cache), **{**kw, "max_new_tokens": 20})
    assert cache.evicted
    with pytest.raises(ValueError, match="cannot crop.*already evicted"):
        cache.crop(-2)


def test_reset_empties_and_reuses() -> None:
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(8, 5))
    cache = RopeKVCache(model, budget=10, compress_every=4)
    first = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=12,
                           pad_token_id=0, do_sample=False)
    cache.reset()
    assert cache.tokens_seen == 0 and cache.bytes_held == 0
    again = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=12,
                           pad_token_id=0, do_sample=False)
    assert torch.equal(first, again)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_cache_is_freed_without_the_cyclic_collector(static: bool, gc_off) -> None:
    """No reference cycle: arenas and every hook or wrapper on the model go as soon as the last reference to the
    cache does (static caches included), and the model's forwards are plain again."""
    import weakref

    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(8, 5))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    assert leftovers(model) == []
    cache = RopeKVCache(model, budget=12, compress_every=4, static=static)
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=20, pad_token_id=0)
    assert leftovers(model), "the cache put nothing on its model: this test would check nothing"
    ref = weakref.ref(cache)
    del cache
    assert ref() is None
    assert leftovers(model) == []
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, want, atol=0, rtol=0)


def test_a_cache_freed_during_a_compile_leaves_its_hooks_until_the_next_forward(monkeypatch) -> None:
    """The garbage collector may free a cache while dynamo compiles (its finalizer then runs mid-compile); taking
    hooks or patches out then would change what dynamo guards on. The idle hooks wait for the next forward that is
    not compiled, and go then. (The compile is simulated: the adapter's own ``_dynamo_compiling`` probe answers
    yes; a real one cannot be made to collect a cache at a chosen moment.)"""
    import hf_ropekv.adapter.shared_hooks as shared_hooks

    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 6))
    cache = RopeKVCache(model, budget=12, compress_every=4)
    model(input_ids=ids, **cache_kw(model, cache))
    installed = leftovers(model)
    assert installed
    monkeypatch.setattr(shared_hooks, "_dynamo_compiling", lambda: True)
    del cache
    assert leftovers(model) == installed
    monkeypatch.setattr(shared_hooks, "_dynamo_compiling", lambda: False)
    model(input_ids=ids)  # no cache: the next plain forward takes the idle hooks out
    assert leftovers(model) == []


def test_generate_continues_after_a_crop() -> None:
    """A crop before any eviction (as assisted decoding does) leaves a cache that generate() accepts."""
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(8, 8))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cache, reference = RopeKVCache(model, budget=None), DynamicCache(config=model.config)
    out = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), **kw)
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, reference), **kw)
    cache.crop(-3)
    reference.crop(-3)
    again = dict(input_ids=out[:, :-3], attention_mask=torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1))
    got = model.generate(**cache_kw(model, cache), **again, **kw)
    want = model.generate(**cache_kw(model, reference), **again, **kw)
    assert torch.equal(got, want)


def test_default_window_yields_to_a_long_pinned_prompt_but_an_explicit_one_is_kept() -> None:
    """The default recent window (min(32, budget // 4)) shrinks to what the budget leaves beside the pinned
    prompt; a window the caller asked for is a guarantee, so it raises instead of being cut."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(14, 9))
    cache = RopeKVCache(model, budget=16, compress_every=4)
    assert cache.options.recent_window == 4
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=12, pad_token_id=0)
    assert cache.evicted and max(cache.tokens_kept_per_row) <= 16 + 4
    explicit = RopeKVCache(model, budget=16, compress_every=4, window=4)
    with pytest.raises(ValueError, match="protected .* only 16 can be kept"):
        model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, explicit), max_new_tokens=12,
                       pad_token_id=0)


def test_a_cache_filled_under_inference_mode_continues_outside_it() -> None:
    """A first turn under torch.inference_mode(), a second without (what DynamicCache allows): the tokens of the
    same two turns both run without inference mode, and the kept positions readable."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(12,))
    outs, caches = [], []
    for inference in (False, True):
        cache = RopeKVCache(model, budget=16, compress_every=4)
        kw = dict(do_sample=False, pad_token_id=0, **cache_kw(model, cache))
        with torch.inference_mode(inference):
            first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **kw)
        assert cache.evicted
        more = torch.cat([first, ids[:, :3]], dim=1).clone()
        outs.append(model.generate(input_ids=more, attention_mask=torch.ones_like(more), max_new_tokens=10, **kw))
        caches.append(cache)
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(caches[1].kept_positions(0), caches[0].kept_positions(0))
