"""A row's output depends on that row alone: not on its left padding, not on its batch-mates (issue 13).

Every row counts its own real tokens, compacts on its own schedule and (online) scores with its own query
statistics, so greedy tokens with eviction must be identical for: the row alone, the row with 20 extra left
pads, and the row inside a left-padded batch of 3, as the shortest row and as a middle one.
"""

from __future__ import annotations

import pytest
import torch

from conftest import cache_kw, left_padded, tiny_model
from hf_ropekv import FrequencyScorer, RopeKVCache, calibrate
from hf_ropekv.scorers import H2OScorer, KeyNormScorer, RandomScorer, RecencyScorer, RKVScorer, SnapKVScorer

NEW_TOKENS = 40
BUDGET, EVERY = 16, 4


def generate_rows(model, rows, options, extra_pads=0) -> tuple[torch.Tensor, RopeKVCache]:
    ids, mask = left_padded(rows, extra_pads)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, **options())
    out = model.generate(
        input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=NEW_TOKENS,
        do_sample=False, pad_token_id=0,
    )
    return out[:, ids.shape[1] :], cache


def _calibrated(model):
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5))
    stats = calibrate(model, None, ids, progress=False)
    return lambda: {"scorer": FrequencyScorer(stats=stats)}


SCORERS = {
    "online": lambda model: (lambda: {}),
    "online-half-life-8": lambda model: (lambda: {"scorer": FrequencyScorer(half_life=8)}),
    "online-unshrunk-no-decay": lambda model: (lambda: {"scorer": FrequencyScorer(half_life=None, head_shrink=0)}),
    "calibrated": _calibrated,
    "recency": lambda model: (lambda: {"scorer": RecencyScorer(), "sink": 2}),
    "keynorm": lambda model: (lambda: {"scorer": KeyNormScorer()}),
    "random": lambda model: (lambda: {"scorer": RandomScorer(seed=1), "window": 3}),
    "static": lambda model: (lambda: {"static": True}),
    "snapkv": lambda model: (lambda: {"scorer": SnapKVScorer(window=4)}),
    "h2o": lambda model: (lambda: {"scorer": H2OScorer()}),
    "rkv": lambda model: (lambda: {"scorer": RKVScorer(window=4)}),
}


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_tokens_do_not_depend_on_padding_or_batch_mates(name: str) -> None:
    model = tiny_model("llama")
    options = SCORERS[name](model)
    gen = torch.Generator().manual_seed(11)
    row = torch.randint(3, model.config.vocab_size, (6,), generator=gen)
    longer = torch.randint(3, model.config.vocab_size, (11,), generator=gen)
    middle = torch.randint(3, model.config.vocab_size, (8,), generator=gen)
    shorter = torch.randint(3, model.config.vocab_size, (3,), generator=gen)

    alone, cache = generate_rows(model, [row], options)
    assert cache.evicted and cache.num_compactions >= 4  # the schedule matters here
    padded, _ = generate_rows(model, [row], options, extra_pads=20)
    torch.testing.assert_close(padded, alone, atol=0, rtol=0, msg="20 extra left pads changed the tokens")
    as_shortest, batch_cache = generate_rows(model, [longer, row, middle], options)
    torch.testing.assert_close(as_shortest[1:2], alone, atol=0, rtol=0, msg="batch-mates changed the tokens")
    as_middle, _ = generate_rows(model, [shorter, longer, row], options)
    torch.testing.assert_close(as_middle[2:3], alone, atol=0, rtol=0, msg="batch-mates changed the tokens")
    # Every row within its own bound; the layers hold the longest row's count.
    assert max(batch_cache.tokens_kept_per_row) == batch_cache.tokens_kept <= BUDGET + EVERY
