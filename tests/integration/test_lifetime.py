"""No hidden ties to the model: with the garbage collector off, ``del model`` frees it whatever hf_ropekv did with
it; once a model's last cache goes, nothing of hf_ropekv is left on it (hooks, wrapped methods, a switched attention
implementation) nor patched into transformers' modeling modules; ``hf_ropekv.detach`` takes everything off at once.

Two families: Llama (queries taken by hooks on ``q_proj``) and Phi-3 (a fused QKV projection: queries taken where
its modeling module applies RoPE). Reference: a model that never met hf_ropekv is freed by reference counting alone
(checked first, so a failure below is hf_ropekv's and not the tiny model's).
"""

from __future__ import annotations

import copy
import gc
import importlib
import weakref

import pytest
import torch
from conftest import family_model, leftovers, rotary_is_patched

import hf_ropekv
from hf_ropekv import RopeKVCache, _compat
from hf_ropekv.enable import is_enabled

pytestmark = pytest.mark.filterwarnings("ignore:hf_ropekv.enable. budget=16 is small")
ARCHS = ["llama", "phi3"]


def _generate(model, **cache_kwargs) -> torch.Tensor:
    prompt = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                          pad_token_id=0, **cache_kwargs)


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    """The first model built and run in a process can stay referenced by a frame that transformers or torch keeps
    from their first call (an import-time traceback): build and run each family once before checking anything."""
    for arch in ARCHS:
        _generate(family_model(arch))
    gc.collect()


def _modeling(model):
    return importlib.import_module(type(model).__module__)


def _run(model, cache):
    _generate(model, **{_compat.cache_kwarg(model): cache})
    return cache


@pytest.mark.parametrize("arch", ARCHS)
def test_a_plain_model_is_freed_by_reference_counting(arch: str, gc_off) -> None:
    model = family_model(arch)
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


@pytest.mark.parametrize("keep_cache", [True, False], ids=["cache alive", "cache gone"])
@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("arch", ARCHS)
def test_del_model_frees_it_without_the_garbage_collector(arch: str, use: str, keep_cache: bool, gc_off) -> None:
    model = family_model(arch)
    modeling = _modeling(model)
    held = USES[use](model)
    if not keep_cache:
        del held
        if not use.startswith("enable"):
            assert leftovers(model) == [], "the last cache went: so must its hooks"
    alive = weakref.ref(model)
    del model
    assert alive() is None, gc.get_referrers(alive())
    if keep_cache:
        del held
    assert not rotary_is_patched(modeling)


def test_the_rotary_function_is_given_back_when_the_last_capturing_model_goes(gc_off) -> None:
    """Phi-3's queries are taken where its modeling module applies RoPE; the function is given back once no live
    cache of any model needs it (here: a static cache's model goes first, a growing one's after)."""
    first, second = family_model("phi3"), family_model("phi3", seed=1)
    modeling = _modeling(first)
    assert not rotary_is_patched(modeling)
    kept = _run(first, RopeKVCache(first, budget=16, compress_every=8, static=True))
    in_use = _run(second, RopeKVCache(second, budget=16, compress_every=8))
    assert rotary_is_patched(modeling), "no patch to give back: this test would check nothing"
    del first, kept
    assert rotary_is_patched(modeling)  # the second model still uses it: its cache is alive
    del second, in_use
    assert not rotary_is_patched(modeling)


@pytest.mark.parametrize("arch", ARCHS)
def test_detach_removes_everything_and_is_idempotent(arch: str) -> None:
    model = family_model(arch)
    modeling = _modeling(model)
    reference = _generate(model)
    before = dict(model.__dict__)
    cache = _run(model, RopeKVCache(model, budget=16, compress_every=8, static=True))
    hf_ropekv.enable(model, budget=16, compress_every=8)
    _generate(model)
    assert leftovers(model) and is_enabled(model)
    assert rotary_is_patched(modeling) is (arch == "phi3")
    hf_ropekv.detach(model)
    hf_ropekv.detach(model)  # idempotent
    assert leftovers(model) == [] and not is_enabled(model) and not rotary_is_patched(modeling)
    assert set(model.__dict__) == set(before)
    from hf_ropekv.storage.buffers import BufferPool  # private: what detach frees is the model's pool of buffers

    assert model not in BufferPool._BY_MODEL
    assert torch.equal(_generate(model), reference)
    with pytest.raises(RuntimeError, match="detach"):
        _generate(model, **{_compat.cache_kwarg(model): cache})
    _run(model, RopeKVCache(model, budget=16, compress_every=8))  # a later cache attaches again


def test_detach_cleans_a_copy_that_came_with_the_originals_hooks() -> None:
    model = family_model("phi3")
    kept = _run(model, RopeKVCache(model, budget=16, compress_every=8, static=True))
    clone = copy.deepcopy(model)
    assert leftovers(clone)  # what was on the original came along (inert)
    hf_ropekv.detach(clone)
    assert leftovers(clone) == []
    assert leftovers(model) and kept.tokens_seen > 0  # the original keeps its hooks
    assert torch.equal(_generate(clone), _generate(model))


def test_detach_of_an_untouched_model_is_a_no_op() -> None:
    model = family_model("llama")
    hf_ropekv.detach(model)
    assert leftovers(model) == []
