"""With eviction, RopeKVCache must equal a full-cache forward masked to exactly the kept tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import padded_batch, tiny_model
from hf_ropekv import KeyNormScorer, RandomScorer, RecencyScorer, RopeKVCache


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """generate's position ids: count real tokens, padding parked at 1."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def kept_positions(cache: RopeKVCache) -> torch.Tensor:
    """Token indices held by the full-attention layers [B, H_kv, K] (-1 at a row's holes once it compacted);
    identical across layers in global mode."""
    layers = cache._full_layers
    first = layers[0].storage.live_positions()
    for layer in layers[1:]:
        assert torch.equal(layer.storage.live_positions(), first), "layers disagree on the kept tokens"
    return first


def reference_mask(
    kept: torch.Tensor, mask2d: torch.Tensor, new: int, group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4-D mask [B, H_q, new, total]: each query sees the kept tokens of its KV head, causally."""
    batch, kv_heads, _ = kept.shape
    total, device = mask2d.shape[1], kept.device
    allowed = torch.zeros(batch, kv_heads, total + 1, dtype=torch.bool, device=device)
    allowed.scatter_(2, torch.where(kept < 0, total, kept), True)  # holes (-1) land in a column then dropped
    allowed = allowed[..., :total]
    query_pos = torch.arange(total - new, total, device=device).view(1, 1, new, 1)
    columns = torch.arange(total, device=device).view(1, 1, 1, total)
    allowed = allowed[:, :, None, :] & (columns <= query_pos)
    allowed &= mask2d.bool().to(device)[:, None, None, :]
    # Padding queries see nothing; let them see themselves so no NaN enters the reference (never compared).
    allowed |= (columns == query_pos) & ~allowed.any(-1, keepdim=True)
    allowed = allowed.repeat_interleave(group, dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def run_and_compare(
    model, cache: RopeKVCache, chunks: list[torch.Tensor], mask: torch.Tensor, decode_steps: int, atol: float = 1e-5
):
    """Feed `chunks` (then greedy decode) to both caches; compare logits of every real new position."""
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    reference = DynamicCache(config=model.config)
    seen = 0
    mask2d = mask[:, :0]
    steps = list(chunks) + [None] * decode_steps
    next_token = None
    max_kept = 0
    for chunk in steps:
        if chunk is None:
            chunk = next_token
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        new = chunk.shape[1]
        mask2d = mask[:, : seen + new]
        positions = positions_from_mask(mask2d)[:, -new:]
        with torch.no_grad():
            got = model(input_ids=chunk, attention_mask=mask2d, position_ids=positions, past_key_values=cache).logits
            ref_mask = reference_mask(kept_positions(cache), mask2d, new, group, model.dtype)
            want = model(
                input_ids=chunk, attention_mask=ref_mask, position_ids=positions, past_key_values=reference
            ).logits
        real = mask2d[:, -new:].bool()
        torch.testing.assert_close(got[real], want[real], atol=atol, rtol=0)
        seen += new
        max_kept = max(max_kept, cache.tokens_kept)
        next_token = got[:, -1:].argmax(-1)
    return max_kept


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_with_eviction_matches_masked_reference(arch: str, attn: str) -> None:
    model = tiny_model(arch, attn_implementation=attn)
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4, selection="global")
    max_kept = run_and_compare(model, cache, [ids], mask, decode_steps=30)
    assert cache.num_compactions >= 5 and cache.evicted
    assert max_kept <= 16 + 4


@pytest.mark.parametrize("scorer", [None, RecencyScorer(), KeyNormScorer(), RandomScorer(seed=3)])
def test_chunked_prefill_with_eviction_matches_masked_reference(scorer) -> None:
    model = tiny_model("qwen2")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(40, 33), seed=1)
    chunks = list(ids.split(8, dim=1))
    kwargs = {} if scorer is None else {"scorer": scorer}
    cache = RopeKVCache(
        model, budget=12, compress_every=4, protect_prompt=False, sink=1, window=2, selection="global", **kwargs
    )
    max_kept = run_and_compare(model, cache, chunks, mask, decode_steps=6)
    assert cache.evicted
    assert max_kept <= 12 + 4


def test_padding_never_counts_toward_the_budget() -> None:
    """A padded row keeps every real token until it holds budget + compress_every of them itself."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(12, 4))  # row 1 has 8 pads
    cache = RopeKVCache(model, budget=14, compress_every=2, scorer=RecencyScorer())
    run_and_compare(model, cache, [ids], mask, decode_steps=5)
    kept = kept_positions(cache)
    assert cache.evicted and cache.num_compactions == 1
    # Row 0 (12 real tokens) went over the budget of 14 at decoding step 3; at the next tick of the clock (every
    # 2 steps: before steps 1, 3, 5) it came back to 14, then took step 5's token. Row 1 (4 real + 5 new) kept all 9 of its
    # real tokens, right-aligned behind 6 holes (its padding is gone and was never counted).
    assert cache.tokens_kept_per_row == (15, 9)
    seen = cache.tokens_seen
    for head in range(kept.shape[1]):
        assert kept[1, head, :6].tolist() == [-1] * 6
        assert kept[1, head, 6:].tolist() == list(range(8, seen))
        # The pinned prompt (12) and, by recency, the 2 newest at the last compaction, then the new token.
        assert kept[0, head].tolist() == list(range(12)) + list(range(seen - 3, seen))


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_generate_completes_with_eviction(mode: str) -> None:
    model = tiny_model("mistral")
    ids, mask = padded_batch(model.config.vocab_size)
    kw = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_p=0.9), "beam": dict(num_beams=3)}[mode]
    cache = RopeKVCache(model, budget=16, compress_every=8)
    out = model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, pad_token_id=0, **kw
    )
    assert out.shape == (3, ids.shape[1] + 40)
    assert cache.tokens_seen == ids.shape[1] + 39
    assert 16 <= cache.tokens_kept <= 16 + 8 and cache.num_compactions >= 3


