"""Inspecting what enable() did: last_cache, last_summary, CacheSummary, and the INFO line per generate().

References: the cache's own public properties, and a ``DynamicCache`` that transformers builds for the same
tokens, whose bytes are summed here from its layers' tensors.
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import pickle
import weakref

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList, pipeline

from conftest import padded_batch, tiny_model
from hf_ropekv import CacheSummary, RopeKVCache, disable, enable, enabled, last_cache, last_summary
from hf_ropekv._compat import TRANSFORMERS_VERSION
from hf_ropekv.cache.summary import format_bytes

# Small pages, so that the arena (rounded up to whole pages) stays below a full cache once tokens are evicted.
OPTIONS = dict(budget=16, compress_every=4, page_size=4)
NEW = 30
LOGGER = "hf_ropekv"


def gen(model, ids, mask, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("pad_token_id", 0)
    return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


def returned_cache(output):
    """The cache a ``return_dict_in_generate=True`` output carries (5.24 renamed the field to ``cache``)."""
    return output.cache if TRANSFORMERS_VERSION.release >= (5, 24) else output.past_key_values


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    """Bytes of a DynamicCache's key and value tensors, summed over its layers."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def summary_lines(records) -> list[logging.LogRecord]:
    return [r for r in records if r.name.startswith(LOGGER) and ".generate(): " in r.getMessage()]


@pytest.fixture
def model():
    m = tiny_model("llama")
    yield m
    disable(m)


# --------------------------------------------------------------------------- the numbers


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # gemma3_text: sliding-window layers count too
def test_summary_equals_cache_properties_and_dynamic_cache_bytes(arch: str) -> None:
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=(12, 7))
    reference = gen(model, ids, mask, return_dict_in_generate=True)  # transformers' own DynamicCache
    full = returned_cache(reference)
    assert type(full) is DynamicCache

    enable(model, **OPTIONS)
    out = gen(model, ids, mask, return_dict_in_generate=True)
    cache, summary = last_cache(model), last_summary(model)
    assert cache is returned_cache(out) and isinstance(cache, RopeKVCache)
    assert summary == CacheSummary(
        tokens_seen=cache.tokens_seen,
        tokens_kept=cache.tokens_kept,
        num_compactions=cache.num_compactions,
        bytes_held=cache.bytes_held,
        full_cache_bytes=cache.full_cache_bytes,
        budget=16,
        compress_every=4,
        static=False,  # static="auto" on the CPU: eager
        static_reason=cache.static_reason,
    )
    # Independent references: the DynamicCache holding the same tokens.
    assert summary.tokens_seen == full.get_seq_length() == ids.shape[1] + NEW - 1
    assert summary.full_cache_bytes == dynamic_cache_bytes(full)
    assert summary.num_compactions > 0 and summary.budget <= summary.tokens_kept <= summary.bound == 20
    assert summary.bytes_held < summary.full_cache_bytes
    assert summary.bytes_fraction == summary.bytes_held / summary.full_cache_bytes
    disable(model)


def test_summary_text() -> None:
    summary = CacheSummary(
        tokens_seen=1042, tokens_kept=299, num_compactions=12, bytes_held=3 * 2**20, full_cache_bytes=12 * 2**20,
        budget=256, compress_every=64,
    )
    assert str(summary) == (
        "RopeKVCache: kept 299 of 1,042 tokens (bound: budget 256 + compress_every 64 = 320), 12 compactions; "
        "KV 3.00 MiB held vs 12.00 MiB for a DynamicCache (25%)"
    )
    unbounded = CacheSummary(
        tokens_seen=5, tokens_kept=5, num_compactions=1, bytes_held=0, full_cache_bytes=0, budget=None,
        compress_every=128,
    )
    assert unbounded.bound is None and unbounded.bytes_fraction is None
    assert str(unbounded) == (
        "RopeKVCache: kept 5 of 5 tokens (no budget: nothing is evicted), 1 compaction; KV 0 B held vs 0 B for a "
        "DynamicCache"
    )
    assert [format_bytes(n) for n in (1023, 1024, 1536 * 1024, 5 * 2**40)] == [
        "1023 B", "1.00 KiB", "1.50 MiB", "5120.00 GiB"
    ]
    with pytest.raises(TypeError, match="needs a RopeKVCache"):
        CacheSummary.from_cache(DynamicCache())
    with pytest.raises(AttributeError):  # frozen
        summary.tokens_kept = 1


def test_no_budget_keeps_everything(model) -> None:
    ids, mask = padded_batch(lengths=(9,))
    with enabled(model, budget=None):
        gen(model, ids, mask, max_new_tokens=6)
    summary = last_summary(model)  # still there after the block
    assert summary.budget is None and summary.num_compactions == 0
    assert summary.tokens_kept == summary.tokens_seen == 9 + 6 - 1


# --------------------------------------------------------------------------- last_cache across calls


def test_last_cache_follows_successive_calls_and_is_held_weakly(model) -> None:
    ids, mask = padded_batch(lengths=(10, 6))
    enable(model, **OPTIONS)
    first = gen(model, ids, mask, max_new_tokens=NEW, return_dict_in_generate=True)
    cache1, summary1 = last_cache(model), last_summary(model)
    assert cache1 is returned_cache(first)
    second = gen(model, ids, mask, max_new_tokens=NEW + 7, return_dict_in_generate=True)
    cache2, summary2 = last_cache(model), last_summary(model)
    assert cache2 is returned_cache(second) and cache2 is not cache1
    assert summary1.tokens_seen == ids.shape[1] + NEW - 1
    assert summary2.tokens_seen == ids.shape[1] + NEW + 6
    assert summary2 == CacheSummary.from_cache(cache2)

    # Weakly held: once the caller drops the output, the cache goes; its summary stays.
    ref = weakref.ref(cache2)
    del second, cache2, first, cache1
    gc.collect()
    assert ref() is None
    with pytest.raises(LookupError, match="was freed.*return_dict_in_generate=True"):
        last_cache(model)
    assert last_summary(model) == summary2


