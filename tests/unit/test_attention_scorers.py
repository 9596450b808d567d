"""Attention-based peers (SnapKV, H2O, R-KV) and the attention-from-queries helper they share.

References are written independently here: a per-(row, head, query) float64 softmax over explicitly listed
slots. Inputs are fresh random tensors on every run.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_ropekv.scorers import H2OScorer, RKVScorer, ScoreContext, SnapKVScorer, attention_from_queries, standardize
from hf_ropekv.scorers import attention as attention_module
from hf_ropekv.scorers.rkv import key_redundancy


def naive_attention(queries, keys, query_positions, slot_positions, valid, scale) -> torch.Tensor:
    """float64 [B, H_q, N, S]: loop over (row, query head, query), softmax over the allowed slots only."""
    batch, q_heads, n_queries, _ = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    out = torch.zeros(batch, q_heads, n_queries, slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            for n in range(n_queries):
                p = int(query_positions[b, n])
                allowed = [
                    s for s in range(slots)
                    if p >= 0 and int(slot_positions[b, kv, s]) <= p and (valid is None or bool(valid[b, kv, s]))
                ]
                if not allowed:
                    continue
                logits = torch.stack([queries[b, h, n].double() @ keys[b, kv, s].double() * scale for s in allowed])
                out[b, h, n, allowed] = torch.softmax(logits, dim=0)
    return out


def random_case(batch=2, q_heads=4, kv_heads=2, slots=11, n_queries=7, dim=8, span=20, seed=None):
    """Keys in shuffled slots (distinct token indices per row/head), queries at random positions, some -1."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    queries = torch.randn(batch, q_heads, n_queries, dim, generator=g)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=g)
    slot_positions = torch.stack([
        torch.stack([torch.randperm(span, generator=g)[:slots] for _ in range(kv_heads)]) for _ in range(batch)
    ])
    query_positions = torch.randint(0, span, (batch, n_queries), generator=g)
    query_positions[0, 0] = -1  # no query here
    query_positions[1, 1] = -1
    valid = torch.rand(batch, kv_heads, slots, generator=g) > 0.25
    return queries, keys, query_positions, slot_positions, valid


