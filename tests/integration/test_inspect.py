"""Inspecting what enable() did: last_summary, CacheSummary, and the INFO line per generate().

References: the cache's own public properties, and a ``DynamicCache`` that transformers builds for the same
tokens, whose bytes are summed here from its layers' tensors.
"""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
import weakref

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList, pipeline

from conftest import dynamic_cache_bytes, padded_batch, tiny_model, tiny_tokenizer
from hf_ropekv import CacheSummary, RopeKVCache, disable, enable, enabled, last_summary
from hf_ropekv._compat import TRANSFORMERS_VERSION

# The tiny budget is meant (its warning is checked in test_enable).
pytestmark = pytest.mark.filterwarnings("ignore:hf_ropekv.enable. budget=16 is small")
OPTIONS = dict(budget=16, compress_every=4)
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
    cache, summary = returned_cache(out), last_summary(model)
    assert isinstance(cache, RopeKVCache) and summary == cache.summary()
    # Independent references: the DynamicCache holding the same tokens, the options, the kept positions.
    assert summary.tokens_seen == full.get_seq_length() == ids.shape[1] + NEW - 1
    assert summary.full_cache_bytes == dynamic_cache_bytes(full)
    assert (summary.budget, summary.compress_every, summary.static) == (16, 4, False)  # "auto" on the CPU: growing
    full_layer = (getattr(model.config, "layer_types", None) or ["full_attention"]).index("full_attention")
    assert summary.tokens_kept == cache.kept_positions(full_layer).shape[-1]
    assert summary.num_compactions > 0 and summary.budget <= summary.tokens_kept <= summary.bound == 20
    assert summary.bytes_held < summary.full_cache_bytes
    disable(model)


def test_no_budget_keeps_everything(model) -> None:
    ids, mask = padded_batch(lengths=(9,))
    with enabled(model, budget=None):
        gen(model, ids, mask, max_new_tokens=6)
    summary = last_summary(model)  # still there after the block
    assert summary.budget is None and summary.num_compactions == 0
    assert summary.tokens_kept == summary.tokens_seen == 9 + 6 - 1


# --------------------------------------------------------------------------- last_summary across calls


def test_last_summary_follows_successive_calls_and_holds_no_cache(model, gc_off) -> None:

    ids, mask = padded_batch(lengths=(10, 6))
    enable(model, **OPTIONS)
    first = gen(model, ids, mask, max_new_tokens=NEW, return_dict_in_generate=True)
    summary1 = last_summary(model)
    assert summary1 == returned_cache(first).summary()
    second = gen(model, ids, mask, max_new_tokens=NEW + 7, return_dict_in_generate=True)
    summary2 = last_summary(model)
    assert summary2 == returned_cache(second).summary() and summary2 != summary1
    assert summary1.tokens_seen == ids.shape[1] + NEW - 1
    assert summary2.tokens_seen == ids.shape[1] + NEW + 6
    # The record holds no cache: once the caller drops the output, the cache goes; its summary stays.
    ref = weakref.ref(returned_cache(second))
    del second, first
    assert ref() is None
    assert last_summary(model) == summary2


def test_last_summary_during_generate_is_the_live_caches(model) -> None:
    seen: list[CacheSummary] = []

    class Peek(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(last_summary(model))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids, mask = padded_batch(lengths=(8,))
    enable(model, **OPTIONS)
    out = gen(model, ids, mask, stopping_criteria=StoppingCriteriaList([Peek()]), return_dict_in_generate=True)
    assert len(seen) == NEW
    assert [s.tokens_seen for s in seen] == list(range(ids.shape[1], ids.shape[1] + NEW))
    assert seen[-1] == returned_cache(out).summary() and seen[0].num_compactions < seen[-1].num_compactions


def test_errors_name_the_problem(model) -> None:
    with pytest.raises(LookupError, match="enable\\(\\) was never called.*print\\(cache.summary\\(\\)\\)"):
        last_summary(model)
    enable(model, **OPTIONS)
    with pytest.raises(LookupError, match="No generate\\(\\) call"):
        last_summary(model)
    ids, mask = padded_batch(lengths=(6,))
    gen(model, ids, mask, use_cache=False)  # no cache at all: still nothing to inspect
    with pytest.raises(LookupError, match="No generate\\(\\) call"):
        last_summary(model)


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
