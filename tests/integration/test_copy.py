"""``copy.deepcopy(cache)``: an independent cache that continues exactly like the original.

References: transformers' prompt-reuse recipe on ``DynamicCache`` (nothing evicted), and a cache that was never
copied, run through the same inputs (with eviction). Online statistics are on wherever a budget is set, so the
copies' query hooks matter: a hook acting on another cache's forward would change what gets evicted.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from conftest import leftovers, padded_batch, tiny_model
from transformers import DynamicCache

from hf_ropekv import RopeKVCache, _compat
from hf_ropekv.enable import is_enabled

PROMPT_LEN = 16
EVICTING = dict(budget=24, compress_every=4)  # a 16-token prompt is pinned; 30 new tokens force compactions


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")  # QK-norm: query capture hooks sit on q_norm


def ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


SYSTEM = ids(PROMPT_LEN, seed=0)
REQUESTS = [torch.cat([SYSTEM, ids(5, seed=s)], dim=1) for s in (1, 2)]


def prefill(model, cache, prompt: torch.Tensor = SYSTEM):
    """The recipe's first step: run the shared prompt once through the model with ``cache``."""
    with torch.no_grad():
        model(prompt, attention_mask=torch.ones_like(prompt), **{_compat.cache_kwarg(model): cache})
    return cache


def generate(model, inputs: torch.Tensor, cache, new: int = 30, mask: torch.Tensor | None = None) -> torch.Tensor:
    mask = torch.ones_like(inputs) if mask is None else mask
    return model.generate(
        inputs, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
        **{_compat.cache_kwarg(model): cache},
    )


def test_prompt_reuse_recipe_matches_dynamic_cache(model) -> None:
    dynamic, ours = prefill(model, DynamicCache(config=model.config)), prefill(model, RopeKVCache(model))
    for request in REQUESTS:
        want_cache, got_cache = copy.deepcopy(dynamic), copy.deepcopy(ours)
        assert torch.equal(generate(model, request, got_cache), generate(model, request, want_cache))
        assert got_cache.get_seq_length() == want_cache.get_seq_length()
    assert ours.get_seq_length() == PROMPT_LEN  # the shared prompt cache is untouched


def test_prompt_reuse_recipe_with_eviction_matches_an_uncopied_cache(model) -> None:
    shared = prefill(model, RopeKVCache(model, **EVICTING))
    for request in REQUESTS:
        reused = copy.deepcopy(shared)
        got = generate(model, request, reused)
        assert reused.num_compactions > 0 and reused.evicted
        want = generate(model, request, prefill(model, RopeKVCache(model, **EVICTING)))
        assert torch.equal(got, want)
    assert shared.get_seq_length() == PROMPT_LEN and not shared.evicted


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_copy_after_eviction_continues_like_the_original(arch: str, static: bool) -> None:
    """A padded batch, evicted, copied mid-conversation: copy, original and a never-copied twin agree."""
    model = tiny_model(arch)
    prompt, mask = padded_batch(model.config.vocab_size, lengths=(10, 7))
    original = RopeKVCache(model, **EVICTING, static=static)
    untouched = RopeKVCache(model, **EVICTING, static=static)
    first = generate(model, prompt, original, mask=mask)
    assert torch.equal(first, generate(model, prompt, untouched, mask=mask))
    assert original.evicted
    twin = copy.deepcopy(original)
    assert repr(twin) == repr(original)
    turn = torch.cat([first, torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))], dim=1)
    turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    want = generate(model, turn, untouched, mask=turn_mask)
    assert torch.equal(generate(model, turn, twin, mask=turn_mask), want)
    assert torch.equal(generate(model, turn, original, mask=turn_mask), want)


