"""The default policy in generate(): RoPE frequency scoring with calibrated statistics or statistics gathered
online. (The score and the selection against their formula: tests/unit/test_frequency_scorer.py and
test_selection.py; the online statistics against the model's own queries: test_statistics_follow_queries.py.)"""

from __future__ import annotations

import pytest
import torch

from conftest import cache_kw, padded_batch, tiny_model
from hf_ropekv import FrequencyScorer, RopeKVCache, calibrate


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_with_calibrated_and_online_statistics(arch: str) -> None:
    """Both kinds evict within the bound; calibrated statistics are used as given (never replaced online), and the
    two kinds choose differently (else the statistics would not matter)."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size)
    stats = calibrate(model, None, torch.randint(3, model.config.vocab_size, (4, 64),
                                                 generator=torch.Generator().manual_seed(0)), progress=False)
    kept = {}
    for name, options in {"calibrated": {"scorer": FrequencyScorer(stats=stats)}, "online": {}}.items():
        cache = RopeKVCache(model, budget=20, compress_every=8, **options)
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=40,
                             do_sample=False, pad_token_id=0)
        assert out.shape == (3, ids.shape[1] + 40)
        assert cache.num_compactions >= 3 and cache.tokens_kept <= 28
        kept[name] = [cache.kept_positions(i) for i in range(model.config.num_hidden_layers)]
        if name == "calibrated":
            assert cache.scorer.stats is stats
    assert any(not torch.equal(a, b) for a, b in zip(kept["calibrated"], kept["online"]))