def test_per_layer_selection_keeps_layer_specific_tokens() -> None:
    model = tiny_model("llama", num_hidden_layers=3)
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4, selection="per_layer", scorer=KeyNormScorer())
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=30, pad_token_id=0)
    kept = [layer.storage.live_positions() for layer in cache._full_layers]
    assert all(k.shape == kept[0].shape for k in kept)  # same count everywhere ...
    assert any(not torch.equal(k, kept[0]) for k in kept[1:])  # ... but each layer chose its own


def test_storage_stays_in_place_and_bounded() -> None:
    """The arena grows only up to budget + compress_every; from then on compaction works in place."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=32, compress_every=16, page_size=16)
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    storage = cache._full_layers[0].storage
    assert storage.capacity == 16  # 13 tokens: one page, not the whole steady-state arena
    ids2 = torch.cat([ids, torch.randint(3, 100, (3, 1))], dim=1)
    pointer = None
    for _ in range(100):  # decode by hand so we can look at the arena after every step
        seen = cache.tokens_seen
        mask2 = torch.ones(3, seen + 1, dtype=mask.dtype)
        mask2[:, : mask.shape[1]] = mask
        with torch.no_grad():
            model(input_ids=ids2[:, -1:], attention_mask=mask2, past_key_values=cache,
                  position_ids=positions_from_mask(mask2)[:, -1:])
        assert storage.capacity <= 48 and cache.tokens_kept <= 48
        if storage.capacity == 48:
            pointer = pointer or storage.keys.data_ptr()
            assert storage.keys.data_ptr() == pointer  # no reallocation once full
    assert cache.pages_allocated == 3 * len(cache._full_layers)
    assert cache.num_compactions >= 5
    assert cache.bytes_held < cache.full_cache_bytes
