"""With eviction, RopeKVCache must equal a full-cache forward masked to exactly the kept tokens (tests/reference.py),
each full-attention layer with the mask of what it kept (every layer ranks its own keys)."""

from __future__ import annotations

import pytest
import torch

from conftest import cache_kw, padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv.scorers import KeyNormScorer, RandomScorer, RecencyScorer
from reference import positions_from_mask, run_and_compare


def _layers_differ(cache: RopeKVCache, model) -> bool:
    """Whether some full-attention layer holds other tokens than the last layer (always full attention here)."""
    last = model.config.num_hidden_layers - 1
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * (last + 1)
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    return any(not torch.equal(cache.kept_positions(i), cache.kept_positions(last)) for i in full)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_default_per_layer_selection_matches_per_layer_reference(arch: str, attn: str) -> None:
    """The default selection: each full-attention layer attends to its own kept tokens, sliding layers to their
    window; a padded batch, decoding across several compactions."""
    overrides = {"num_hidden_layers": 3} if arch != "gemma3_text" else {}
    model = tiny_model(arch, attn_implementation=attn, **overrides)
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4)
    max_kept = run_and_compare(model, cache, [ids], mask, decode_steps=30)
    assert cache.num_compactions >= 5 and cache.evicted
    assert max_kept <= 16 + 4
    if arch != "gemma3_text":  # gemma3_text has one full-attention layer: nothing to differ from
        assert _layers_differ(cache, model), "every layer kept the same tokens: the per-layer masks went untested"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_default_selection_chunked_prefill_matches_per_layer_reference(arch: str, attn: str) -> None:
    """Prompt chunks that each overflow the budget: compaction during prefill, then decoding."""
    overrides = {"num_hidden_layers": 3} if arch != "gemma3_text" else {}
    model = tiny_model(arch, attn_implementation=attn, **overrides)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(40, 33), seed=1)
    cache = RopeKVCache(model, budget=12 if arch == "llama" else 16, compress_every=4, protect_prompt=False, sink=1,
                        window=2)
    max_kept = run_and_compare(model, cache, list(ids.split(8, dim=1)), mask, decode_steps=6)
    assert cache.evicted
    assert max_kept <= cache.options.budget + 4


@pytest.mark.parametrize("scorer", [None, RecencyScorer(), KeyNormScorer(), RandomScorer(seed=3)])
def test_chunked_prefill_with_eviction_matches_masked_reference(scorer) -> None:
    model = tiny_model("qwen2")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(40, 33), seed=1)
    chunks = list(ids.split(8, dim=1))
    kwargs = {} if scorer is None else {"scorer": scorer}
    cache = RopeKVCache(model, budget=12, compress_every=4, protect_prompt=False, sink=1, window=2, **kwargs)
    max_kept = run_and_compare(model, cache, chunks, mask, decode_steps=6,
                               layers_alike=isinstance(scorer, RecencyScorer))  # recency ranks alike everywhere
    assert cache.evicted
    assert max_kept <= 12 + 4


