"""Misuse gets a clear error that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GPT2Config, LlamaConfig, T5Config

from conftest import cache_kw, padded_batch, tiny_model
from hf_ropekv import RecencyScorer, RopeKVCache


@pytest.mark.parametrize("budget", [0, -5, 2.5, True])
def test_bad_budget(budget) -> None:
    with pytest.raises(ValueError, match="budget must be a positive int"):
        RopeKVCache(tiny_model("llama"), budget=budget)


def test_guards_must_leave_room() -> None:
    with pytest.raises(ValueError, match="window .* sink .* smaller than budget"):
        RopeKVCache(tiny_model("llama"), budget=8, window=6, sink=2)


def test_unknown_selection() -> None:
    with pytest.raises(ValueError, match="selection must be one of"):
        RopeKVCache(tiny_model("llama"), budget=8, selection="best")


@pytest.mark.parametrize(
    "config, message",
    [
        (GPT2Config(n_layer=2, n_embd=32, n_head=2), "no rotary position embedding.*whatever the scorer.*DynamicCache"),
        (T5Config(num_layers=2, d_model=32, num_heads=2), "encoder-decoder"),
        (LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, add_cross_attention=True),
         "cross-attention"),
    ],
)
def test_unsupported_model_families(config, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RopeKVCache(config, budget=64, scorer=RecencyScorer())


def test_not_a_model() -> None:
    with pytest.raises(TypeError, match="PreTrainedModel or PretrainedConfig"):
        RopeKVCache("meta-llama/Llama-3.2-1B", budget=64)


def test_scorer_without_score_method() -> None:
    with pytest.raises(TypeError, match="score"):
        RopeKVCache(tiny_model("llama"), budget=64, scorer=lambda keys: keys)


def test_config_only_needs_stats_for_the_default_scorer() -> None:
    with pytest.raises(ValueError, match="pass the model"):
        RopeKVCache(tiny_model("llama").config, budget=64)


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
    with pytest.raises(ValueError, match="another sequence.*fresh RopeKVCache"):
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


def test_no_to_method_and_not_compileable() -> None:
    cache = RopeKVCache(tiny_model("llama"), budget=32)
    assert not hasattr(cache, "to")  # accelerate's send_to_device would call it
    assert cache.get_max_length() == -1
    assert "budget=32" in repr(cache)


def test_cache_is_freed_without_the_cyclic_collector() -> None:
    """No reference cycle: arenas and model hooks go as soon as the last reference to the cache does."""
    import gc
    import weakref

    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(8, 5))
    hooks_before = len(model._forward_pre_hooks)
    gc.disable()
    try:
        cache = RopeKVCache(model, budget=12, compress_every=4)
        model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=20, pad_token_id=0)
        assert len(model._forward_pre_hooks) == hooks_before + 1
        ref = weakref.ref(cache)
        del cache
        assert ref() is None
        assert len(model._forward_pre_hooks) == hooks_before
    finally:
        gc.enable()


def test_a_cache_freed_during_a_compile_leaves_its_hooks_until_the_next_forward(monkeypatch) -> None:
    """The garbage collector may free a cache while dynamo compiles (its finalizer then runs mid-compile); taking
    the rotary pass-through out then would change a function dynamo guards on. The idle hooks wait for the next
    forward that is not compiled, and go then."""
    import hf_ropekv.hooks.shared_hooks as shared_hooks
    from hf_ropekv.hooks.shared_hooks import SharedHooks

    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 6))
    hooks_before = len(model._forward_pre_hooks)
    attention = model.model.layers[0].self_attn
    plain_forward = attention.forward
    cache = RopeKVCache(model, budget=12, compress_every=4)
    model(input_ids=ids, **cache_kw(model, cache))
    assert attention.forward != plain_forward  # the query capture wraps the attention forwards
    monkeypatch.setattr(shared_hooks, "_dynamo_compiling", lambda: True)
    del cache
    assert len(model._forward_pre_hooks) == hooks_before + 1 and attention.forward != plain_forward
    monkeypatch.setattr(shared_hooks, "_dynamo_compiling", lambda: False)
    model(input_ids=ids)  # no cache: the next plain forward takes the idle hooks out
    assert len(model._forward_pre_hooks) == hooks_before and attention.forward == plain_forward
    assert SharedHooks._BY_MODEL.get(model) is None


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
    assert cache.window == 4
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=12, pad_token_id=0)
    assert cache.evicted and max(cache.tokens_kept_per_row) <= 16 + 4
    explicit = RopeKVCache(model, budget=16, compress_every=4, window=4)
    with pytest.raises(ValueError, match="protected .* only 16 can be kept"):
        model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, explicit), max_new_tokens=12, pad_token_id=0)
