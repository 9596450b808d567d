"""Attention-based peers (SnapKV, H2O, R-KV) in a cache: they get the layer's recent post-RoPE queries (the model's
own, compared with what the model's attention used) and generate within the bound. Their scoring math is checked on
tensors in ``tests/unit/test_attention_scorers.py``."""

from __future__ import annotations

import pytest
import torch

from conftest import padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.scorers import H2OScorer, RKVScorer, SnapKVScorer


@pytest.mark.parametrize(
    "scorer_class, options", [(SnapKVScorer, dict(window=4)), (H2OScorer, {}), (RKVScorer, dict(window=4))],
    ids=["SnapKVScorer", "H2OScorer", "RKVScorer"],
)
def test_generate_with_attention_scorer(scorer_class, options) -> None:
    """Every compaction hands the scorer the layer's queries (the cache scores with its own copy of the scorer: a
    subclass records, an attribute set on the caller's object would not reach it)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size)
    seen_queries = []

    class Spy(scorer_class):
        def score(self, keys, ctx):
            seen_queries.append(ctx.queries is not None and ctx.query_positions is not None
                                and ctx.queries.shape[0] == keys.shape[0])
            return super().score(keys, ctx)

    cache = RopeKVCache(model, budget=16, compress_every=8, scorer=Spy(**options))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0,
                         **{cache_kwarg(model): cache})
    assert out.shape == (3, ids.shape[1] + 30)
    assert cache.num_compactions >= 2 and 16 <= cache.tokens_kept <= 16 + 8
    assert len(seen_queries) >= 2 * model.config.num_hidden_layers and all(seen_queries)


def test_cache_hands_scorers_the_models_own_post_rope_queries(monkeypatch) -> None:
    """The queries a scorer receives equal the queries the model's attention used (its own RoPE applied),
    with padding marked -1, covering every query since the layer's last compaction."""
    import transformers.models.llama.modeling_llama as llama

    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    calls: list[torch.Tensor] = []  # one per layer per forward, in layer order
    seen = []

    class Spy(SnapKVScorer):
        def score(self, keys, ctx):
            seen.append((ctx.layer_idx, ctx.queries.clone(), ctx.query_positions.clone(), ctx.new_queries))
            return super().score(keys, ctx)

    # The recorder goes in after the cache is built: building it probes the model's rotary function once.
    cache = RopeKVCache(model, budget=12, compress_every=4, scorer=Spy(window=3))
    apply = llama.apply_rotary_pos_emb

    def recording(q, k, cos, sin, *args, **kwargs):
        q_rot, k_rot = apply(q, k, cos, sin, *args, **kwargs)
        calls.append(q_rot.detach().clone())
        return q_rot, k_rot

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", recording)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, **{cache_kwarg(model): cache})
    assert seen, "no compaction happened"
    layer, queries, positions, new = seen[0]  # the first compaction: prompt + decoding steps before it
    steps = torch.cat(calls[layer :: model.config.num_hidden_layers], dim=2)  # [B, H, tokens, D], forward order
    assert new == queries.shape[2] < steps.shape[2]  # the forwards finished before the compaction
    real = positions >= 0
    assert real.tolist() == torch.cat([mask, torch.ones(2, new - mask.shape[1], dtype=mask.dtype)], 1).bool().tolist()
    torch.testing.assert_close(queries[real[:, None, :].expand(-1, queries.shape[1], -1)],
                               steps[:, :, :new][real[:, None, :].expand(-1, queries.shape[1], -1)],
                               atol=1e-5, rtol=1e-5)
