"""Options are validated once, when the cache (or ``enable``) is built, before anything uses them.

No forward runs here: every check is made by the constructor (``CacheOptions``, ``FrequencyScorer``) or by
``hf_ropekv.enable``, which checks the same options without building a cache.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import hf_ropekv
from conftest import tiny_model
from hf_ropekv import FrequencyScorer, RopeKVCache
from hf_ropekv.cache.options import DEFAULT_WINDOW, OPTION_NAMES, PAGE_SIZE, CacheOptions
from hf_ropekv.enable import is_enabled


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(budget="256"), "budget must be a positive int"),
        (dict(budget=True), "budget must be a positive int"),
        (dict(budget=0), "budget must be a positive int"),
        (dict(budget=-5), "budget must be a positive int"),
        (dict(budget=2.5), "budget must be a positive int"),
        (dict(budget=64, compress_every=0), "compress_every"),
        (dict(budget=64, compress_every=2.5), "compress_every"),
        (dict(budget=64, compress_every=True), "compress_every"),
        (dict(budget=64, window="8"), "window"),
        (dict(budget=64, window=-1), "window"),
        (dict(budget=64, sink=-1), "sink"),
        (dict(budget=64, sink=1.0), "sink"),
        (dict(budget=64, window=40, sink=30), "window .*40.* sink .*30.* smaller than budget .*64"),
        (dict(budget=8, window=6, sink=2), "smaller than budget"),
        (dict(budget=64, protect_prompt="yes"), "protect_prompt"),
        (dict(budget=64, protect_prompt=1), "protect_prompt"),
        (dict(budget=64, static="yes"), 'static must be "auto".*True.*False'),
        (dict(budget=64, static=1), "static must be"),
        (dict(budget=64, static=None), "static must be"),
        (dict(budget=64, static="Auto"), "static must be"),
        (dict(budget=64, kv_bits=4), "kv_bits must be None .* or 8"),
        (dict(budget=64, kv_bits=16), "kv_bits"),
    ],
)
def test_a_bad_option_is_a_value_error_naming_it(model, options, named) -> None:
    with pytest.raises(ValueError, match=named):
        RopeKVCache(model, **options)
    budget = options.pop("budget")
    with pytest.raises(ValueError, match=named):  # enable() checks the same, through the same class
        hf_ropekv.enable(model, budget=budget, **options)
    assert not is_enabled(model)


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(half_life=0), "half_life must be a positive number"),
        (dict(half_life=-3.0), "half_life"),
        (dict(half_life=True), "half_life"),
        (dict(half_life="128"), "half_life"),
        (dict(head_shrink=-1), "head_shrink must be a number of queries >= 0"),
        (dict(head_shrink=True), "head_shrink"),
        (dict(head_shrink=float("nan")), "head_shrink"),
        (dict(head_shrink=float("inf")), "head_shrink"),
        (dict(head_shrink="256"), "head_shrink"),
        (dict(prompt_window=-1), "prompt_window must be an int >= 0"),
        (dict(prompt_window=True), "prompt_window"),
        (dict(prompt_window=2.0), "prompt_window"),
        (dict(vote_span=-1), "vote_span must be an int >= 0"),
        (dict(vote_span=1.5), "vote_span"),
    ],
)
def test_the_statistics_settings_are_the_scorers_and_checked_there(settings, named) -> None:
    with pytest.raises(ValueError, match=named):
        FrequencyScorer(**settings)


@pytest.mark.parametrize("retired", ["stats", "stats_half_life", "stats_head_shrink", "stats_prompt_weight",
                                     "selection", "seed", "page_size", "dynamic_batch", "cuda_graphs",
                                     "learn_workload", "prior_tokens", "compres_every"])
def test_an_unknown_option_is_a_type_error_listing_the_valid_ones(model, retired: str) -> None:
    """Retired options (their settings moved to the scorer, or went) and typos are refused by name, with the list."""
    valid = r"\[" + ", ".join(f"'{name}'" for name in OPTION_NAMES) + r"\]"
    with pytest.raises(TypeError, match=rf"unknown option\(s\) \['{retired}'\]; the options are {valid}"):
        RopeKVCache(model, budget=64, **{retired: 1})
    with pytest.raises(TypeError, match=rf"unknown option\(s\) \['{retired}'\]"):
        hf_ropekv.enable(model, budget=64, **{retired: 1})
    assert not is_enabled(model)


def test_the_options_are_the_dataclass_fields_and_enable_takes_exactly_them(model) -> None:
    """One list of options: CacheOptions' fields (budget positional, the rest by keyword) plus the scorer."""
    fields = [f.name for f in dataclasses.fields(CacheOptions)]
    assert set(OPTION_NAMES) == (set(fields) - {"budget"}) | {"scorer"}
    assert len(OPTION_NAMES) <= 8  # issue 44: at most 8 keyword options
    parameters = inspect.signature(RopeKVCache.__init__).parameters
    assert list(parameters)[:3] == ["self", "model_or_config", "budget"]
    assert parameters["scorer"].kind is inspect.Parameter.KEYWORD_ONLY
    # Every option reaches cache.options, by keyword, with its value (none is lost or renamed on the way).
    given = dict(compress_every=16, window=3, sink=2, protect_prompt=False, static=False, kv_bits=None)
    assert set(given) | {"scorer"} == set(OPTION_NAMES)
    cache = RopeKVCache(model, 64, **given)
    assert cache.options == CacheOptions(budget=64, **given)
    for name in ("budget", "compress_every", "window", "sink", "protect_prompt", "selection", "page_size"):
        assert not hasattr(cache, name), f"cache.{name}: read cache.options.{name} (no pass-through properties)"