def test_last_cache_during_generate_is_the_live_cache(model) -> None:
    seen: list[tuple[RopeKVCache, CacheSummary]] = []

    class Peek(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append((last_cache(model), last_summary(model)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids, mask = padded_batch(lengths=(8,))
    enable(model, **OPTIONS)
    out = gen(model, ids, mask, stopping_criteria=StoppingCriteriaList([Peek()]), return_dict_in_generate=True)
    assert len(seen) == NEW and all(cache is returned_cache(out) for cache, _ in seen)
    assert [s.tokens_seen for _, s in seen] == list(range(ids.shape[1], ids.shape[1] + NEW))


def test_errors_name_the_problem(model) -> None:
    with pytest.raises(LookupError, match="enable\\(\\) was never called"):
        last_cache(model)
    with pytest.raises(LookupError, match="enable\\(\\) was never called"):
        last_summary(model)
    enable(model, **OPTIONS)
    with pytest.raises(LookupError, match="No generate\\(\\) call"):
        last_summary(model)
    ids, mask = padded_batch(lengths=(6,))
    gen(model, ids, mask, use_cache=False)  # no cache at all: still nothing to inspect
    with pytest.raises(LookupError, match="No generate\\(\\) call"):
        last_cache(model)


# --------------------------------------------------------------------------- the log line


def test_one_info_line_per_generate(model, caplog) -> None:
    ids, mask = padded_batch(lengths=(11, 5))
    enable(model, **OPTIONS)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        gen(model, ids, mask)
        first = str(last_summary(model))
        gen(model, ids, mask, max_new_tokens=NEW - 10)
        second = str(last_summary(model))
        gen(model, ids, mask, use_cache=False)  # no hf_ropekv cache: no line
    lines = summary_lines(caplog.records)
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]
    assert [r.getMessage() for r in lines] == [
        f"hf_ropekv, LlamaForCausalLM.generate(): {first}",
        f"hf_ropekv, LlamaForCausalLM.generate(): {second}",
    ]
    assert first != second and "compactions" in first

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        gen(model, ids, mask)
    assert summary_lines(caplog.records) == []

    caplog.clear()
    disable(model)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        gen(model, ids, mask)
    assert summary_lines(caplog.records) == []


def test_a_failing_generate_propagates_its_error_and_logs_nothing(model, caplog) -> None:
    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise RuntimeError("boom")

    ids, mask = padded_batch(lengths=(6,))
    enable(model, **OPTIONS)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with pytest.raises(RuntimeError, match="boom"):
            gen(model, ids, mask, stopping_criteria=StoppingCriteriaList([Boom()]))
        assert summary_lines(caplog.records) == []
        gen(model, ids, mask)
    assert len(summary_lines(caplog.records)) == 1


def test_pipeline(model, caplog) -> None:
    from test_enable import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = ["w5 w7 w9 w11 w13 w17", "w3 w4 w8"]
    enable(model, **OPTIONS)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        results = pipe(prompts, return_full_text=False, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert all(r[0]["generated_text"] for r in results)
    lines = summary_lines(caplog.records)
    assert len(lines) == 2  # one generate() per prompt
    summary = last_summary(pipe.model)
    assert lines[-1].getMessage().endswith(str(summary))
    assert summary.tokens_seen == 3 + NEW - 1 and summary.num_compactions > 0


# --------------------------------------------------------------------------- the generate wrapper


def test_generate_wrapper_keeps_the_signature_and_is_removed(model) -> None:
    before = dict(model.__dict__)
    want = inspect.signature(model.generate)
    enable(model, **OPTIONS)
    assert "generate" in model.__dict__ and inspect.signature(model.generate) == want
    assert model.generate.__doc__ == type(model).generate.__doc__
    disable(model)
    assert model.__dict__.keys() == before.keys()


def test_copies_have_their_own_records(model) -> None:
    ids, mask = padded_batch(lengths=(7,))
    enable(model, **OPTIONS)
    gen(model, ids, mask)
    original = last_summary(model)

    clone = copy.deepcopy(model)
    with pytest.raises(LookupError, match="No generate"):  # enabled, but it has not generated yet
        last_summary(clone)
    gen(clone, ids, mask, max_new_tokens=NEW + 3)
    assert last_summary(clone).tokens_seen == original.tokens_seen + 3
    assert last_summary(model) == original
    disable(clone)
    assert "generate" not in clone.__dict__

    # Pickled before its first generate(): the copy stays enabled (hf_ropekv.hooks.enable), without records.
    fresh = enable(tiny_model("llama"), **OPTIONS)
    unpickled = pickle.loads(pickle.dumps(fresh))
    with pytest.raises(LookupError, match="No generate"):
        last_summary(unpickled)
    assert gen(unpickled, ids, mask, max_new_tokens=4).shape[1] == ids.shape[1] + 4
    enable(unpickled, **OPTIONS)
    gen(unpickled, ids, mask)
    assert last_summary(unpickled) == original
    disable(unpickled)
    assert not {"generate", "_prepare_cache_for_generation"} & unpickled.__dict__.keys()
