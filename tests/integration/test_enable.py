"""hf_ropekv.enable / disable / enabled: a fresh RopeKVCache for every generate() call that passes no cache.

The reference for every check is the same generate() call with a hand-made ``RopeKVCache(model, **options)``:
enabling must change nothing but who builds the cache.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, StaticCache, TextStreamer, pipeline

from conftest import padded_batch, tiny_model, tiny_tokenizer
from hf_ropekv import FrequencyScorer, HfRopeKVWarning, RopeKVCache, disable, enable, enabled
from hf_ropekv._compat import TRANSFORMERS_VERSION
from hf_ropekv.enable import is_enabled
from hf_ropekv.scorers import RandomScorer, RecencyScorer

# The tiny budgets here are meant: their warning is checked once, in test_risky_settings_warn.
pytestmark = pytest.mark.filterwarnings("ignore:hf_ropekv.enable. budget=16 is small")

# A budget small enough that 30 new tokens evict (prompts are at most 12 tokens).
OPTIONS = dict(budget=16, compress_every=4)
NEW = 24


# --------------------------------------------------------------------------- helpers


def cache_kwarg(cache) -> dict:
    """The generate() keyword for a cache object on this transformers version (5.24 renamed it)."""
    return {"cache" if TRANSFORMERS_VERSION.release >= (5, 24) else "past_key_values": cache}


def gen(model, ids, mask, cache=None, **kwargs) -> torch.Tensor:
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("pad_token_id", 0)
    extra = cache_kwarg(cache) if cache is not None else {}
    return model.generate(input_ids=ids, attention_mask=mask, **extra, **kwargs)


class CacheSpy:
    """Records the cache object each model forward receives (one entry per distinct object, in order)."""

    def __init__(self, model) -> None:
        self.caches: list = []
        self.prefills = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            return
        if not any(c is cache for c in self.caches):
            self.caches.append(cache)
            self.prefills += 1

    def types(self) -> list[str]:
        return [type(c).__name__ for c in self.caches]

    def remove(self) -> None:
        self._handle.remove()


@pytest.fixture
def model():
    m = tiny_model("llama")
    yield m
    disable(m)


@pytest.fixture(autouse=True)
def _fresh_warning_once():
    # transformers' Logger.warning_once remembers messages for the whole process.
    clear = getattr(logging.Logger.warning_once, "cache_clear", None)
    if clear is not None:
        clear()
    yield


# --------------------------------------------------------------------------- the must-show tests


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_two_batched_calls_equal_two_fresh_caches(arch: str) -> None:
    model = tiny_model(arch)
    first, first_mask = padded_batch(seed=1)
    second, second_mask = padded_batch(lengths=(7, 11), seed=2)

    hand = [RopeKVCache(model, **OPTIONS), RopeKVCache(model, **OPTIONS)]
    want_first = gen(model, first, first_mask, hand[0])
    want_second = gen(model, second, second_mask, hand[1])
    assert all(c.num_compactions > 0 for c in hand), "the test must exercise eviction"

    enable(model, **OPTIONS)
    spy = CacheSpy(model)
    try:
        got_first = gen(model, first, first_mask)
        got_second = gen(model, second, second_mask)
    finally:
        spy.remove()
        disable(model)
    assert torch.equal(got_first, want_first)
    assert torch.equal(got_second, want_second)
    assert spy.types() == ["RopeKVCache", "RopeKVCache"]
    assert spy.caches[0] is not spy.caches[1]
    assert all(c.num_compactions > 0 and c.options.budget == 16 for c in spy.caches)


def test_disable_restores_dynamic_cache(model) -> None:
    ids, mask = padded_batch()
    before_attrs = dict(model.__dict__)
    spy = CacheSpy(model)
    plain = gen(model, ids, mask)

    enable(model, **OPTIONS)
    assert is_enabled(model)
    budgeted = gen(model, ids, mask)
    assert type(spy.caches[-1]) is RopeKVCache
    assert not torch.equal(budgeted, plain)  # eviction changed the continuation of this random model

    assert disable(model) is model
    assert not is_enabled(model)
    after = gen(model, ids, mask)
    spy.remove()
    assert type(spy.caches[-1]) is DynamicCache
    spy.caches.clear()  # the RopeKVCache's hooks stay while it lives, and go with it
    assert torch.equal(after, plain)
    assert model.__dict__.keys() == before_attrs.keys()
    assert all(model.__dict__[k] is v for k, v in before_attrs.items())
    assert "_prepare_cache_for_generation" not in model.__dict__
    disable(model)  # a no-op when not enabled


def test_user_passed_cache_wins(model) -> None:
    ids, mask = padded_batch()
    enable(model, **OPTIONS)
    spy = CacheSpy(model)

    mine = RopeKVCache(model, budget=20, compress_every=8)
    gen(model, ids, mask, mine)
    assert spy.caches[-1] is mine and mine.tokens_seen > 0

    dynamic = DynamicCache(config=model.config)
    out = gen(model, ids, mask, dynamic)
    assert spy.caches[-1] is dynamic
    spy.remove()
    disable(model)
    assert torch.equal(out, gen(model, ids, mask))


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_user_cache_under_either_keyword(model, name: str) -> None:
    new_name = TRANSFORMERS_VERSION.release >= (5, 24)
    if name == "cache" and not new_name:
        pytest.skip("generate(cache=...) exists from transformers 5.24")
    ids, mask = padded_batch(lengths=(5, 8))
    enable(model, **OPTIONS)
    spy = CacheSpy(model)
    mine = DynamicCache(config=model.config)
    with pytest.warns(FutureWarning) if name == "past_key_values" and new_name else contextlib.nullcontext():
        model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=5, **{name: mine})
    spy.remove()
    assert spy.caches == [mine]


def test_generation_config_changes(model) -> None:
    ids, mask = padded_batch(lengths=(10, 4))
    want = gen(model, ids, mask, RopeKVCache(model, **OPTIONS))
    enable(model, **OPTIONS)
    spy = CacheSpy(model)

    # A replaced generation_config, and one passed per call.
    model.generation_config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    out = model.generate(input_ids=ids, attention_mask=mask)
    assert torch.equal(out, want)
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    )
    assert torch.equal(out, want)
    # A mutated one.
    model.generation_config.max_new_tokens = 12
    assert model.generate(input_ids=ids, attention_mask=mask).shape[1] == ids.shape[1] + 12
    assert spy.types() == ["RopeKVCache"] * 3

    # Explicit choices keep their transformers meaning.
    model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static")
    assert isinstance(spy.caches[-1], StaticCache)
    model.generation_config.cache_implementation = "dynamic"
    model.generate(input_ids=ids, attention_mask=mask)
    assert type(spy.caches[-1]) is RopeKVCache
    count = len(spy.caches)
    model.generate(input_ids=ids, attention_mask=mask, use_cache=False)
    assert len(spy.caches) == count  # no cache at all
    spy.remove()


def test_beam_search_and_sampling(model) -> None:
    ids, mask = padded_batch(lengths=(9, 5))
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=20)
    want_beams = gen(model, ids, mask, RopeKVCache(model, **OPTIONS), **beams)
    torch.manual_seed(7)
    want_sample = gen(model, ids, mask, RopeKVCache(model, **OPTIONS), do_sample=True, top_k=20)
    with enabled(model, **OPTIONS):
        spy = CacheSpy(model)
        got_beams = gen(model, ids, mask, **beams)
        torch.manual_seed(7)
        got_sample = gen(model, ids, mask, do_sample=True, top_k=20)
        spy.remove()
    assert torch.equal(got_beams, want_beams)
    assert torch.equal(got_sample, want_sample)
    assert spy.types() == ["RopeKVCache", "RopeKVCache"]
    assert spy.caches[0].num_compactions > 0


def test_pipeline_text_generation(model) -> None:
    tokenizer = tiny_tokenizer()
    prompts = ["w5 w7 w9 w11 w13 w17", "w3 w4 w8"]
    kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        out = gen(model, enc["input_ids"], enc["attention_mask"], RopeKVCache(model, **OPTIONS), **kwargs)
        want.append(tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    # A batch is not the same computation as its rows alone (left padding, statistics of both prompts), so the
    # batched pipeline is compared with a hand-made batched call.
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = gen(model, enc["input_ids"], enc["attention_mask"], RopeKVCache(model, **OPTIONS), **kwargs)
    want_batched = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)

    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    enable(model, **OPTIONS)
    spy = CacheSpy(model)
    one_by_one = pipe(prompts, return_full_text=False, **kwargs)
    batched = pipe(prompts, return_full_text=False, batch_size=2, **kwargs)
    spy.remove()
    assert [r[0]["generated_text"] for r in one_by_one] == want
    assert [r[0]["generated_text"] for r in batched] == want_batched
    assert spy.types() == ["RopeKVCache"] * 3  # two single prompts, then one batch of two
    assert spy.caches[-1].batch_size == 2


def test_text_streamer(model) -> None:
    tokenizer = tiny_tokenizer()

    class Collect(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True)
            self.parts: list[str] = []

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            self.parts.append(text)

    enc = tokenizer("w5 w7 w9 w11", return_tensors="pt")
    streamer = Collect()
    with enabled(model, **OPTIONS):
        out = model.generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=0, streamer=streamer)
    want = gen(model, enc["input_ids"], enc["attention_mask"], RopeKVCache(model, **OPTIONS))
    assert torch.equal(out, want)
    streamed = "".join(streamer.parts)
    assert streamed.strip() == tokenizer.decode(out[0, enc["input_ids"].shape[1] :]).strip()
    assert len(streamer.parts) > 1  # it really streamed


# --------------------------------------------------------------------------- context manager, options, warnings


def test_context_manager_restores_on_exception(model) -> None:
    before = dict(model.__dict__)
    ids, mask = padded_batch(lengths=(6,))
    spy = CacheSpy(model)
    with enabled(model, budget=16, compress_every=4):
        gen(model, ids, mask, max_new_tokens=4)
        assert spy.caches[-1].options.budget == 16
        with pytest.raises(RuntimeError, match="boom"):
            with enabled(model, budget=None):
                raise RuntimeError("boom")
        assert is_enabled(model)
    assert not is_enabled(model)
    gen(model, ids, mask, max_new_tokens=4)
    spy.remove()
    assert type(spy.caches[-1]) is DynamicCache
    spy.caches.clear()  # a RopeKVCache's own hooks go with it
    assert model.__dict__.keys() == before.keys()


def test_an_inner_block_restores_the_outer_blocks_options(model) -> None:
    ids, mask = padded_batch(lengths=(6,))
    spy = CacheSpy(model)
    with enabled(model, budget=16, compress_every=4):
        with enabled(model, budget=24, compress_every=8):
            gen(model, ids, mask, max_new_tokens=4)
            assert spy.caches[-1].options.budget == 24
        gen(model, ids, mask, max_new_tokens=4)
        spy.remove()
        assert spy.caches[-1].options.budget == 16


def test_disable_inside_a_block_is_undone_with_the_options_from_before(model) -> None:
    ids, mask = padded_batch(lengths=(6,))
    enable(model, budget=16)
    with enabled(model, budget=32):
        disable(model)
        assert not is_enabled(model)
    assert is_enabled(model)
    spy = CacheSpy(model)
    gen(model, ids, mask, max_new_tokens=4)
    spy.remove()
    assert spy.caches[-1].options.budget == 16


def test_options_are_validated_eagerly(model) -> None:
    before = dict(model.__dict__)
    with pytest.raises(TypeError, match="unknown option"):
        enable(model, budget=64, compress_evry=8)
    with pytest.raises(ValueError, match="budget"):
        enable(model, budget=0)
    with pytest.raises(ValueError, match="window"):
        enable(model, budget=64, window=40, sink=30)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['selection'\]"):
        enable(model, budget=64, selection="global")  # retired: every layer ranks its own keys
    with pytest.raises(TypeError, match="score"):
        enable(model, budget=64, scorer=object())
    with pytest.raises(TypeError, match="generate"):
        enable(torch.nn.Linear(2, 2), budget=64)
    with pytest.raises(FileNotFoundError):
        enable(model, budget=64, scorer=FrequencyScorer(stats="/nonexistent/stats.safetensors"))
    with pytest.raises(ValueError, match="static=True needs a budget"):
        enable(model, static=True)
    assert model.__dict__.keys() == before.keys()
    assert enable(model, budget=64) is model and is_enabled(model)


def test_every_cache_gets_its_own_copy_of_the_scorer(model) -> None:
    ids, mask = padded_batch(lengths=(8, 8))
    want = gen(model, ids, mask, RopeKVCache(model, scorer=RandomScorer(seed=3), **OPTIONS))
    shared = RandomScorer(seed=3)
    with enabled(model, scorer=shared, **OPTIONS):
        spy = CacheSpy(model)
        assert torch.equal(gen(model, ids, mask), want)
        assert torch.equal(gen(model, ids, mask), want)
        spy.remove()
    first, second = (cache.scorer for cache in spy.caches)
    assert isinstance(first, RandomScorer) and first is not second and shared is not first and shared is not second
    with enabled(model, scorer=RecencyScorer(), **OPTIONS):
        gen(model, ids, mask, max_new_tokens=8)


def test_calibrated_stats_are_loaded_once(model, tmp_path) -> None:
    """A statistics file given to enable() is read and checked when enable() is called (a bad file fails there),
    and every cache it makes shares those statistics (not one load per generate)."""
    from hf_ropekv.statistics.calibration import calibrate

    stats = calibrate(model, None, torch.randint(2, 128, (4, 32), generator=torch.Generator().manual_seed(0)),
                      progress=False)
    path = tmp_path / "tiny.ropekv.safetensors"
    stats.save(path)
    ids, mask = padded_batch()
    want = gen(model, ids, mask, RopeKVCache(model, scorer=FrequencyScorer(stats=stats, offsets=(1, 8, 64)),
                                             **OPTIONS))
    with enabled(model, scorer=FrequencyScorer(stats=path, offsets=(1, 8, 64)), **OPTIONS):
        path.unlink()  # read once, in enable(): no later cache may need the file
        spy = CacheSpy(model)
        assert torch.equal(gen(model, ids, mask), want)
        assert torch.equal(gen(model, ids, mask), want)
        spy.remove()
    first, second = (cache.scorer.stats for cache in spy.caches)
    assert first is second and torch.equal(first.q_mean, stats.q_mean)


def test_risky_settings_warn(model) -> None:
    with pytest.warns(HfRopeKVWarning) as caught:
        enable(model, budget=40, compress_every=64)
    text = " ".join(str(w.message) for w in caught)
    assert "budget=40 is small" in text
    assert all(w.filename == __file__ for w in caught)  # attributed to the caller's line
    disable(model)

    model.generation_config.cache_implementation = "static"
    with pytest.warns(HfRopeKVWarning, match="cache_implementation='static'"):
        enable(model, budget=512)
    model.generation_config.cache_implementation = None
    disable(model)


def test_cropping_modes_fall_back_to_dynamic_cache(model) -> None:
    ids, mask = padded_batch(lengths=(12,))
    ids[0, 6:] = ids[0, :6]  # a repetition for prompt lookup to find
    enable(model, **OPTIONS)
    spy = CacheSpy(model)
    with pytest.warns(HfRopeKVWarning, match="assisted_generation"):
        out = gen(model, ids, mask, prompt_lookup_num_tokens=3, max_new_tokens=10)
    assert type(spy.caches[-1]) is DynamicCache
    want = gen(model, ids, mask, DynamicCache(config=model.config), prompt_lookup_num_tokens=3, max_new_tokens=10)
    assert torch.equal(out, want)
    # Plain decoding still gets RopeKVCache.
    gen(model, ids, mask, max_new_tokens=4)
    spy.remove()
    assert type(spy.caches[-1]) is RopeKVCache


def test_deepcopy_of_an_enabled_model(model) -> None:
    ids, mask = padded_batch(lengths=(7, 4))
    enable(model, **OPTIONS)
    clone = copy.deepcopy(model)
    assert is_enabled(clone)
    spy = CacheSpy(clone)
    out = gen(clone, ids, mask)
    spy.remove()
    assert torch.equal(out, gen(model, ids, mask))
    assert type(spy.caches[-1]) is RopeKVCache and spy.caches[-1].num_compactions > 0
    disable(clone)
    assert is_enabled(model) and not is_enabled(clone)


def test_returned_cache_continues(model) -> None:
    ids, mask = padded_batch(lengths=(6, 6))
    enable(model, **OPTIONS)
    out = model.generate(
        input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=20, do_sample=False,
        return_dict_in_generate=True
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, RopeKVCache) and cache.num_compactions > 0
    more = torch.cat([out.sequences, torch.full((2, 1), 5)], dim=1)
    more_mask = torch.cat([mask, torch.ones(2, 21, dtype=mask.dtype)], dim=1)
    cont = gen(model, more, more_mask, cache, max_new_tokens=5)  # the user passes it back: it wins
    assert cont.shape[1] == more.shape[1] + 5 and cache.tokens_seen == more.shape[1] + 4


def test_wrapper_delegating_generate(model) -> None:
    """Wrappers such as PEFT's PeftModel delegate generate() to get_base_model(): the hook goes there."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

        def generate(self, **kwargs):
            return self.inner.generate(**kwargs)

    wrapper = Wrapper(model)
    assert enable(wrapper, **OPTIONS) is wrapper
    assert is_enabled(wrapper) and is_enabled(model)
    spy = CacheSpy(model)
    ids, mask = padded_batch(lengths=(5,))
    wrapper.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    spy.remove()
    assert type(spy.caches[-1]) is RopeKVCache
    disable(wrapper)
    assert not is_enabled(model)


