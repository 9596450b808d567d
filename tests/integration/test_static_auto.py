"""static="auto", the default: compiled decoding on CUDA for long generations, eager everywhere else (issue 27,
item 5; ``hf_ropekv.cache.auto_static``).

On the CPU, generate never compiles; a compile config with ``_compile_all_devices`` (what generate itself honours)
stands in for CUDA, and the length threshold is lowered so that the generations stay short.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import padded_batch, tiny_model
from test_static_cache import compiled, generate
from hf_ropekv import CacheSummary, RecencyScorer, RopeKVCache, SnapKVScorer
from hf_ropekv.cache import auto_static

BUDGET, EVERY = 16, 4
LOGGER = "hf_ropekv.cache.auto_static"


@pytest.fixture(autouse=True)
def short_auto_threshold(monkeypatch, fresh_dynamo):
    monkeypatch.setattr(auto_static, "AUTO_STATIC_MIN_NEW_TOKENS", 20)


def _auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def test_default_is_auto_and_cpu_stays_eager(caplog) -> None:
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
    assert cache.options.static == "auto" and not cache.static and "undecided" in cache.static_reason
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = generate(model, cache, ids, mask, new=40)
    assert not cache.static and not cache.is_compileable
    assert "on cpu" in cache.static_reason and "CUDA" in cache.static_reason
    lines = _auto_lines(caplog)
    assert len(lines) == 1 and "eager" in lines[0] and "cpu" in lines[0]
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False), ids, mask, new=40)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("arch,new,goes_static", [("llama", 40, True), ("llama", 10, False),
                                                  ("gemma3_text", 40, True), ("qwen2_sliding", 40, True)])
def test_compiled_for_long_generations_eager_for_short(arch: str, new: int, goes_static: bool, caplog) -> None:
    """Where generate compiles (here: every device), a long generation decodes compiled, a short one eagerly, on
    full-attention and on hybrid sliding-window models; the tokens are the eager growing cache's either way, and
    each cache logs its mode once."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6, 3))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False), ids, mask,
                        new=new)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = generate(model, cache, ids, mask, new=new, compile_config=compiled())
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert cache.static is goes_static and cache.is_compileable is goes_static
    assert counters["stats"]["unique_graphs"] == (1 if goes_static else 0)
    lines = _auto_lines(caplog)
    assert len(lines) == 1
    if goes_static:
        assert "compiled" in lines[0] and f"max_new_tokens={new} >= 20" in cache.static_reason
        assert cache.num_compactions >= 5
    else:
        assert "eager" in lines[0] and "AUTO_STATIC_MIN_NEW_TOKENS" in cache.static_reason
    summary = CacheSummary.from_cache(cache)
    assert summary.static is goes_static and summary.static_reason == cache.static_reason


def test_decision_is_taken_once(caplog) -> None:
    """generate asks whether to compile more than once in a call (5.24: its chunked prefill asks again): the cache
    decides at the first question, logs once, and later questions get transformers' own answer."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        generate(model, cache, ids, mask, new=30, compile_config=compiled(), prefill_chunk_size=4)
    assert cache.static and len(_auto_lines(caplog)) == 1
    assert counters["stats"]["unique_graphs"] == 1  # the chunks ran eagerly, the decode step compiled


@pytest.mark.parametrize("case", ["no budget", "config", "snapkv", "hand-written loop"])
def test_unsupported_stays_eager_with_a_reason(case: str, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        if case == "no budget":
            cache = RopeKVCache(tiny_model("llama"))
            assert "no budget" in cache.static_reason
        elif case == "config":
            cache = RopeKVCache(tiny_model("llama").config, budget=BUDGET, scorer=RecencyScorer())
            assert "config" in cache.static_reason
        elif case == "snapkv":
            cache = RopeKVCache(tiny_model("llama"), budget=BUDGET, scorer=SnapKVScorer(window=4))
            assert "SnapKVScorer" in cache.static_reason
        else:
            model = tiny_model("llama")
            ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
            cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            assert "before generate()" in cache.static_reason
    assert not cache.static
    assert len(_auto_lines(caplog)) == 1


def test_static_true_and_false_unchanged(caplog) -> None:
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert RopeKVCache(model, budget=BUDGET, static=True).static
        assert RopeKVCache(model, budget=BUDGET, static=True).static_reason == "static=True"
        assert not RopeKVCache(model, budget=BUDGET, static=False).static
    assert _auto_lines(caplog) == []
    with pytest.raises(ValueError, match="static=True needs a budget"):
        RopeKVCache(model, static=True)


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_invalid_static_is_refused(value) -> None:
    with pytest.raises(ValueError, match="static must be True.*False.*auto"):
        RopeKVCache(tiny_model("llama"), budget=BUDGET, static=value)
