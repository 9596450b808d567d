"""The default policy: RoPE frequency scoring inside the cache, at the paper's operating point."""

from __future__ import annotations

import pytest
import torch

from conftest import cache_kw, head_shrunk, padded_batch, tiny_model
from hf_ropekv import FrequencyScorer, FrequencyStats, RopeKVCache
from hf_ropekv.statistics.calibration import calibrate
from hf_ropekv.model.geometry import describe
from hf_ropekv.statistics.online import RowStatistics
from hf_ropekv.scorers.base import ScoreContext
from hf_ropekv.scorers.rope_scoring import query_weights, score_keys
from hf_ropekv.statistics.frequency_stats import geometry_metadata

PROMPT, BUDGET, EVERY = 40, 16, 8


def random_stats(model_or_config, seed: int = 0, spread: float = 1.0) -> FrequencyStats:
    """Random statistics; ``spread`` scales A - |q_mean| (0: the norm term vanishes, only trig is left)."""
    geometry = describe(model_or_config)
    g = torch.Generator().manual_seed(seed)
    shape = (geometry.num_layers, geometry.num_q_heads, geometry.inv_freq.numel())
    q_mean = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    q_abs = q_mean.abs() * (1 + spread * torch.rand(shape, generator=g))
    return FrequencyStats(q_mean, q_abs, {**geometry_metadata(geometry), "tokens": 1, "source": "random"})


def fill(cache: RopeKVCache, keys_per_layer: list[torch.Tensor]) -> None:
    """Prefill every layer with the given keys (values random), then one decoding token to trigger compaction."""
    for layer, keys in enumerate(keys_per_layer):
        cache.update(keys, torch.randn_like(keys), layer)
    for layer, keys in enumerate(keys_per_layer):
        step = torch.randn(keys.shape[0], keys.shape[1], 1, keys.shape[3])
        cache.update(step, torch.randn_like(step), layer)


def planted_keys(config, stats: FrequencyStats, slots: list[int], sign: float) -> list[torch.Tensor]:
    """Random keys, except `slots`, which point along (sign x) the scoring direction of one query head."""
    geometry = describe(config)
    group = geometry.group_size
    out = []
    for layer in range(geometry.num_layers):
        keys = torch.randn(1, geometry.num_kv_heads, PROMPT, geometry.head_dim)
        q_mean, q_abs = stats.for_layer(layer)
        w, _ = query_weights(q_mean, q_abs, geometry.inv_freq, PROMPT)  # [1, H_q, 2F]
        for kv_head in range(geometry.num_kv_heads):
            direction = w[0, kv_head * group, :]
            direction = direction / direction.norm()
            for slot in slots:
                keys[0, kv_head, slot, : direction.numel()] = sign * 6.0 * direction
        out.append(keys)
    return out


@pytest.mark.parametrize(
    "sign, survive, kv_heads, spread",
    [
        (1.0, True, 2, 1.0),  # GQA: aligned with one head of the group, the group max keeps it
        (-1.0, False, 4, 0.0),  # one query head per KV head, trig only: anti-aligned keys go first
    ],
)
def test_eviction_follows_the_scores(sign: float, survive: bool, kv_heads: int, spread: float) -> None:
    config = tiny_model("llama", num_key_value_heads=kv_heads).config
    stats = random_stats(config, spread=spread)
    slots = [3, 17, 29]
    cache = RopeKVCache(config, budget=BUDGET, compress_every=EVERY, stats=stats, protect_prompt=False)
    fill(cache, planted_keys(config, stats, slots, sign))
    assert cache.num_compactions == 1 and cache.tokens_kept == BUDGET + 1
    for layer in cache._full_layers:
        kept = layer.storage.live_positions()[0]
        for head in range(kept.shape[0]):
            present = {slot in kept[head].tolist() for slot in slots}
            assert present == {survive}, f"layer {layer.layer_idx} head {head}: {kept[head].tolist()}"


def reference_selection(keys: list[torch.Tensor], stats: FrequencyStats, inv_freq, position: int, keep: int):
    """README "How it works", the selection written out: z-score per query head, max over the group, mean over
    layers, top-k."""
    per_layer = []
    for layer, k in enumerate(keys):
        q_mean, q_abs = stats.for_layer(layer)
        raw = score_keys(k, q_mean, q_abs, inv_freq, position)[0].double()  # [H_q, S]
        z = (raw - raw.mean(-1, keepdim=True)) / raw.std(-1, unbiased=False, keepdim=True)
        per_layer.append(z.view(k.shape[1], -1, k.shape[2]).amax(1))
    ranking = torch.stack(per_layer).mean(0)
    return ranking.topk(keep, dim=-1).indices.sort(-1).values


