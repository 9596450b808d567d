"""A row's output depends on that row alone: not on its left padding, not on its batch-mates (issue 13).

Every row counts its own real tokens, compacts on its own schedule and (online) scores with its own query
statistics, so greedy tokens with eviction must be identical for: the row alone, the row with 20 extra left
pads, and the row inside a left-padded batch of 3, as the shortest row and as a middle one.
"""

from __future__ import annotations

import pytest
import torch

from conftest import cache_kw, head_shrunk, tiny_model
from hf_ropekv import (
    H2OScorer,
    KeyNormScorer,
    RandomScorer,
    RecencyScorer,
    RKVScorer,
    RopeKVCache,
    SnapKVScorer,
    calibrate,
)

NEW_TOKENS = 40
BUDGET, EVERY = 16, 4


def left_padded(rows: list[torch.Tensor], extra_pads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows) + extra_pads
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def generate_rows(model, rows, options, extra_pads=0) -> tuple[torch.Tensor, RopeKVCache]:
    ids, mask = left_padded(rows, extra_pads)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, **options())
    out = model.generate(
        input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=NEW_TOKENS,
        do_sample=False, pad_token_id=0,
    )
    return out[:, ids.shape[1] :], cache


def _calibrated(model):
    stats = calibrate(model, None, torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5)), progress=False)
    return lambda: {"stats": stats}


SCORERS = {
    "online": lambda model: (lambda: {}),
    "online-per-layer": lambda model: (lambda: {"selection": "per_layer"}),
    "online-half-life": lambda model: (lambda: {"stats_half_life": 8}),
    "calibrated": _calibrated,
    "recency": lambda model: (lambda: {"scorer": RecencyScorer(), "sink": 2}),
    "keynorm": lambda model: (lambda: {"scorer": KeyNormScorer()}),
    "random": lambda model: (lambda: {"scorer": RandomScorer(seed=1), "window": 3}),
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


@pytest.mark.parametrize("half_life", [None, 3.0])
def test_online_statistics_are_per_row_and_follow_decoding(half_life: float | None) -> None:
    """Each row's statistics are the (recency-weighted) mean of its own real queries: prompt and every decoding
    step. With a half-life h, after k decoding steps a prompt query weighs 0.5 ** (k / h) and the query of step j
    0.5 ** ((k - j) / h). Each head is then shrunk toward its layer's head average (``stats_head_shrink``)."""
    model = tiny_model("qwen3")
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, 128, (9,), generator=gen), torch.randint(3, 128, (4,), generator=gen)]
    ids, mask = left_padded(rows)
    cache = RopeKVCache(model, budget=12, compress_every=2, stats_half_life=half_life)
    captured: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    from hf_ropekv.model.capture import QueryCapture

    with QueryCapture(model, cache.geometry, lambda layer, q: captured[layer].append(q.detach().clone())):
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=10,
                             do_sample=False, pad_token_id=0)
    stats = cache._online.snapshot()  # no public API reads the running statistics
    F = cache.geometry.rotary_dim // 2
    steps = out.shape[1] - ids.shape[1] - 1  # decoding forwards (the last token's queries were never computed)
    age = torch.cat([torch.full((ids.shape[1],), float(steps)), torch.arange(steps - 1, -1, -1).double()])
    weight = torch.ones_like(age) if half_life is None else 0.5 ** (age / half_life)
    for layer in (0, 1):
        queries = torch.cat(captured[layer], dim=1)  # [B, prompt + steps, H, D]
        real = torch.cat([mask, torch.ones(2, steps, dtype=mask.dtype)], dim=1).bool()
        for b in range(2):
            q = queries[b, real[b]].double()  # that row's real queries only
            w = weight[real[b]].view(-1, 1, 1)
            pairs = torch.complex(q[..., :F], q[..., F : 2 * F])
            got_mean, got_abs = stats.for_layer(layer)
            n, k = float(w.sum()), cache.stats_head_shrink
            want_mean = head_shrunk((w * pairs).sum(0) / n, n, k)
            want_abs = head_shrunk((w * pairs.abs()).sum(0) / n, n, k)
            torch.testing.assert_close(got_mean[b].to(torch.complex128), want_mean, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got_abs[b].double(), want_abs, atol=1e-6, rtol=1e-5)
            assert float(stats.tokens[b]) == pytest.approx(float(weight[real[b]].sum()))