def test_copies_do_not_disturb_each_other_or_the_original(model) -> None:
    """Two copies used in turns, then the original: each matches a run where it was the only cache."""
    shared = prefill(model, RopeKVCache(model, **EVICTING))
    first, second = copy.deepcopy(shared), copy.deepcopy(shared)

    def alone(request: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = prefill(model, RopeKVCache(model, **EVICTING))
        out = generate(model, request, cache)
        follow_up = torch.cat([out, ids(4, seed=9)], dim=1)
        return out, generate(model, follow_up, cache)

    out_first = generate(model, REQUESTS[0], first)
    out_second = generate(model, REQUESTS[1], second)  # its prompt's queries must not reach `first`'s statistics
    again_first = generate(model, torch.cat([out_first, ids(4, seed=9)], dim=1), first)
    again_second = generate(model, torch.cat([out_second, ids(4, seed=9)], dim=1), second)
    for got, want in zip((out_first, again_first, out_second, again_second), alone(REQUESTS[0]) + alone(REQUESTS[1])):
        assert torch.equal(got, want)
    assert first.num_compactions > 0 and second.num_compactions > 0
    assert torch.equal(generate(model, REQUESTS[0], shared), out_first)


def test_a_copy_goes_with_its_last_reference(gc_off) -> None:
    """No reference cycle through the copy's hooks: it is freed by reference counting; once the original goes too,
    nothing of hf_ropekv is left on the model."""
    model = tiny_model("qwen3")
    original = prefill(model, RopeKVCache(model, **EVICTING))
    generate(model, REQUESTS[0], original, new=12)
    twin = copy.deepcopy(original)
    assert torch.equal(twin.kept_positions(0), original.kept_positions(0))
    ref = weakref.ref(twin)
    del twin
    assert ref() is None
    assert leftovers(model)  # the original's hooks stay while it lives
    del original
    assert leftovers(model) == []


def test_copy_of_a_cache_built_from_a_config(model) -> None:
    from hf_ropekv.scorers import KeyNormScorer

    def fresh():
        return RopeKVCache(model.config, scorer=KeyNormScorer(), **EVICTING)

    original, untouched = prefill(model, fresh()), prefill(model, fresh())
    twin = copy.deepcopy(original)
    want = generate(model, REQUESTS[0], untouched)
    assert torch.equal(generate(model, REQUESTS[0], twin), want)
    assert torch.equal(generate(model, REQUESTS[0], original), want)


def test_a_failed_cache_does_not_disturb_the_next(model) -> None:
    """A cache whose forward raised midway, still referenced, stays out of later forwards of other caches."""
    failed = RopeKVCache(model, budget=8, compress_every=4)
    batch, mask = padded_batch(model.config.vocab_size, lengths=(12, 9))
    with pytest.raises(ValueError, match="prompt has"):
        generate(model, batch, failed, mask=mask)  # raises in layer 0, after its query hooks ran
    got = generate(model, REQUESTS[1], RopeKVCache(model, **EVICTING))
    del failed
    gc.collect()
    assert torch.equal(got, generate(model, REQUESTS[1], RopeKVCache(model, **EVICTING)))


# --------------------------------------------------------------------------- copies of the model itself

def _model_in_state(state: str):
    """A fresh model after one way of using hf_ropekv; returns it and what must stay alive meanwhile."""
    import hf_ropekv

    model = tiny_model("qwen3")
    held = []
    if state == "cache built":
        held.append(RopeKVCache(model, **EVICTING))
    elif state == "capturing cache alive":
        cache = RopeKVCache(model, **EVICTING)
        generate(model, REQUESTS[0], cache, new=6)
        held.append(cache)
    elif state == "static cache":
        held.append(RopeKVCache(model, budget=24, compress_every=4, static=True))
        generate(model, REQUESTS[0], held[-1], new=6)
    elif state == "enabled":
        with pytest.warns(hf_ropekv.warnings.HfRopeKVWarning, match="is small"):
            hf_ropekv.enable(model, **EVICTING)
        generate(model, REQUESTS[0], None, new=6)
    return model, held


STATES = ["cache built", "capturing cache alive", "static cache", "enabled"]


def _copy(model, how: str):
    if how == "deepcopy":
        return copy.deepcopy(model)
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _calls_into(model):
    """Count forwards of ``model`` (the original must see none while its copy generates)."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("state", STATES)
def test_a_model_copy_is_independent_and_generates_like_the_original(state: str, how: str) -> None:
    model, held = _model_in_state(state)
    clone = _copy(model, how)
    calls, handle = _calls_into(model)
    # The copy's own cache, and (enabled) the one enable gives it; the original's copied wrappers act on the copy.
    got = generate(clone, REQUESTS[1], RopeKVCache(clone, **EVICTING))
    assert not calls, "the copy's generate ran the original model"
    handle.remove()
    want = generate(model, REQUESTS[1], RopeKVCache(model, **EVICTING))
    assert torch.equal(got, want)
    if state == "enabled":
        import hf_ropekv

        assert is_enabled(clone)
        calls, handle = _calls_into(model)
        got = generate(clone, REQUESTS[1], None)
        assert not calls
        handle.remove()
        assert hf_ropekv.last_summary(clone).budget == EVICTING["budget"]  # the copy's own enable made its cache
        assert torch.equal(got, generate(model, REQUESTS[1], None))
    # the copy's hooks came as pass-throughs; its next cache installs its own, and they go with it
    del held