def test_global_selection_matches_the_formula() -> None:
    config = tiny_model("qwen3", num_hidden_layers=3).config
    stats = random_stats(config, seed=1)
    geometry = describe(config)
    keys = [torch.randn(1, geometry.num_kv_heads, PROMPT, geometry.head_dim) for _ in range(geometry.num_layers)]
    cache = RopeKVCache(config, budget=BUDGET, compress_every=EVERY, stats=stats, protect_prompt=False,
                        selection="global", window=0)
    fill(cache, keys)
    want = reference_selection(keys, stats, geometry.inv_freq, PROMPT, BUDGET)
    got = cache._full_layers[0].storage.live_positions()[0, :, :BUDGET]
    assert torch.equal(got, want)


def test_replaced_statistics_take_effect_even_at_a_reused_address() -> None:
    """Online statistics swap a new snapshot in at every compaction and drop the old one; CPython then often
    hands the new object the old one's address. The scorer must always score with the statistics it holds
    (with an id()-keyed device cache it did not: the bug behind a flaky quality-harness test)."""
    config = tiny_model("llama").config
    geometry = describe(config)
    keys = torch.randn(1, geometry.num_kv_heads, PROMPT, geometry.head_dim)
    ctx = ScoreContext(layer_idx=1, position=torch.tensor([PROMPT]), tokens_seen=PROMPT,
                       slot_positions=torch.arange(PROMPT).expand(1, geometry.num_kv_heads, PROMPT),
                       candidates=torch.ones(1, geometry.num_kv_heads, PROMPT, dtype=torch.bool))
    scorer = FrequencyScorer(random_stats(config, seed=0))
    for seed in range(1, 20):
        before = scorer.score(keys, ctx)  # the scorer now holds device copies of the current statistics
        parts = random_stats(config, seed=seed)  # tensors and metadata first, so that the object comes next
        q_mean, q_abs, metadata = parts.q_mean, parts.q_abs_mean, parts.metadata
        del parts
        scorer.stats = None  # drops the old statistics, as the online snapshot swap does
        scorer.stats = FrequencyStats(q_mean, q_abs, metadata)
        want = FrequencyScorer(scorer.stats).score(keys, ctx)
        assert not torch.equal(want, before)
        torch.testing.assert_close(scorer.score(keys, ctx), want, atol=0, rtol=0, msg=f"swap {seed}")


def test_mismatched_stats_are_refused() -> None:
    other = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2).config
    with pytest.raises(ValueError, match="query heads"):
        RopeKVCache(tiny_model("llama"), budget=32, stats=random_stats(other))


def test_stats_from_a_file_are_validated(tmp_path) -> None:
    model = tiny_model("qwen3")
    path = tmp_path / "stats.safetensors"
    random_stats(model).save(path)
    cache = RopeKVCache(model, budget=32, stats=str(path))
    assert isinstance(cache.scorer, FrequencyScorer) and cache.scorer.stats.tokens == 1
    with pytest.raises(ValueError, match="model type"):
        RopeKVCache(tiny_model("llama"), budget=32, stats=path)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_with_calibrated_and_online_statistics(arch: str) -> None:
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size)
    stats = calibrate(model, None, torch.randint(3, model.config.vocab_size, (4, 64)), progress=False)
    runs = {}
    for name, options in {"calibrated": {"stats": stats}, "online": {}}.items():
        cache = RopeKVCache(model, budget=20, compress_every=8, **options)
        runs[name] = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache),
                                    max_new_tokens=40, do_sample=False, pad_token_id=0)
        assert cache.num_compactions >= 3 and cache.tokens_kept <= 28
    assert runs["online"].shape == runs["calibrated"].shape == (3, ids.shape[1] + 40)


