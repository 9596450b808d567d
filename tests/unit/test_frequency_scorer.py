"""FrequencyScorer on tensors: raw RoPE scores (``score_keys``, checked against its formula in test_rope_scoring),
z-scored per query head over the candidate slots (population std), then the max over each GQA group."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config, tiny_model
from hf_ropekv import FrequencyScorer, FrequencyStats, RopeKVCache, ScoreContext
from hf_ropekv.model.geometry import describe
from hf_ropekv.scorers import SnapKVScorer
from hf_ropekv.scorers.frequency import POINTED, VOTE_LEAD
from hf_ropekv.scorers.key_novelty import NOVELTY_WINDOW, key_novelty
from hf_ropekv.scorers.rope_scoring import score_keys
from hf_ropekv.statistics.frequency_stats import geometry_metadata
from hf_ropekv.statistics.online import RowStatistics

CONFIG = tiny_config("llama", num_hidden_layers=3)
PROMPT = 40
GEOMETRY = describe(CONFIG)


def random_stats(seed: int) -> FrequencyStats:
    g = torch.Generator().manual_seed(seed)
    shape = (GEOMETRY.num_layers, GEOMETRY.num_q_heads, GEOMETRY.inv_freq.numel())
    q_mean = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    q_abs = q_mean.abs() * (1 + torch.rand(shape, generator=g))
    return FrequencyStats(q_mean, q_abs, {**geometry_metadata(GEOMETRY), "tokens": 1, "source": "random"})


def context(layer: int, batch: int, slots: int, gen: torch.Generator, positions=None) -> ScoreContext:
    return ScoreContext(
        layer_idx=layer,
        position=torch.tensor(positions if positions is not None else [slots] * batch),
        tokens_seen=slots,
        slot_positions=torch.arange(slots).expand(batch, GEOMETRY.num_kv_heads, slots),
        candidates=torch.rand(batch, GEOMETRY.num_kv_heads, slots, generator=gen) > 0.2,
    )


def reference(keys, stats, ctx, offsets=None) -> torch.Tensor:
    """z-score of each query head's raw scores over the candidates of its KV head, then the max over the group."""
    q_mean, q_abs = stats.for_layer(ctx.layer_idx)
    extra = {} if offsets is None else {"offsets": offsets}
    raw = score_keys(keys, q_mean, q_abs, GEOMETRY.inv_freq, ctx.position, backend="torch", **extra).double()
    group = GEOMETRY.group_size
    out = torch.empty(keys.shape[:3], dtype=torch.float64)
    for b in range(keys.shape[0]):
        for kv in range(keys.shape[1]):
            cand = ctx.candidates[b, kv]
            z = []
            for h in range(kv * group, (kv + 1) * group):
                x = raw[b, h]
                z.append((x - x[cand].mean()) / x[cand].std(unbiased=False))
            out[b, kv] = torch.stack(z).amax(0)
    return out