def test_pickled_enabled_model_stays_enabled_with_the_same_options(model) -> None:
    """A pickled copy, like a deep copy, stays enabled with the original's options, bound to the copy."""
    import pickle

    ids, mask = padded_batch(lengths=(6,))
    enable(model, **OPTIONS)
    clone = pickle.loads(pickle.dumps(model))
    assert is_enabled(clone)
    spy = CacheSpy(clone)
    assert torch.equal(gen(clone, ids, mask), gen(model, ids, mask))
    spy.remove()
    assert type(spy.caches[-1]) is RopeKVCache
    assert spy.caches[-1].options == RopeKVCache(clone, **OPTIONS).options
    disable(clone)
    assert not is_enabled(clone) and "_prepare_cache_for_generation" not in clone.__dict__


def test_top_level_exports() -> None:
    """At most 15 names (issue 44), the documented ones; the scorers live in hf_ropekv.scorers."""
    import hf_ropekv

    assert len(hf_ropekv.__all__) <= 15
    assert {"RopeKVCache", "FrequencyScorer", "FrequencyStats", "calibrate", "enable", "disable", "enabled",
            "last_summary", "detach", "CacheSummary", "Scorer", "ScoreContext",
            "HfRopeKVWarning"} <= set(hf_ropekv.__all__)
    assert all(hasattr(hf_ropekv, name) for name in hf_ropekv.__all__)
    assert (hf_ropekv.enable, hf_ropekv.disable, hf_ropekv.enabled) == (enable, disable, enabled)
    for gone in ("last_cache", "is_enabled", "RecencyScorer", "workload_statistics", "release_static_buffers",
                 "score_keys", "save_compile_artifacts"):
        assert not hasattr(hf_ropekv, gone), gone