def test_online_statistics_of_the_prompt_are_each_rows_own() -> None:
    """stats=None: after the prompt, each row's statistics are those of its own real (unpadded) queries, each
    head shrunk toward its layer's head average (the default ``stats_head_shrink``)."""
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(12, 7))
    cache = RopeKVCache(model, budget=14, compress_every=4)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kw(model, cache))
    online = cache._online.snapshot()
    assert online.tokens.tolist() == [12.0, 7.0]
    k = cache.stats_head_shrink
    assert k == 256
    for row, real in enumerate([ids[0, :], ids[1, 5:]]):
        offline = calibrate(model, None, [real.tolist()], progress=False)
        n = len(real)
        for layer in range(model.config.num_hidden_layers):
            q_mean, q_abs = online.for_layer(layer)
            torch.testing.assert_close(q_mean[row], head_shrunk(offline.q_mean[layer], n, k), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(q_abs[row], head_shrunk(offline.q_abs_mean[layer], n, k), atol=1e-5,
                                       rtol=1e-4)
    unshrunk = RopeKVCache(model, budget=14, compress_every=4, stats_head_shrink=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kw(model, unshrunk))
    offline = calibrate(model, None, [ids[0].tolist()], progress=False)
    torch.testing.assert_close(unshrunk._online.snapshot().for_layer(0)[1][0], offline.q_abs_mean[0], atol=1e-5,
                               rtol=1e-4)


def test_every_compaction_scores_with_the_statistics_of_the_finished_forwards(caplog) -> None:
    """Online statistics across a multi-turn conversation: every forward (a user turn, each answer token) adds
    its queries once it has finished. Every compaction, also one inside a turn's forward, scores all layers
    with the snapshot of the forwards finished before it, and with the statistics the cache holds."""
    model = tiny_model("llama")
    cache = RopeKVCache(model, budget=16, compress_every=4, stats_half_life=None)  # counts: every token weighs 1
    scorer = cache.scorer
    calls: list[tuple[torch.Tensor, object, RowStatistics, torch.Tensor, int]] = []
    finished_tokens, compactions_inside_a_turn = 0, 0
    score = scorer.score

    def recording_score(keys, ctx):
        out = score(keys, ctx)
        stats = scorer.stats  # copied, not held: holding it would keep the cache's old snapshots alive
        copy = RowStatistics(
            tuple(t.clone() for t in stats.q_mean), tuple(t.clone() for t in stats.q_abs_mean),
            dict(stats.metadata), stats.tokens.clone(),
        )
        calls.append((keys.clone(), ctx, copy, out.clone(), finished_tokens))
        nonlocal compactions_inside_a_turn
        compactions_inside_a_turn += in_turn
        return out

    score_layers = scorer.score_layers

    def recording_score_layers(keys, contexts):  # a compaction of every layer at once (per-layer selection)
        out = score_layers(keys, contexts)
        stats = scorer.stats
        copy = RowStatistics(
            tuple(t.clone() for t in stats.q_mean), tuple(t.clone() for t in stats.q_abs_mean),
            dict(stats.metadata), stats.tokens.clone(),
        )
        calls.extend((k.clone(), ctx, copy, o.clone(), finished_tokens) for k, ctx, o in zip(keys, contexts, out))
        nonlocal compactions_inside_a_turn
        compactions_inside_a_turn += in_turn
        return out

    scorer.score = recording_score
    scorer.score_layers = recording_score_layers
    gen = torch.Generator().manual_seed(3)
    pass_cache = cache_kw(model, cache)
    in_turn = False
    with torch.no_grad():
        for turn in range(8):
            ids = torch.randint(3, 128, (1, 6 + turn), generator=gen)
            seen, in_turn = cache.get_seq_length(), True
            model(input_ids=ids, position_ids=torch.arange(seen, seen + ids.shape[1])[None], **pass_cache)
            finished_tokens, in_turn = finished_tokens + ids.shape[1], False
            for _ in range(5):  # a short answer, token by token
                seen = cache.get_seq_length()
                step = torch.randint(3, 128, (1, 1), generator=gen)
                model(input_ids=step, position_ids=torch.tensor([[seen]]), **pass_cache)
                finished_tokens += 1
    assert len({float(stats.tokens[0]) for _, _, stats, _, _ in calls}) >= 6
    assert compactions_inside_a_turn >= 3
    for keys, ctx, stats, got, tokens in calls:
        assert stats.tokens.tolist() == [float(tokens)]  # every finished forward, answer tokens included
        torch.testing.assert_close(got, FrequencyScorer(stats).score(keys, ctx), atol=0, rtol=0)
    assert "different numbers of positions" not in caplog.text


@pytest.mark.parametrize("per_row", [False, True], ids=["shared-stats", "per-row-stats"])
def test_score_layers_equals_scoring_each_layer(per_row: bool) -> None:
    """score_layers (one set of query-weight ops for every layer) gives exactly score()'s result per layer."""
    model = tiny_model("llama")
    geometry = describe(model)
    stats = random_stats(model, seed=4)
    batch, slots = 3, 37
    g = torch.Generator().manual_seed(6)
    if per_row:  # per-row statistics, as online statistics give them
        q_mean = tuple(torch.complex(torch.randn(batch, *s.shape, generator=g), torch.randn(batch, *s.shape, generator=g))
                       for s in stats.q_mean)
        q_abs = tuple(q.abs() * (1 + torch.rand(q.shape, generator=g)) for q in q_mean)
        stats = RowStatistics(q_mean, q_abs, dict(stats.metadata), torch.ones(batch, dtype=torch.float64))
    scorer = FrequencyScorer(stats)
    keys, contexts = [], []
    for layer in range(geometry.num_layers):
        keys.append(torch.randn(batch, geometry.num_kv_heads, slots, geometry.head_dim, generator=g))
        contexts.append(ScoreContext(
            layer_idx=layer,
            position=torch.tensor([50, 47, 61]),
            tokens_seen=61,
            slot_positions=torch.arange(slots).expand(batch, geometry.num_kv_heads, slots),
            candidates=torch.rand(batch, geometry.num_kv_heads, slots, generator=g) > 0.2,
        ))
    together = scorer.score_layers(keys, contexts)
    assert together.shape == (geometry.num_layers, batch, geometry.num_kv_heads, slots)
    for layer in range(geometry.num_layers):
        assert torch.equal(together[layer], scorer.score(keys[layer], contexts[layer]))