def test_padding_never_counts_toward_the_budget() -> None:
    """A padded row keeps every real token until it holds budget + compress_every of them itself."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(12, 4))  # row 1 has 8 pads
    cache = RopeKVCache(model, budget=14, compress_every=2, scorer=RecencyScorer())
    run_and_compare(model, cache, [ids], mask, decode_steps=5, layers_alike=True)
    kept = cache.kept_positions(0)
    assert cache.evicted and cache.num_compactions == 1
    # Row 0 (12 real tokens) went over the budget of 14 at decoding step 3; at the next tick of the clock (every
    # 2 steps: before steps 1, 3, 5) it came back to 14, then took step 5's token. Row 1 (4 real + 5 new) kept all 9
    # of its
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
        input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=40, pad_token_id=0, **kw
    )
    assert out.shape == (3, ids.shape[1] + 40)
    assert cache.tokens_seen == ids.shape[1] + 39
    assert 16 <= cache.tokens_kept <= 16 + 8 and cache.num_compactions >= 3


def test_per_layer_selection_keeps_layer_specific_tokens() -> None:
    model = tiny_model("llama", num_hidden_layers=3)
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4, scorer=KeyNormScorer())
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=30, pad_token_id=0)
    assert cache.evicted
    kept = [cache.kept_positions(i) for i in range(3)]
    assert all(k.shape == kept[0].shape for k in kept)  # same count everywhere ...
    assert any(not torch.equal(k, kept[0]) for k in kept[1:])  # ... but each layer chose its own


def test_storage_stays_in_place_and_bounded() -> None:
    """The arena grows in whole pages (PAGE_SIZE slots) only up to budget + compress_every; from then on decoding
    writes and compacts in place: the arena keeps its address and the bytes held stay fixed."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=100, compress_every=28)  # bound 128: two pages per layer
    layers = model.config.num_hidden_layers
    model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=2, pad_token_id=0)
    assert cache.pages_allocated == layers  # 13 tokens: one page per layer, not the whole steady-state arena
    storage = cache.layers[0].storage  # private: no public API shows where the arena lives (read its keys' address)
    ids2 = torch.cat([ids, torch.randint(3, 100, (3, 1))], dim=1)
    pointer, held = None, None
    for _ in range(200):  # decode by hand so we can look at the arena after every step
        seen = cache.tokens_seen
        mask2 = torch.ones(3, seen + 1, dtype=mask.dtype)
        mask2[:, : mask.shape[1]] = mask
        with torch.no_grad():
            model(input_ids=ids2[:, -1:], attention_mask=mask2, **cache_kw(model, cache),
                  position_ids=positions_from_mask(mask2)[:, -1:])
        assert cache.pages_allocated <= 2 * layers and cache.tokens_kept <= 128
        if cache.pages_allocated == 2 * layers:
            pointer = pointer or storage.keys.data_ptr()
            assert storage.keys.data_ptr() == pointer  # no reallocation once full
        if cache.num_compactions:  # slot positions exist from the first compaction on; then nothing grows
            held = held or cache.bytes_held
            assert cache.bytes_held == held
    assert pointer is not None and cache.num_compactions >= 4
    assert cache.bytes_held < cache.full_cache_bytes


class _OldestFirst:
    """Ranks the oldest candidates first: what survives beyond them is what the recent window protected."""

    def score(self, keys: torch.Tensor, ctx) -> torch.Tensor:
        return -ctx.slot_positions.float()


@pytest.mark.parametrize(("room", "window"), [(24, 12), (40, 20), (47, 23), (48, 32), (60, 32)])
def test_default_window_splits_a_tight_room_with_the_scorer(room, window) -> None:
    """A pinned prompt of 128 tokens and budget ``128 + room``. Below 48 slots (the 32-slot window plus the 16 the
    scorer keeps beside it) the window takes half the room; from 48 on, all 32 slots. An oldest-first scorer then
    keeps exactly the ``room - window`` first generated tokens, and the window the newest."""
    model = tiny_model("llama", num_hidden_layers=2)
    prompt = 128
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(room))
    cache = RopeKVCache(model, budget=prompt + room, compress_every=4, scorer=_OldestFirst(), static=False)
    assert cache.options.recent_window == 32  # min(32, budget // 4): the cut to the room is what is tested
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=room + 24, do_sample=False,
                   pad_token_id=0, **cache_kw(model, cache))
    assert cache.evicted
    seen = cache.tokens_seen
    generated = sorted(set(cache.kept_positions(0)[0, 0].tolist()) - set(range(prompt)))
    chosen, recent = generated[: room - window], generated[room - window:]
    assert chosen == list(range(prompt, prompt + room - window)), generated
    # the window at the last compaction, and the tokens appended since (fewer than compress_every)
    assert recent == list(range(seen - len(recent), seen)) and window <= len(recent) < window + 4, generated
    assert recent[0] > chosen[-1] + 1  # evicted tokens lie between: the scorer's part is exactly its own