# ----------------------------------------------------------------------------------------------- helper
@pytest.mark.parametrize("with_valid", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
def test_attention_from_queries_matches_naive_softmax(with_valid: bool, chunked: bool, monkeypatch) -> None:
    queries, keys, q_pos, s_pos, valid = random_case()
    valid = valid if with_valid else None
    if chunked:  # force chunks of one or two queries
        monkeypatch.setattr(attention_module, "_CHUNK_ELEMENTS", 2 * 2 * 4 * 11)
    scale = 0.37
    got = attention_from_queries(queries, keys, q_pos, s_pos, valid, scale)
    want = naive_attention(queries, keys, q_pos, s_pos, valid, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    summed = attention_module.summed_attention(queries, keys, q_pos, s_pos, valid, scale)
    torch.testing.assert_close(summed.double(), want.sum(dim=2), atol=1e-5, rtol=1e-5)


def test_attention_respects_causality_padding_and_gqa() -> None:
    queries, keys, q_pos, s_pos, valid = random_case(seed=None)
    probs = attention_from_queries(queries, keys, q_pos, s_pos, valid, 0.5)
    group = 2
    kv_of_head = torch.arange(4) // group
    future = s_pos[:, kv_of_head, None, :] > q_pos[:, None, :, None]  # [B, H_q, N, S]
    assert probs[future].abs().max() == 0  # never attends to the future
    assert probs[~valid[:, kv_of_head, None, :].expand_as(probs)].abs().max() == 0  # nor to padding
    assert probs[0, :, 0].abs().max() == 0 and probs[1, :, 1].abs().max() == 0  # query at -1: no attention
    sums = probs.sum(-1)
    has_slot = (~future & valid[:, kv_of_head, None, :]).any(-1) & (q_pos[:, None, :] >= 0)
    torch.testing.assert_close(sums[has_slot], torch.ones_like(sums[has_slot]))
    # GQA: query head h reads KV head h // group; giving KV head 1 new keys changes heads 2-3 only.
    keys2 = keys.clone()
    keys2[:, 1] = torch.randn_like(keys2[:, 1])
    probs2 = attention_from_queries(queries, keys2, q_pos, s_pos, valid, 0.5)
    assert torch.equal(probs2[:, :2], probs[:, :2]) and not torch.equal(probs2[:, 2:], probs[:, 2:])


def test_attention_accepts_model_dtype_queries() -> None:
    queries, keys, q_pos, s_pos, valid = random_case()
    low = queries.to(torch.bfloat16)
    got = attention_from_queries(low, keys, q_pos, s_pos, valid, 0.3)
    torch.testing.assert_close(got, attention_from_queries(low.float(), keys, q_pos, s_pos, valid, 0.3))


def test_attention_rejects_bad_shapes() -> None:
    queries, keys, q_pos, s_pos, valid = random_case()
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention_from_queries(queries[:, :3], keys, q_pos, s_pos, valid, 1.0)
    with pytest.raises(ValueError, match="query_positions"):
        attention_from_queries(queries, keys, q_pos[:, :-1], s_pos, valid, 1.0)


# ----------------------------------------------------------------------------------------------- context
def make_ctx(keys, slot_positions, queries, query_positions, tokens_seen, new_queries=None, valid=None, layer=0):
    batch, kv_heads, slots = keys.shape[:3]
    candidates = torch.ones(batch, kv_heads, slots, dtype=torch.bool) if valid is None else valid.clone()
    return ScoreContext(
        layer_idx=layer,
        position=torch.full((batch,), tokens_seen, dtype=torch.long),
        tokens_seen=tokens_seen,
        slot_positions=slot_positions,
        candidates=candidates,
        queries=queries,
        query_positions=query_positions,
        new_queries=new_queries,
        valid=valid,
    )


@pytest.mark.parametrize("scorer", [SnapKVScorer(), H2OScorer(), RKVScorer()], ids=lambda s: type(s).__name__)
def test_scorers_without_queries_raise_a_clear_error(scorer) -> None:
    keys = torch.randn(1, 2, 5, 8)
    ctx = ScoreContext(0, torch.tensor([5]), 5, torch.arange(5).expand(1, 2, 5), torch.ones(1, 2, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="needs the layer's post-RoPE queries"):
        scorer.score(keys, ctx)
    assert scorer.query_window >= 1


# ----------------------------------------------------------------------------------------------- SnapKV
@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_snapkv_ranks_the_attended_key_first_and_pools_to_its_neighbours(pooling: str) -> None:
    slots, dim, window = 16, 16, 4
    direction = torch.nn.functional.normalize(torch.randn(dim), dim=0)
    keys = 0.1 * torch.randn(1, 1, slots, dim)
    target_token = int(torch.randint(3, 10, ()))
    order = torch.randperm(slots)  # storage order differs from token order
    slot_positions = order.view(1, 1, slots)
    target_slot = int((order == target_token).nonzero())
    keys[0, 0, target_slot] = 8 * direction
    queries = 2 * direction + 0.1 * torch.randn(1, 2, window, dim)  # 2 query heads share the KV head (GQA)
    query_positions = torch.arange(slots - window, slots).view(1, window)
    ctx = make_ctx(keys, slot_positions, queries, query_positions, tokens_seen=slots)

    plain = SnapKVScorer(window=window, kernel_size=1).score(keys, ctx)
    assert plain.dtype == torch.float32 and plain.shape == (1, 1, slots)
    assert int(plain[0, 0].argmax()) == target_slot

    pooled = SnapKVScorer(window=window, kernel_size=3, pooling=pooling).score(keys, ctx)[0, 0]
    ranked_tokens = order[pooled.argsort(descending=True)].tolist()
    neighbours = {target_token - 1, target_token + 1}
    # Each of the three windows that contain the target outweighs every window without it; the neighbours
    # are neighbours in token order, not in storage order.
    assert set(ranked_tokens[:3]) == neighbours | {target_token}
    if pooling == "maxpool":  # max pooling gives the neighbours the target's own score
        top = pooled.sort(descending=True).values[:3]
        torch.testing.assert_close(top, top[0].expand(3))
    assert abs(float(pooled.mean())) < 1e-5  # z-scored over the candidates


def test_snapkv_uses_only_the_last_window_queries() -> None:
    slots, dim = 12, 8
    keys = torch.randn(1, 1, slots, dim)
    positions = torch.arange(slots).view(1, 1, slots)
    queries = torch.randn(1, 1, 10, dim)
    q_pos = torch.arange(2, 12).view(1, 10)
    ctx = make_ctx(keys, positions, queries, q_pos, tokens_seen=slots)
    got = SnapKVScorer(window=3, kernel_size=1).score(keys, ctx)
    mass = naive_attention(queries[:, :, -3:], keys, q_pos[:, -3:], positions, None, dim**-0.5).sum(2).float()
    torch.testing.assert_close(got, standardize(mass, ctx.candidates), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- H2O
def test_h2o_accumulates_across_a_compaction_like_one_pass_over_all_queries() -> None:
    batch, q_heads, kv_heads, dim, first, total, kept = 2, 4, 2, 8, 12, 20, 6
    all_keys = torch.randn(batch, kv_heads, total, dim)
    all_queries = torch.randn(batch, q_heads, total, dim)
    pads = torch.tensor([0, 3])  # row 1 is left-padded by 3 tokens
    token_valid = torch.arange(total)[None, :] >= pads[:, None]  # [B, T]
    query_positions = torch.where(token_valid, torch.arange(total), -1)
    scorer = H2OScorer()

    # Call 1 (first compaction): tokens 0..11 in order, every query since the start.
    pos1 = torch.arange(first).expand(batch, kv_heads, first).clone()
    valid1 = token_valid[:, None, :first].expand(batch, kv_heads, first).clone()
    ctx1 = make_ctx(all_keys[:, :, :first], pos1, all_queries[:, :, :first], query_positions[:, :first],
                    tokens_seen=first, new_queries=first, valid=valid1)
    scorer.score(all_keys[:, :, :first], ctx1)

    # Compaction: each (row, head) keeps `kept` real tokens, stored in shuffled order; then tokens 12..19 arrive.
    survivors = torch.empty(batch, kv_heads, kept, dtype=torch.long)
    for b in range(batch):
        for h in range(kv_heads):
            real = torch.arange(int(pads[b]), first)
            survivors[b, h] = real[torch.randperm(len(real))[:kept]]
    new_tokens = torch.arange(first, total).expand(batch, kv_heads, total - first)
    pos2 = torch.cat([survivors, new_tokens], dim=-1)
    keys2 = all_keys.gather(2, pos2[..., None].expand(-1, -1, -1, dim))
    # The provider may hand over older queries too (to fill a query window); only the new ones count.
    ctx2 = make_ctx(keys2, pos2, all_queries[:, :, first - 3 :], query_positions[:, first - 3 :], tokens_seen=total,
                    new_queries=total - first, valid=torch.ones_like(pos2, dtype=torch.bool))
    got = scorer.score(keys2, ctx2)

    # One pass: each query over the slots it saw (before the compaction: every earlier real token; after:
    # the survivors plus the new tokens up to it), attention summed per token, mean over the GQA group.
    want = torch.zeros(batch, kv_heads, total, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // (q_heads // kv_heads)
            for p in range(int(pads[b]), total):
                if p < first:
                    seen = list(range(int(pads[b]), p + 1))
                else:
                    seen = survivors[b, kv].tolist() + list(range(first, p + 1))
                logits = torch.stack([all_queries[b, h, p].double() @ all_keys[b, kv, t].double() for t in seen])
                want[b, kv, seen] += torch.softmax(logits / math.sqrt(dim), 0) / (q_heads // kv_heads)
    want_scores = standardize(want.gather(-1, pos2).float(), ctx2.candidates)
    torch.testing.assert_close(got, want_scores, atol=1e-4, rtol=1e-4)

    # Scoring the same layer again at the same point adds nothing.
    torch.testing.assert_close(scorer.score(keys2, ctx2), got)
    # A new sequence (tokens_seen went down, queries back to the start) starts over: like a fresh scorer.
    again = scorer.score(all_keys[:, :, :first], ctx1)
    torch.testing.assert_close(again, H2OScorer().score(all_keys[:, :, :first], ctx1))


# ----------------------------------------------------------------------------------------------- R-KV
def test_rkv_penalises_a_duplicated_key_against_a_distinct_key_of_equal_importance() -> None:
    slots, dim, window = 8, 32, 8
    basis, _ = torch.linalg.qr(torch.randn(16, 16))
    keys = torch.zeros(1, 1, slots, dim)
    keys[0, 0, :, :16] = basis[:slots] * (1 + torch.rand(slots, 1))  # orthogonal keys, random norms
    older, newer = 2, 5
    keys[0, 0, newer, :16] = keys[0, 0, older, :16] * 1.7  # same direction: cosine 1
    queries = torch.zeros(1, 2, window, dim)
    queries[..., 16:] = torch.randn(1, 2, window, 16)  # orthogonal to every key: equal attention everywhere
    positions = torch.arange(slots).view(1, 1, slots)
    q_pos = torch.arange(slots, slots + window).view(1, window)
    ctx = make_ctx(keys, positions, queries, q_pos, tokens_seen=slots + window)
    scores = RKVScorer(window=window).score(keys, ctx)[0, 0]
    distinct = [s for s in range(slots) if s not in (older, newer)]
    assert scores[older] < scores[distinct].min() - 0.5  # the earlier copy pays for the redundancy ...
    torch.testing.assert_close(scores[newer], scores[distinct[0]])  # ... the latest copy is kept like the rest
    torch.testing.assert_close(scores[distinct], scores[distinct[0]].expand(len(distinct)))

    redundancy = key_redundancy(keys, positions, None, 0.5)
    torch.testing.assert_close(redundancy.sum(-1), torch.ones(1, 1))


def test_rkv_penalises_every_copy_but_the_latest() -> None:
    slots, dim = 9, 16
    basis, _ = torch.linalg.qr(torch.randn(dim, dim))
    keys = (basis[:slots] * (1 + torch.rand(slots, 1))).view(1, 1, slots, dim)
    copies = sorted(torch.randperm(slots)[:3].tolist())
    for slot in copies[1:]:
        keys[0, 0, slot] = keys[0, 0, copies[0]] * (0.5 + torch.rand(()))
    order = torch.randperm(slots)  # token order differs from storage order
    positions = order.view(1, 1, slots)
    by_time = sorted(copies, key=lambda s: int(order[s]))
    redundancy = key_redundancy(keys, positions, None, 0.5)[0, 0]
    others = [s for s in range(slots) if s not in copies]
    # Each copy's pair with its latest later copy is exempt, so every copy but the latest pays for two
    # similar tokens (the oldest: the middle one and the latest's row; the middle: the oldest's and the latest's
    # rows) and the latest pays for none, like a distinct key.
    oldest, middle, latest = by_time
    torch.testing.assert_close(redundancy[oldest], redundancy[middle])
    assert redundancy[middle] > redundancy[latest] * 1.1
    torch.testing.assert_close(redundancy[latest], redundancy[others[0]])


def test_rkv_importance_decides_among_distinct_keys_and_padding_is_ignored() -> None:
    slots, dim, window = 10, 16, 4
    direction = torch.nn.functional.normalize(torch.randn(dim), dim=0)
    keys = torch.randn(1, 2, slots, dim)
    keys[0, :, 6] = 6 * direction
    queries = 2 * direction + 0.1 * torch.randn(1, 4, window, dim)
    positions = torch.arange(slots).expand(1, 2, slots).clone()
    valid = torch.ones(1, 2, slots, dtype=torch.bool)
    valid[..., :2] = False  # padding: never attended to, never counted as a copy
    q_pos = torch.arange(slots, slots + window).view(1, window)
    ctx = make_ctx(keys, positions, queries, q_pos, tokens_seen=slots + window, valid=valid)
    scores = RKVScorer(window=window, mix_lambda=1.0, kernel_size=1).score(keys, ctx)
    assert scores.isfinite().all() and (scores[..., 2:].argmax(-1) == 4).all()  # slot 6 among the valid slots
    redundancy = key_redundancy(keys, positions, valid, 0.5)
    assert redundancy[..., :2].abs().max() == 0


# ----------------------------------------------------------------------------------------------- spread forward
@pytest.mark.parametrize("span", [1, 3, 16])
def test_spread_forward_takes_the_max_over_the_span_slots_before_each_in_token_order(span: int) -> None:
    batch, heads, slots = 2, 3, 13
    scores = torch.randn(batch, heads, slots)  # negative scores too: the window's start pads with -inf, not 0
    slot_positions = torch.stack([torch.randperm(40)[:slots] for _ in range(batch * heads)]).view(batch, heads, slots)
    valid = torch.rand(batch, heads, slots) > 0.25
    got = attention_module.spread_forward(scores, slot_positions, valid, span)
    for b in range(batch):
        for h in range(heads):
            live = valid[b, h].nonzero().flatten()
            by_token = live[slot_positions[b, h, live].argsort()]  # valid slots in token order
            for i, slot in enumerate(by_token.tolist()):
                expected = scores[b, h, by_token[max(0, i - span): i + 1]].max()
                assert float(got[b, h, slot]) == float(expected), (b, h, slot)
    assert torch.equal(attention_module.spread_forward(scores, slot_positions, valid, 0), scores)
