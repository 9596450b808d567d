"""crop() and the decoding modes that roll the cache back (prompt lookup, assisted decoding), on every 5.x.

The reference is transformers' own ``DynamicCache``: same crop convention, same tokens and sequence length
while nothing is evicted. Once the cache would evict, every path must end in the "cannot crop" error.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from hf_ropekv import RopeKVCache, _compat

MODES = {
    "prompt_lookup": lambda assistant: dict(prompt_lookup_num_tokens=3),
    "assistant_model": lambda assistant: dict(assistant_model=assistant),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def assistant():
    return tiny_model("llama", seed=1)  # same vocabulary, other weights: it drafts tokens the model rejects


def prompt(length: int = 20, seed: int = 0) -> torch.Tensor:
    """Random ids whose second half repeats the first, so prompt lookup finds drafts."""
    half = torch.randint(3, 128, (1, length // 2), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half], dim=1)


def generate(model, ids: torch.Tensor, cache, **kwargs) -> torch.Tensor:
    kwargs = {"max_new_tokens": 12, "do_sample": False, **kwargs}
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{_compat.cache_kwarg(model): cache}, **kwargs)


def spy_crops(cache) -> list[int]:
    """Record every crop(n) generate calls on ``cache`` (an instance attribute shadows the method)."""
    calls: list[int] = []
    original = cache.crop

    def crop(n):
        calls.append(int(n))
        return original(n)

    cache.crop = crop
    return calls


def prefilled(model, cache, length: int = 10):
    with torch.no_grad():
        model(prompt(length), **{_compat.cache_kwarg(model): cache})
    return cache


@pytest.mark.parametrize("n", [0, -3, -10, 4, 10, 25])
def test_crop_follows_dynamic_cache_convention(model, n: int) -> None:
    """crop(n) keeps what DynamicCache keeps on this transformers version, or raises where it raises."""
    ours, reference = prefilled(model, RopeKVCache(model)), prefilled(model, DynamicCache(config=model.config))
    try:
        reference.crop(n)
    except ValueError:
        with pytest.raises(ValueError, match="negative"):
            ours.crop(n)
        assert n > 0 and _compat.TRANSFORMERS_VERSION >= _compat._POSITIVE_CROP_REFUSED_FROM
        return
    ours.crop(n)
    assert ours.get_seq_length() == reference.get_seq_length()
    assert isinstance(ours.get_seq_length(), int)


@pytest.mark.parametrize("budget", [None, 200])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_rolling_back_modes_match_dynamic_cache(model, assistant, mode: str, budget: int | None) -> None:
    """Nothing evicted: DynamicCache's tokens and sequence length, through real rollbacks."""
    extra = MODES[mode](assistant)
    ids = prompt(20)
    reference = DynamicCache(config=model.config)
    want = generate(model, ids, reference, **extra)
    cache = RopeKVCache(model, budget=budget, compress_every=8)
    crops = spy_crops(cache)
    got = generate(model, ids, cache, **extra)
    assert any(n < 0 for n in crops), f"no draft was rejected ({crops}): the test would not exercise a rollback"
    assert torch.equal(got, want)
    assert cache.get_seq_length() == reference.get_seq_length()
    assert not cache.evicted


def test_prompt_lookup_with_sliding_layers_matches_dynamic_cache() -> None:
    """Gemma3: sliding layers stay transformers' own (they record the past for the rollback), full ones ours."""
    model, ids = tiny_model("gemma3_text"), prompt(20)
    reference = DynamicCache(config=model.config)
    want = generate(model, ids, reference, prompt_lookup_num_tokens=3, max_new_tokens=20)
    cache = RopeKVCache(model, budget=200, compress_every=8)
    crops = spy_crops(cache)
    assert torch.equal(generate(model, ids, cache, prompt_lookup_num_tokens=3, max_new_tokens=20), want)
    assert any(n < 0 for n in crops)
    assert int(cache.get_seq_length()) == int(reference.get_seq_length())
    with pytest.raises(ValueError, match="cannot crop"):
        generate(model, ids, RopeKVCache(model, budget=24, compress_every=4), prompt_lookup_num_tokens=3,
                 max_new_tokens=30)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_conversation_continues_after_rollbacks(model, assistant, mode: str) -> None:
    """After an assisted generate, the same cache takes the next turn (no continuation-check misfire)."""
    extra = MODES[mode](assistant)
    ids = prompt(20)
    cache, reference = RopeKVCache(model), DynamicCache(config=model.config)
    first = generate(model, ids, cache, **extra)
    assert torch.equal(first, generate(model, ids, reference, **extra))
    turn = torch.cat([first, prompt(6, seed=3)], dim=1)
    assert torch.equal(generate(model, turn, cache), generate(model, turn, reference))
    assert cache.get_seq_length() == reference.get_seq_length()


def test_generate_after_a_crop_with_other_tokens(model) -> None:
    """A crop forgets the dropped tokens: inputs that differ from them are a continuation, not another sequence."""
    ids = prompt(12)
    cache, reference = RopeKVCache(model), DynamicCache(config=model.config)
    out = generate(model, ids, cache)
    generate(model, ids, reference)
    cache.crop(-5)
    reference.crop(-5)
    other = torch.cat([out[:, : cache.get_seq_length()], prompt(4, seed=7)], dim=1)
    assert torch.equal(generate(model, other, cache), generate(model, other, reference))


@pytest.mark.parametrize("protect_prompt", [True, False])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_eviction_under_rollback_gives_the_cannot_crop_error(model, assistant, mode: str, protect_prompt: bool) -> None:
    """A 20-token prompt, budget 40 (issue 14): the "cannot crop" error, not the pinned-prompt one."""
    cache = RopeKVCache(model, budget=40, compress_every=4, protect_prompt=protect_prompt)
    with pytest.raises(ValueError, match="cannot crop") as err:
        generate(model, prompt(20), cache, max_new_tokens=40, **MODES[mode](assistant))
    assert "prompt has" not in str(err.value)
    assert not cache.evicted  # refused before evicting, so the cache is still consistent


@pytest.mark.parametrize("mode", sorted(MODES))
def test_evicted_cache_is_refused_up_front(model, assistant, mode: str) -> None:
    cache = RopeKVCache(model, budget=12, compress_every=4)
    out = generate(model, prompt(10), cache, max_new_tokens=20)
    assert cache.evicted
    with pytest.raises(ValueError, match="cannot crop: tokens were already evicted"):
        generate(model, out, cache, **MODES[mode](assistant))


def test_crop_after_eviction_removes_nothing_or_raises(model) -> None:
    cache = RopeKVCache(model, budget=12, compress_every=4)
    generate(model, prompt(10), cache, max_new_tokens=20)
    seen = cache.get_seq_length()
    cache.crop(0)  # nothing to undo: honoured (generate calls it after every fully accepted draft)
    assert cache.get_seq_length() == seen
    with pytest.raises(ValueError, match="cannot crop: tokens were already evicted"):
        cache.crop(-1)
    assert cache.get_seq_length() == seen
