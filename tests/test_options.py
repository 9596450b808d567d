"""Options are validated once, before use; a cache is bound to its model; small budgets hold no more than they use."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

import hf_ropekv
from hf_ropekv import RopeKVCache
from hf_ropekv.cache.options import OPTION_NAMES, CacheOptions
from hf_ropekv.scorers import RecencyScorer
from hf_ropekv.warnings import HfRopeKVWarning
from conftest import tiny_model


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(budget="256"), "budget"),
        (dict(budget=True), "budget"),
        (dict(budget=0), "budget"),
        (dict(budget=64, compress_every=0), "compress_every"),
        (dict(budget=64, compress_every=2.5), "compress_every"),
        (dict(budget=64, page_size="64"), "page_size"),
        (dict(budget=64, window="8"), "window"),
        (dict(budget=64, sink=-1), "sink"),
        (dict(budget=64, window=40, sink=30), "smaller than budget"),
        (dict(budget=64, selection="x"), "selection"),
        (dict(budget=64, protect_prompt="yes"), "protect_prompt"),
        (dict(budget=64, stats_half_life=0), "stats_half_life"),
        (dict(budget=64, stats_head_shrink=-1), "stats_head_shrink must be a number of queries >= 0"),
        (dict(budget=64, stats_head_shrink=True), "stats_head_shrink"),
        (dict(budget=64, stats_head_shrink=float("nan")), "stats_head_shrink"),
        (dict(budget=64, stats_head_shrink="256"), "stats_head_shrink"),
        (dict(budget=64, dynamic_batch="no"), "dynamic_batch must be True .* False .* or \"auto\""),
        (dict(budget=64, dynamic_batch=1), "dynamic_batch must be True"),
    ],
)
def test_a_bad_option_is_a_value_error_naming_it_before_anything_uses_it(options, named) -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=named):
        RopeKVCache(model, **options)
    budget = options.pop("budget")
    with pytest.raises(ValueError, match=named):  # enable() checks the same, through the same class
        hf_ropekv.enable(model, budget=budget, **options)
    assert not hf_ropekv.is_enabled(model)


def test_options_resolve_the_default_window_and_enable_accepts_exactly_the_constructor_options() -> None:
    assert CacheOptions(budget=64).recent_window == 16 and CacheOptions(budget=1024).recent_window == 32
    assert CacheOptions().recent_window == 0 and CacheOptions(budget=64, window=5).recent_window == 5
    import inspect

    keywords = {name for name, p in inspect.signature(RopeKVCache.__init__).parameters.items()
                if p.kind is p.KEYWORD_ONLY} - {"stats"}
    assert set(OPTION_NAMES) == keywords
    cache = RopeKVCache(tiny_model("llama"), budget=64, window=5, sink=2)
    assert (cache.budget, cache.window, cache.sink, cache.compress_every) == (64, 5, 2, 128)
    # The head shrinkage reaches the online statistics, the default and a chosen one
    assert cache.stats_head_shrink == cache._online.shrink_heads == 256
    assert RopeKVCache(tiny_model("llama"), budget=64, stats_head_shrink=0)._online.shrink_heads == 0
    learning = RopeKVCache(tiny_model("llama"), budget=64, stats_head_shrink=8.5, learn_workload=True)
    assert learning._online.shrink_heads == 8.5


def _generate(model, cache, ids, new=4):
    return model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("other_arch", ["qwen3", "llama"])
def test_a_cache_is_bound_to_its_model(other_arch) -> None:
    model, other = tiny_model("llama"), tiny_model(other_arch)
    ids = torch.randint(3, 100, (1, 6))
    with pytest.raises(ValueError, match=f"built for a LlamaForCausalLM.*{type(other).__name__}"):
        _generate(other, RopeKVCache(model, budget=16, compress_every=4), ids)
    used = RopeKVCache(model, budget=16, compress_every=4)
    _generate(model, used, ids)
    with pytest.raises(ValueError, match="bound to it"), torch.no_grad():  # a used cache continued elsewhere
        other(input_ids=ids[:, :1], past_key_values=used)
    assert used.tokens_seen == 6 + 3  # refused before anything was stored


def test_a_cache_refuses_a_model_with_more_layers() -> None:
    model, deeper = tiny_model("llama"), tiny_model("llama", num_hidden_layers=4)
    cache = RopeKVCache(model.config, budget=16, compress_every=4, scorer=RecencyScorer())  # a config: no hooks
    assert len(cache.layers) < 4
    with pytest.raises(ValueError, match="more layers"), torch.no_grad():
        deeper(input_ids=torch.randint(3, 100, (1, 6)), past_key_values=cache)


def test_a_budget_on_a_sliding_window_only_model_warns_that_it_evicts_nothing() -> None:
    model = tiny_model("mistral_sliding")
    with pytest.warns(HfRopeKVWarning, match="evicts nothing"):
        cache = RopeKVCache(model, budget=16, compress_every=4)
    ids = torch.randint(3, 100, (1, 20))
    _generate(model, cache, ids, new=10)
    reference = DynamicCache(config=model.config)
    _generate(model, reference, ids, new=10)
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in reference.layers)
    assert cache.full_cache_bytes == held > 0  # counts the windows DynamicCache holds
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RopeKVCache(model)  # no budget: nothing to warn about


@pytest.mark.parametrize("budget, every", [(8, 4), (24, 16), (40, 8)])
def test_a_small_budget_holds_no_more_than_dynamic_cache(budget, every) -> None:
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 6))
    cache = RopeKVCache(model, budget=budget, compress_every=every, window=0)
    _generate(model, cache, ids, new=80)
    reference = DynamicCache(config=model.config)
    _generate(model, reference, ids, new=80)
    held = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in reference.layers)
    assert cache.num_compactions > 0
    assert cache._full_layers[0].storage.capacity == budget + every  # not rounded up to a 64-slot page
    assert cache.bytes_held < held