@pytest.mark.parametrize("offsets", [None, (1, 3, 10, 1000)])
def test_score_is_the_group_max_of_z_scores_over_the_candidates(offsets) -> None:
    gen = torch.Generator()
    gen.seed()
    stats = random_stats(0)
    keys = torch.randn(2, GEOMETRY.num_kv_heads, 29, GEOMETRY.head_dim, generator=gen)
    ctx = context(1, 2, 29, gen, positions=[29, 400])
    got = FrequencyScorer(stats=stats, offsets=offsets).score(keys, ctx)
    assert got.dtype == torch.float32 and got.shape == keys.shape[:3]
    torch.testing.assert_close(got.double(), reference(keys, stats, ctx, offsets), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_row", [False, True], ids=["shared-stats", "per-row-stats"])
def test_score_layers_equals_scoring_each_layer(per_row: bool) -> None:
    """score_layers (one set of query-weight ops for every layer) gives exactly score()'s result per layer."""
    stats = random_stats(4)
    batch, slots = 3, 37
    g = torch.Generator().manual_seed(6)
    if per_row:  # per-row statistics, as online statistics give them
        q_mean = tuple(torch.complex(torch.randn(batch, *s.shape, generator=g),
                                     torch.randn(batch, *s.shape, generator=g)) for s in stats.q_mean)
        q_abs = tuple(q.abs() * (1 + torch.rand(q.shape, generator=g)) for q in q_mean)
        stats = RowStatistics(q_mean, q_abs, dict(stats.metadata), torch.ones(batch, dtype=torch.float64))
    scorer = FrequencyScorer(stats)
    keys = [torch.randn(batch, GEOMETRY.num_kv_heads, slots, GEOMETRY.head_dim, generator=g)
            for _ in range(GEOMETRY.num_layers)]
    contexts = [context(layer, batch, slots, g, positions=[50, 47, 61]) for layer in range(GEOMETRY.num_layers)]
    together = scorer.score_layers(keys, contexts)
    assert together.shape == (GEOMETRY.num_layers, batch, GEOMETRY.num_kv_heads, slots)
    for layer in range(GEOMETRY.num_layers):
        assert torch.equal(together[layer], scorer.score(keys[layer], contexts[layer]))
    if not per_row:
        torch.testing.assert_close(together[2].double(), reference(keys[2], stats, contexts[2]), rtol=1e-4, atol=1e-4)


def test_replaced_statistics_take_effect_even_at_a_reused_address() -> None:
    """Online statistics swap a new snapshot in at every compaction and drop the old one; CPython then often
    hands the new object the old one's address. The scorer must always score with the statistics it holds
    (with an id()-keyed device cache it did not: the bug behind a flaky quality-harness test)."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, GEOMETRY.num_kv_heads, PROMPT, GEOMETRY.head_dim, generator=g)
    ctx = context(1, 1, PROMPT, g)
    scorer = FrequencyScorer(random_stats(0))
    for seed in range(1, 20):
        before = scorer.score(keys, ctx)  # the scorer now holds device copies of the current statistics
        parts = random_stats(seed)  # tensors and metadata first, so that the object comes next
        q_mean, q_abs, metadata = parts.q_mean, parts.q_abs_mean, parts.metadata
        del parts
        scorer.stats = None  # drops the old statistics, as the online snapshot swap does
        scorer.stats = FrequencyStats(q_mean, q_abs, metadata)
        want = FrequencyScorer(scorer.stats).score(keys, ctx)
        assert not torch.equal(want, before)
        torch.testing.assert_close(scorer.score(keys, ctx), want, atol=0, rtol=0, msg=f"swap {seed}")


def test_without_statistics_it_says_where_they_come_from() -> None:
    g = torch.Generator().manual_seed(3)
    with pytest.raises(RuntimeError, match="no statistics: pass stats=.*RopeKVCache\\(model"):
        FrequencyScorer().score(torch.randn(1, 2, 5, 16), context(0, 1, 5, g))


def test_statistics_of_another_geometry_are_refused() -> None:
    other = tiny_config("llama", num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    g = torch.Generator().manual_seed(0)
    geometry = describe(other)
    shape = (geometry.num_layers, geometry.num_q_heads, geometry.inv_freq.numel())
    q_mean = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    stats = FrequencyStats(q_mean, q_mean.abs(), {**geometry_metadata(geometry), "tokens": 1, "source": "random"})
    with pytest.raises(ValueError, match="query heads: statistics have 8, the model has 4"):
        RopeKVCache(tiny_model("llama", num_hidden_layers=3), budget=32, scorer=FrequencyScorer(stats=stats))


def test_statistics_from_a_file_are_loaded_and_checked(tmp_path) -> None:
    path = tmp_path / "stats.safetensors"
    random_stats(0).save(path)
    model = tiny_model("llama", num_hidden_layers=3)
    for given in (str(path), path):
        cache = RopeKVCache(model, budget=32, scorer=FrequencyScorer(stats=given))
        assert isinstance(cache.scorer.stats, FrequencyStats) and cache.scorer.stats.tokens == 1
        assert torch.equal(cache.scorer.stats.q_mean, random_stats(0).q_mean)
    with pytest.raises(ValueError, match="model type"):
        RopeKVCache(tiny_model("qwen3", num_hidden_layers=3), budget=32, scorer=FrequencyScorer(stats=path))
    with pytest.raises(FileNotFoundError, match="hf_ropekv.calibrate"):
        RopeKVCache(model, budget=32, scorer=FrequencyScorer(stats=tmp_path / "missing.safetensors"))


def prompt_context(keys: torch.Tensor, target: int, window: int, gen: torch.Generator) -> ScoreContext:
    """A compaction right after a prompt whose last ``window`` queries all point at token ``target``; slots hold
    the tokens in a shuffled order."""
    batch, kv_heads, slots, dim = keys.shape
    order = torch.randperm(slots, generator=gen)
    slot_of_target = int((order == target).nonzero())
    keys[:, :, slot_of_target] = 6 * torch.nn.functional.normalize(torch.ones(dim), dim=0)
    queries = torch.nn.functional.normalize(torch.ones(dim), dim=0) * 4 + 0.1 * torch.randn(
        batch, GEOMETRY.num_q_heads, window, dim, generator=gen)
    return ScoreContext(
        layer_idx=1, position=torch.full((batch,), slots), tokens_seen=slots,
        slot_positions=order.expand(batch, kv_heads, slots).clone(),
        candidates=torch.ones(batch, kv_heads, slots, dtype=torch.bool),
        queries=queries, query_positions=torch.arange(slots - window, slots).expand(batch, window).clone(),
        new_queries=window, valid=torch.ones(batch, kv_heads, slots, dtype=torch.bool))


def novelty_reference(keys: torch.Tensor, candidates: torch.Tensor, slot_positions: torch.Tensor,
                      valid: torch.Tensor | None = None, window: int = NOVELTY_WINDOW) -> torch.Tensor:
    """Local KeyDiff, one (row, head, token) at a time in float64: minus the cosine to the mean of the valid keys
    within ``window // 2`` places in token order, z-scored over the candidates (population std)."""
    out = torch.zeros(keys.shape[:3], dtype=torch.float64)
    valid = torch.ones(keys.shape[:3], dtype=torch.bool) if valid is None else valid
    for b in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            slots = sorted((int(p), s) for s, p in enumerate(slot_positions[b, h]) if valid[b, h, s])
            k = keys[b, h].double()
            for rank, (_, s) in enumerate(slots):
                near = [t for _, t in slots[max(0, rank - window // 2): rank + window // 2 + 1]]
                mean = k[near].mean(0)
                out[b, h, s] = -(k[s] @ mean) / (k[s].norm() * mean.norm())
            cand = candidates[b, h]
            x = out[b, h]
            out[b, h] = (x - x[cand].mean()) / x[cand].std(unbiased=False)
    return out


@pytest.mark.parametrize("window", [5, NOVELTY_WINDOW])
def test_key_novelty_compares_each_key_with_the_keys_around_it(window: int) -> None:
    gen = torch.Generator()
    gen.seed()
    batch, heads, slots, dim = 2, 3, 40, 16
    keys = torch.randn(batch, heads, slots, dim, generator=gen) + torch.randn(dim, generator=gen)  # shared direction
    candidates = torch.rand(batch, heads, slots, generator=gen) > 0.3
    valid = torch.rand(batch, heads, slots, generator=gen) > 0.2
    candidates &= valid
    positions = torch.stack([torch.randperm(3 * slots, generator=gen)[:slots] for _ in range(batch * heads)])
    positions = positions.view(batch, heads, slots)  # slots out of token order, tokens with gaps (evicted)
    poisoned = keys.masked_fill(~valid.unsqueeze(-1), float("nan"))  # invalid slots must not be read
    got = key_novelty(poisoned.to(torch.bfloat16), candidates, positions, valid, window)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, slots)
    expected = novelty_reference(keys.to(torch.bfloat16).float(), candidates, positions, valid, window)
    torch.testing.assert_close(got.double()[candidates], expected[candidates], rtol=1e-4, atol=1e-4)
    # A key pointing against its neighbours is the most novel one of its head.
    order = torch.argsort(positions[0, 0].masked_fill(~valid[0, 0], 1 << 40))
    target = int(order[10])
    candidates[0, 0, target] = valid[0, 0, target] = True
    keys[0, 0, target] = -keys[0, 0, order[5:16]].mean(0) * 3
    got = key_novelty(keys, candidates, positions, valid, window)
    assert int(got[0, 0].masked_fill(~candidates[0, 0], -1e9).argmax()) == target


def test_after_a_prompt_the_windows_vote_ranks_first_and_spreads_forward_when_answered() -> None:
    gen = torch.Generator()
    gen.seed()
    stats, slots, target, span = random_stats(1), 200, 10, 6
    keys = torch.randn(2, GEOMETRY.num_kv_heads, slots, GEOMETRY.head_dim, generator=gen)
    ctx = prompt_context(keys, target, 8, gen)
    rope = reference(keys, stats, ctx).float()
    novelty = novelty_reference(keys, ctx.candidates, ctx.slot_positions).float()
    # Without the span, the vote is SnapKV's (window 8, pooled over 5), lifted by VOTE_LEAD where it reaches
    # POINTED; key novelty competes with the rest.
    plain = FrequencyScorer(stats=stats, prompt_window=8, vote_span=0).score(keys, ctx)
    vote = SnapKVScorer(window=8).score(keys, ctx)
    assert bool((vote >= POINTED).any()) and bool((vote < POINTED).any())
    expected = torch.maximum(novelty, torch.where(vote >= POINTED, vote + VOTE_LEAD, vote))
    torch.testing.assert_close(plain, expected, rtol=1e-4, atol=1e-4)
    # More input follows: the vote is not spread.
    torch.testing.assert_close(FrequencyScorer(stats=stats, prompt_window=8, vote_span=span).score(keys, ctx), plain)
    # A decoding step compacts (8 queries, none before the window: the plain vote): the target and the `span`
    # tokens after it outrank every key outside the pooled, spread run.
    decoding = ScoreContext(**{**ctx.__dict__, "decoding": True})
    spread = FrequencyScorer(stats=stats, prompt_window=8, vote_span=span).score(keys, decoding)
    tokens = ctx.slot_positions[0, 0]
    run = (tokens >= target - 2) & (tokens <= target + 2 + span)  # the pooling reaches 2 tokens either side
    answer = (tokens >= target) & (tokens <= target + span)
    for row in range(2):
        for head in range(GEOMETRY.num_kv_heads):
            assert float(spread[row, head, answer].min()) > float(spread[row, head, ~run].max())
            assert float(spread[row, head, answer].min()) > float(novelty[row, head].max())
    # A decoding step leaves no window: RoPE geometry alone.
    no_window = ScoreContext(ctx.layer_idx, ctx.position, ctx.tokens_seen, ctx.slot_positions, ctx.candidates)
    torch.testing.assert_close(FrequencyScorer(stats=stats).score(keys, no_window), rope, rtol=1e-4, atol=1e-4)


def pooled_mass_reference(keys: torch.Tensor, queries: torch.Tensor, query_positions: torch.Tensor,
                          slot_positions: torch.Tensor) -> torch.Tensor:
    """float64 ``[B, H_kv, S]``: the attention the queries put on each slot (softmax over the causal slots, scale
    ``D ** -0.5``), summed over the queries, averaged over each GQA group, then averaged over 5 neighbouring tokens
    (zero beyond the ends), one (row, head) at a time."""
    batch, kv_heads, slots, dim = keys.shape
    group = queries.shape[1] // kv_heads
    out = torch.zeros(batch, kv_heads, slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            k, tokens = keys[b, h].double(), slot_positions[b, h]
            for g in range(group):
                for n in range(queries.shape[2]):
                    logits = (k @ queries[b, h * group + g, n].double()) * dim**-0.5
                    logits[tokens > query_positions[b, n]] = float("-inf")
                    out[b, h] += torch.softmax(logits, 0) / group
            order = torch.argsort(tokens)
            padded = torch.nn.functional.pad(out[b, h, order], (2, 2))
            pooled = torch.stack([padded[i:i + 5].sum() / 5 for i in range(slots)])
            out[b, h, order] = pooled
    return out


@pytest.mark.parametrize("decoding", [True, False])
def test_a_decoding_step_weighs_the_window_against_the_queries_before_it(decoding: bool) -> None:
    """When a decoding step compacts (the input is being answered), the vote is the z-scored log ratio of the
    window's pooled attention to that of the ``prompt_window`` queries before it, plus a uniform share; when more
    input follows, the window's plain vote."""
    gen = torch.Generator()
    gen.seed()
    stats, slots, window = random_stats(3), 120, 8
    keys = torch.randn(2, GEOMETRY.num_kv_heads, slots, GEOMETRY.head_dim, generator=gen)
    ctx = prompt_context(keys, 10, 2 * window, gen)
    ctx = ScoreContext(**{**ctx.__dict__, "decoding": decoding})
    got = FrequencyScorer(stats=stats, prompt_window=window, vote_span=0).score(keys, ctx)
    last = pooled_mass_reference(keys, ctx.queries[:, :, window:], ctx.query_positions[:, window:],
                                 ctx.slot_positions)
    vote = last
    if decoding:
        before = pooled_mass_reference(keys, ctx.queries[:, :, :window], ctx.query_positions[:, :window],
                                       ctx.slot_positions)
        uniform = window / ctx.candidates.sum(-1, keepdim=True).double()
        vote = torch.log((last + uniform) / (before + uniform))
    z = (vote - vote.mean(-1, keepdim=True)) / vote.std(-1, unbiased=False, keepdim=True)
    assert bool((z >= POINTED).any())
    novelty = novelty_reference(keys, ctx.candidates, ctx.slot_positions)
    expected = torch.maximum(novelty, torch.where(z >= POINTED, z + VOTE_LEAD, z))
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
    other = FrequencyScorer(stats=stats, prompt_window=window, vote_span=0).score(
        keys, ScoreContext(**{**ctx.__dict__, "decoding": not decoding}))
    assert not torch.allclose(got, other, rtol=1e-3, atol=1e-3)  # the two votes differ on these inputs


def test_score_layers_mixes_layers_after_a_prompt_and_not() -> None:
    """Layers right after a prompt and layers without a window, scored together, equal each scored alone."""
    gen = torch.Generator()
    gen.seed()
    stats, slots = random_stats(2), 200
    keys = [torch.randn(2, GEOMETRY.num_kv_heads, slots, GEOMETRY.head_dim, generator=gen) for _ in range(3)]
    after = prompt_context(keys[1], 10, 8, gen)
    def no_window(layer: int) -> ScoreContext:
        return ScoreContext(layer, after.position, after.tokens_seen, after.slot_positions, after.candidates)

    contexts = [no_window(0), after, no_window(2)]
    scorer = FrequencyScorer(stats=stats, prompt_window=8)
    together = scorer.score_layers(keys, contexts)
    alone = torch.stack([scorer.score(k, c) for k, c in zip(keys, contexts)])
    torch.testing.assert_close(together, alone)
    assert not torch.equal(together[1], scorer.score(keys[1], no_window(1)))  # layer 1 took the prompt path