def test_the_defaults_are_written_once(model) -> None:
    cache = RopeKVCache(model)
    assert cache.options == CacheOptions()
    assert (CacheOptions().compress_every, CacheOptions().sink, CacheOptions().protect_prompt) == (128, 0, True)
    assert CacheOptions().static == "auto" and CacheOptions().kv_bits is None and CacheOptions().window is None
    assert PAGE_SIZE == 64 and DEFAULT_WINDOW == 32
    scorer = FrequencyScorer()
    assert (scorer.stats, scorer.half_life, scorer.head_shrink, scorer.offsets) == (None, 128, 256, None)
    assert isinstance(RopeKVCache(model, budget=64).scorer, FrequencyScorer)


@pytest.mark.parametrize("budget, window, resolved", [(None, None, 0), (64, None, 16), (128, None, 32),
                                                       (1024, None, 32), (12, None, 3), (64, 5, 5), (64, 0, 0)])
def test_the_default_window_is_a_quarter_of_the_budget_up_to_32(budget, window, resolved) -> None:
    assert CacheOptions(budget=budget, window=window).recent_window == resolved
    assert CacheOptions(budget=budget).steady_slots == (None if budget is None else budget + 128)


def test_the_cache_works_on_its_own_copy_of_the_scorer(model) -> None:
    """One scorer object may configure many caches (enable() does): each cache gets an independent copy."""
    scorer = FrequencyScorer(half_life=32, head_shrink=8)
    first, second = RopeKVCache(model, budget=64, scorer=scorer), RopeKVCache(model, budget=64, scorer=scorer)
    assert first.scorer is not scorer and second.scorer is not first.scorer
    assert (first.scorer.half_life, first.scorer.head_shrink) == (32, 8)
    assert scorer.stats is None  # the cache's online statistics never reach the caller's object


@pytest.mark.parametrize("scorer", [object(), lambda keys: keys, "frequency"], ids=["object", "lambda", "str"])
def test_a_scorer_without_a_score_method_is_refused(model, scorer) -> None:
    with pytest.raises(TypeError, match=r"scorer must have a `score\(keys, ctx\)` method"):
        RopeKVCache(model, budget=64, scorer=scorer)
    with pytest.raises(TypeError, match=r"scorer must have a `score\(keys, ctx\)` method"):
        hf_ropekv.enable(model, budget=64, scorer=scorer)
    assert not is_enabled(model)


def test_a_scorer_class_is_refused_up_front_with_the_scorer_message(model) -> None:
    from hf_ropekv.scorers import RecencyScorer

    with pytest.raises(TypeError, match="scorer"):
        RopeKVCache(model, budget=64, scorer=RecencyScorer)
    with pytest.raises(TypeError, match="scorer"):
        hf_ropekv.enable(model, budget=64, scorer=RecencyScorer)
    assert not is_enabled(model)
