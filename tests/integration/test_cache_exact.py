"""With a budget that never triggers, RopeKVCache must reproduce DynamicCache exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import generate_with_logits, padded_batch, tiny_model
from hf_ropekv import RopeKVCache

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_with_padding(arch: str, attn: str) -> None:
    model = tiny_model(arch, attn_implementation=attn)
    ids, mask = padded_batch(model.config.vocab_size)
    ref = generate_with_logits(model, DynamicCache(config=model.config), ids, mask)
    cache = RopeKVCache(model, budget=4096)
    out = generate_with_logits(model, cache, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cache.num_compactions == 0 and cache.tokens_kept == cache.tokens_seen == ids.shape[1] + 19


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_identical(arch: str) -> None:
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(10, 7))
    kw = dict(num_beams=3, do_sample=False, max_new_tokens=12)
    ref = generate_with_logits(model, DynamicCache(config=model.config), ids, mask, **kw)
    out = generate_with_logits(model, RopeKVCache(model, budget=None), ids, mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)


def test_seeded_sampling_identical() -> None:
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size)
    kw = dict(do_sample=True, top_k=20, temperature=1.3, max_new_tokens=16)
    torch.manual_seed(123)
    ref = generate_with_logits(model, DynamicCache(config=model.config), ids, mask, **kw)
    torch.manual_seed(123)
    out = generate_with_logits(model, RopeKVCache(model, budget=None), ids, mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_multi_turn_continuation_identical(arch: str) -> None:
    """A second generate() that continues from the returned cache, with a new user turn appended."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(8, 5))
    turn = torch.randint(3, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(7))

    def two_turns(cache):
        first = generate_with_logits(model, cache, ids, mask, max_new_tokens=6)
        ids2 = torch.cat([first.sequences, turn], dim=1)
        mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        return generate_with_logits(model, cache, ids2, mask2, max_new_tokens=6)

    ref = two_turns(DynamicCache(config=model.config))
    out = two_turns(RopeKVCache(model, budget=10_000))
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "all-ones-mask"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_identical(arch: str, padded: bool) -> None:
    """generate(prefill_chunk_size=...) sends the prompt in chunks, each alone: the cache takes them as one prompt.

    Without padding, transformers 5.24 drops the all-ones mask, so the chunks come with their positions only.
    """
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(12, 9, 6) if padded else (12, 12, 12))
    ref = generate_with_logits(model, DynamicCache(config=model.config), ids, mask, prefill_chunk_size=4)
    out = generate_with_logits(model, RopeKVCache(model, budget=4096), ids, mask, prefill_chunk_size=4)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # With eviction: each chunk compacts what is over the budget, and the cache stays within its bound.
    cache = RopeKVCache(model, budget=6, compress_every=2, protect_prompt=False)
    generate_with_logits(model, cache, ids, mask, prefill_chunk_size=4)
    assert cache.evicted and cache.tokens_kept <= 6 + 2


def test_mixed_sliding_layers_identical() -> None:
    """Gemma3: sliding layers stay windows, the full-attention layer is budgeted; nothing evicted here."""
    model = tiny_model("gemma3_text")
    ids, mask = padded_batch(model.config.vocab_size)
    ref = generate_with_logits(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=24)
    out = generate_with_logits(model, RopeKVCache(model, budget=4096), ids, mask, max_new_tokens=24)
    assert torch.equal(out.sequences, ref.sequences)


def test_new_cache_keyword_on_newer_transformers() -> None:
    """transformers 5.24 renamed `past_key_values` to `cache`; both must reach the same cache."""
    from hf_ropekv._compat import cache_kwarg

    model = tiny_model("llama")
    if cache_kwarg(model) != "cache":
        pytest.skip("this transformers version has no `cache=` keyword")
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model)
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert cache.tokens_seen == ids.shape[1] + 7
