"""No hidden ties to the model: with the garbage collector off, ``del model`` frees it whatever hf_ropekv did
with it, and once no live model uses hf_ropekv nothing of it stays patched into transformers.

Reference: a model that never met hf_ropekv is freed by reference counting alone (checked first, so a failure
below is hf_ropekv's and not the tiny model's).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import rotary_is_patched, tiny_model
from transformers.models.llama import modeling_llama

import hf_ropekv
from hf_ropekv import RopeKVCache, _compat
from hf_ropekv.storage.buffers import BufferPool

pytestmark = pytest.mark.filterwarnings("ignore:hf_ropekv.enable. budget=16 is small")


@pytest.fixture
def gc_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def _generate(model, **cache_kwargs) -> torch.Tensor:
    prompt = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                           pad_token_id=0, **cache_kwargs)


def _is_patched() -> bool:
    return rotary_is_patched(modeling_llama)


def test_a_plain_model_is_freed_by_reference_counting(gc_off) -> None:
    model = tiny_model("llama")
    _generate(model)
    alive = weakref.ref(model)
    del model
    assert alive() is None


USES = {
    "explicit cache, never run": lambda m: [RopeKVCache(m, budget=16, compress_every=8)],
    "explicit cache, generate ran": lambda m: [_run(m, RopeKVCache(m, budget=16, compress_every=8))],
    "static cache, never run": lambda m: [RopeKVCache(m, budget=16, static=True)],
    "static cache, generate ran": lambda m: [_run(m, RopeKVCache(m, budget=16, compress_every=8, static=True))],
    "enable, generate ran": lambda m: [hf_ropekv.enable(m, budget=16, compress_every=8), _generate(m)][1:],
}


def _run(model, cache):
    _generate(model, **{_compat.cache_kwarg(model): cache})
    return cache


@pytest.mark.parametrize("keep_cache", [True, False], ids=["cache alive", "cache gone"])
@pytest.mark.parametrize("use", list(USES))
def test_del_model_frees_it_without_the_garbage_collector(use: str, keep_cache: bool, gc_off) -> None:
    model = tiny_model("llama")
    held = USES[use](model)
    if not keep_cache:
        del held
    alive = weakref.ref(model)
    del model
    assert alive() is None, gc.get_referrers(alive())
    if keep_cache:
        del held
    assert not _is_patched()


def test_rotary_function_is_given_back_when_the_last_model_goes(gc_off) -> None:
    first, second = tiny_model("llama"), tiny_model("llama")
    kept = _run(first, RopeKVCache(first, budget=16, compress_every=8, static=True))
    in_use = _run(second, RopeKVCache(second, budget=16, compress_every=8))
    assert _is_patched()
    del first, kept
    assert _is_patched()  # the second model still uses it: its cache is alive
    del second, in_use
    assert not _is_patched()


def test_detach_removes_everything_and_is_idempotent() -> None:
    model = tiny_model("llama")
    reference = _generate(model)
    before = dict(model.__dict__)
    cache = _run(model, RopeKVCache(model, budget=16, compress_every=8, static=True))
    hf_ropekv.enable(model, budget=16, compress_every=8)
    _generate(model)
    assert _is_patched() and model.config._attn_implementation != "sdpa"
    hf_ropekv.detach(model)
    hf_ropekv.detach(model)  # idempotent
    assert not _is_patched() and not hf_ropekv.is_enabled(model)
    assert model.config._attn_implementation == "sdpa"
    assert set(model.__dict__) == set(before)
    assert not model._forward_pre_hooks and not model._forward_hooks
    for module in model.modules():
        assert "forward" not in module.__dict__
    assert model not in BufferPool._BY_MODEL
    assert torch.equal(_generate(model), reference)
    with pytest.raises(RuntimeError, match="detach"):
        _generate(model, **{_compat.cache_kwarg(model): cache})


def test_detach_cleans_a_copy_that_came_with_the_originals_hooks() -> None:
    import copy

    model = tiny_model("llama")
    kept = _run(model, RopeKVCache(model, budget=16, compress_every=8, static=True))
    clone = copy.deepcopy(model)
    assert clone.config._attn_implementation != "sdpa" and clone._forward_pre_hooks
    hf_ropekv.detach(clone)
    assert clone.config._attn_implementation == "sdpa" and not clone._forward_pre_hooks
    assert not any("forward" in module.__dict__ for module in clone.modules())
    assert kept._attachment._hooks.attachments  # the original keeps its hooks


def test_detach_of_an_untouched_model_is_a_no_op() -> None:
    model = tiny_model("llama")
    hf_ropekv.detach(model)
    assert not model._forward_pre_hooks
