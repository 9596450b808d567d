"""Workload statistics learned across calls (``hf_ropekv.workload_statistics``): what they learn, the prior a later
cache scores with, freezing and determinism, files, opt-out, reset, row invariance."""

from __future__ import annotations

import pytest
import torch

import hf_ropekv
from conftest import cache_kw, head_shrunk, tiny_model
from hf_ropekv import RopeKVCache, workload_statistics

PROMPT, NEW = 12, 20


def _prompt(seed: int, length: int = PROMPT, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, cache, ids: torch.Tensor, new: int = NEW, mask: torch.Tensor | None = None) -> torch.Tensor:
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          **cache_kw(model, cache))


def _forwarded(out: torch.Tensor) -> torch.Tensor:
    """The tokens whose queries the model computed: all but the last generated one (never forwarded)."""
    return out[:, :-1]


def _calibrated(model, ids: torch.Tensor) -> hf_ropekv.FrequencyStats:
    return hf_ropekv.calibrate(model, None, ids, progress=False)


def _first_compaction_stats(cache: RopeKVCache) -> dict:
    """Record the statistics the cache's scorer holds when it first scores."""
    seen: dict = {}
    scorer = cache.scorer
    original = scorer.score_layers

    def recording(keys, contexts):
        seen.setdefault("stats", scorer.stats)
        return original(keys, contexts)

    scorer.score_layers = recording
    return seen


def test_a_fresh_model_has_empty_workload_statistics_and_a_cache_without_prior() -> None:
    model = tiny_model("llama")
    workload = workload_statistics(model)
    assert workload.tokens == 0 and not workload.frozen and workload.prior() is None
    cache = RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)
    assert cache.workload_prior_tokens == 0 and "workload_prior" not in repr(cache)
    assert workload_statistics(tiny_model("llama")) is not workload  # same seed, new object: nothing shared


def test_caches_learn_only_when_asked_for_now() -> None:
    """Off by default (for now): a default cache neither feeds nor reads the workload statistics."""
    model = tiny_model("llama")
    ids = _prompt(15)
    first = _generate(model, RopeKVCache(model, budget=16, compress_every=8), ids)
    assert workload_statistics(model).tokens == 0
    torch.testing.assert_close(_generate(model, RopeKVCache(model, budget=16, compress_every=8), ids), first,
                               atol=0, rtol=0)


def test_the_workload_learns_every_real_query_and_a_second_cache_starts_from_it() -> None:
    model = tiny_model("llama")
    # No eviction in the first call: its queries are those of one full forward over the same tokens.
    first = _generate(model, RopeKVCache(model, budget=64, compress_every=8, learn_workload=True), _prompt(1))
    workload = workload_statistics(model)
    expected = _calibrated(model, _forwarded(first))
    assert workload.tokens == expected.tokens == PROMPT + NEW - 1
    learned = workload.to_stats()
    torch.testing.assert_close(learned.q_mean, expected.q_mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(learned.q_abs_mean, expected.q_abs_mean, atol=1e-5, rtol=1e-4)
    assert learned.q_abs_mean.abs().sum() > 0

    # The second cache blends the prior (weight w) with its own undecayed queries, shrunk toward the layer's head
    # average by k pseudo-queries, at its first compaction.
    w = 40.0
    cache = RopeKVCache(model, budget=16, compress_every=8, stats_half_life=None, prior_tokens=w, learn_workload=True)
    assert cache.workload_prior_tokens == PROMPT + NEW - 1 and not cache.workload_prior_frozen
    seen = _first_compaction_stats(cache)
    second = _generate(model, cache, _prompt(2))
    stats = seen["stats"]
    n = int(stats.tokens[0])
    assert PROMPT < n < PROMPT + NEW
    own = _calibrated(model, second[:, :n])
    for layer in range(model.config.num_hidden_layers):
        q_mean, q_abs = stats.for_layer(layer)
        k = cache.stats_head_shrink
        blend_mean = (expected.q_mean[layer] * w + head_shrunk(own.q_mean[layer], n, k) * (n + k)) / (w + n + k)
        blend_abs = (expected.q_abs_mean[layer] * w + head_shrunk(own.q_abs_mean[layer], n, k) * (n + k)) / (w + n + k)
        torch.testing.assert_close(q_mean[0], blend_mean, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(q_abs[0], blend_abs, atol=1e-5, rtol=1e-4)
        # ... which is neither the prior nor the row's own statistics alone.
        assert not torch.allclose(q_abs[0], own.q_abs_mean[layer], atol=1e-4)
    assert "workload_prior=31 tokens (learning)" in repr(cache)


def test_freezing_stops_learning_and_makes_calls_reproducible() -> None:
    model = tiny_model("qwen2")
    workload = workload_statistics(model)
    workload.freeze_at = 50  # the first call (12 + 19 tokens) leaves it learning, the second freezes it
    ids = _prompt(3)
    caches = [RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)]
    _generate(model, caches[0], ids)
    caches.append(RopeKVCache(model, budget=16, compress_every=8, learn_workload=True))
    _generate(model, caches[1], ids)
    assert caches[0].workload_prior_tokens == 0 and caches[1].workload_prior_tokens == PROMPT + NEW - 1
    learned = workload.tokens  # the fold that crossed 50 counts whole; what came after it does not
    assert workload.frozen and 50 <= learned < 2 * (PROMPT + NEW - 1)
    frozen = [_generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=True), ids) for _ in range(2)]
    assert workload.tokens == learned  # nothing learned since
    torch.testing.assert_close(frozen[0], frozen[1], atol=0, rtol=0)
    cache = RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)
    assert cache.workload_prior_frozen and "(frozen)" in repr(cache)


def test_freeze_by_hand_and_reset() -> None:
    model = tiny_model("llama")
    workload = workload_statistics(model)
    _generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=True), _prompt(4))
    learned = workload.tokens
    workload.freeze()
    _generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=True), _prompt(5))
    assert workload.frozen and workload.tokens == learned
    workload.reset()
    assert workload.tokens == 0 and not workload.frozen and workload.prior() is None
    with pytest.raises(ValueError, match="freeze_at must be a positive int"):
        workload.freeze_at = 0


def test_reset_forgets_the_steps_a_live_cache_deferred_before_it() -> None:
    """Decoding steps are folded 16 at a time; those a still-referenced cache holds at a reset belong to before it
    and must not arrive in the workload afterwards (they did: the next prior counted them)."""
    model = tiny_model("llama")
    workload = workload_statistics(model)
    cache = RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)
    _generate(model, cache, _prompt(6), new=10)  # 9 decoding steps: fewer than one fold
    workload.reset()
    assert workload.tokens == 0 and workload.prior() is None
    twin = RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)
    assert twin.workload_prior_tokens == 0
    del cache


def test_a_freeze_by_hand_keeps_the_steps_a_live_cache_deferred() -> None:
    """freeze() right after a generation: its decoding steps, still deferred in the live cache (folded 16 at a time),
    count; they were lost before freeze() folded them in."""
    model = tiny_model("llama")
    workload = workload_statistics(model)
    cache = RopeKVCache(model, budget=64, compress_every=8, learn_workload=True)
    _generate(model, cache, _prompt(6), new=10)  # 9 decoding steps: fewer than one fold
    workload.freeze()
    assert workload.tokens == PROMPT + 10 - 1
    del cache
    assert workload.tokens == PROMPT + 10 - 1  # (and a dropped frozen cache adds nothing)


def test_stats_prompt_weight_zero_learns_the_generation_alone() -> None:
    """stats_prompt_weight=0: the workload learns the decoding steps' queries and no prompt; the prior equals the
    calibrated statistics of the generated positions alone (a full forward's queries past the prompt)."""
    model = tiny_model("llama")
    cache = RopeKVCache(model, budget=64, compress_every=8, learn_workload=True, stats_prompt_weight=0)
    assert cache.stats_prompt_weight == 0 and cache._online.prompt_weight == 0
    out = _generate(model, cache, _prompt(7))
    workload = workload_statistics(model)
    assert workload.tokens == NEW - 1  # the decoding steps: the first new token came from the prompt's forward
    ids = _forwarded(out)
    calibrate_all = _calibrated(model, ids)
    # The generated positions' means: (all positions' sums - the prompt's) / (NEW - 1).
    prompt_only = _calibrated(model, ids[:, :PROMPT])
    learned = workload.to_stats()
    n_all, n_prompt = calibrate_all.tokens, prompt_only.tokens
    for name in ("q_mean", "q_abs_mean"):
        expected = (getattr(calibrate_all, name) * n_all - getattr(prompt_only, name) * n_prompt) / (n_all - n_prompt)
        torch.testing.assert_close(getattr(learned, name), expected, atol=1e-4, rtol=1e-3)


def test_a_prompt_free_static_cache_compiles_to_the_eager_tokens_and_learns_the_same(fresh_dynamo) -> None:
    """stats_prompt_weight=0 on a static cache: the compiled decode step keeps the eager step's tokens (its prompt
    tables decay between steps, outside the graph) and both learn the decoding steps alone, the same statistics."""
    from torch._dynamo.utils import counters

    from test_static_cache import compiled

    model = tiny_model("llama")
    workload = workload_statistics(model)
    ids = _prompt(18, batch=2)
    outputs, learned = [], []
    for compile_config in (None, compiled()):
        workload.reset()
        cache = RopeKVCache(model, budget=16, compress_every=4, static=True, learn_workload=True, prior_tokens=0,
                            protect_prompt=False, stats_prompt_weight=0)
        kwargs = {} if compile_config is None else {"compile_config": compile_config}
        outputs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                      do_sample=False, pad_token_id=0, **kwargs, **cache_kw(model, cache)))
        assert cache.num_compactions >= 3
        del cache
        learned.append((workload.tokens, workload.to_stats()))
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(outputs[0], outputs[1])
    assert learned[0][0] == learned[1][0] == 2 * (NEW - 1)
    torch.testing.assert_close(learned[1][1].q_abs_mean, learned[0][1].q_abs_mean, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bad", [-1, True, "0", float("inf")])
def test_stats_prompt_weight_must_be_a_number_at_least_zero(bad) -> None:
    with pytest.raises(ValueError, match="stats_prompt_weight must be a number >= 0"):
        RopeKVCache(tiny_model("llama"), budget=16, stats_prompt_weight=bad)


def test_opting_out_neither_feeds_nor_reads() -> None:
    model = tiny_model("llama")
    workload = workload_statistics(model)
    ids = _prompt(6)
    baseline = _generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=False), ids)
    assert workload.tokens == 0
    _generate(model, RopeKVCache(model, budget=16, compress_every=8, stats=_calibrated(model, ids),
                                         learn_workload=True), ids)
    assert workload.tokens == 0  # explicit statistics take no part either
    _generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=True), _prompt(7))
    assert workload.tokens > 0
    opted_out = RopeKVCache(model, budget=16, compress_every=8, learn_workload=False)
    assert opted_out.workload_prior_tokens == 0
    torch.testing.assert_close(_generate(model, opted_out, ids), baseline, atol=0, rtol=0)
    # prior_tokens=0: the cache still feeds but scores as without a prior.
    before = workload.tokens
    unweighted = RopeKVCache(model, budget=16, compress_every=8, prior_tokens=0, learn_workload=True)
    torch.testing.assert_close(_generate(model, unweighted, ids), baseline, atol=0, rtol=0)
    assert workload.tokens > before


@pytest.mark.parametrize("bad", [None, "off", 1])
def test_learn_workload_must_be_a_bool(bad) -> None:
    with pytest.raises(ValueError, match="learn_workload must be True or False"):
        RopeKVCache(tiny_model("llama"), budget=16, learn_workload=bad)


@pytest.mark.parametrize("bad", [-1, float("inf"), "512", None])
def test_prior_tokens_must_be_a_number_at_least_zero(bad) -> None:
    with pytest.raises(ValueError, match="prior_tokens must be a number >= 0"):
        RopeKVCache(tiny_model("llama"), budget=16, prior_tokens=bad)


def test_save_load_round_trip_and_refusal_for_other_weights(tmp_path) -> None:
    model = tiny_model("llama")
    workload = workload_statistics(model)
    _generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=True), _prompt(8))
    workload.freeze()
    path = tmp_path / "workload.safetensors"
    workload.save(path)
    saved = workload.to_stats()

    fresh = tiny_model("llama")  # same weights (same seed): same fingerprint
    loaded = workload_statistics(fresh).load(path)
    assert loaded.frozen and loaded.tokens == workload.tokens
    torch.testing.assert_close(loaded.to_stats().q_mean, saved.q_mean, atol=1e-6, rtol=1e-5)
    ids = _prompt(9)
    on_loaded = _generate(fresh, RopeKVCache(fresh, budget=16, compress_every=8, learn_workload=True), ids)
    on_original = _generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=True), ids)
    torch.testing.assert_close(on_loaded, on_original, atol=0, rtol=0)
    # A file is also plain statistics for stats=.
    assert hf_ropekv.FrequencyStats.load(path).tokens == workload.tokens

    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="fingerprint"):
        workload_statistics(other).load(path)
    with pytest.raises(ValueError, match="do not fit this model"):
        workload_statistics(tiny_model("qwen3")).load(path)


def test_rows_do_not_depend_on_padding_or_batch_mates_with_a_learned_prior() -> None:
    model = tiny_model("llama")
    _generate(model, RopeKVCache(model, budget=16, compress_every=8, learn_workload=True), _prompt(10, batch=2))
    workload_statistics(model).freeze()
    row = _prompt(11, length=7)
    mate = _prompt(12, length=13)

    def run(rows: list[torch.Tensor]) -> torch.Tensor:
        width = max(r.shape[1] for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - r.shape[1]:], mask[i, width - r.shape[1]:] = r[0], 1
        cache = RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)
        assert cache.workload_prior_tokens > 0
        out = _generate(model, cache, ids, new=30, mask=mask)
        assert cache.num_compactions >= 2
        return out[:, width:]

    alone = run([row])
    torch.testing.assert_close(run([mate, row])[1:], alone, atol=0, rtol=0)
    torch.testing.assert_close(run([row, mate])[:1], alone, atol=0, rtol=0)


def test_enable_passes_the_option_and_the_summary_reports_the_prior() -> None:
    model = tiny_model("llama")
    ids = _prompt(13)
    with hf_ropekv.enabled(model, budget=16, compress_every=8, learn_workload=False):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert workload_statistics(model).tokens == 0
    with hf_ropekv.enabled(model, budget=16, compress_every=8, learn_workload=True):
        for _ in range(2):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        summary = hf_ropekv.last_summary(model)
    assert summary.workload_prior_tokens == PROMPT + NEW - 1 and not summary.workload_prior_frozen
    assert "workload prior of 31 tokens (still learning)" in str(summary)


def test_a_static_cache_learns_the_same_statistics() -> None:
    model = tiny_model("llama")
    ids = _prompt(14)
    out = _generate(model, RopeKVCache(model, budget=64, compress_every=8, static=True, learn_workload=True), ids)
    expected = _calibrated(model, _forwarded(out))
    workload = workload_statistics(model)
    assert workload.tokens == PROMPT + NEW - 1
    torch.testing.assert_close(workload.to_stats().q_abs_mean, expected.q_abs_mean, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("compiled_step", [False, True])
def test_a_static_cache_learns_every_step_across_compactions_and_freezes_exactly(compiled_step: bool,
                                                                                 fresh_dynamo) -> None:
    """A static cache's decoding steps go into per-row learning sums, added to the workload between steps (at each
    compaction, when read, when the cache is dropped). With compactions in between, eager and compiled (generate's
    own compilation, dynamo's eager backend), it learns what the growing cache learns (every layer: queries past the
    first layer depend on what was evicted), and the first layer's equal calibration on the tokens it counted. With
    ``freeze_at`` inside the generation, learning stops at exactly that token: the step that reaches it included
    (before, a static cache counted that step without adding its queries), none after."""
    from test_static_cache import compiled

    extra = {"compile_config": compiled()} if compiled_step else {}
    ids = _prompt(15)

    def learn(freeze_at: int, static: bool):
        model = tiny_model("llama")
        workload = workload_statistics(model)
        workload.freeze_at = freeze_at
        cache = RopeKVCache(model, budget=16, compress_every=4, static=static, learn_workload=True,
                            protect_prompt=False)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, **cache_kw(model, cache), **(extra if static else {}))
        assert cache.num_compactions >= 3
        del cache
        first = workload.geometry.full_attention_layers[0]
        expected = _calibrated(model, _forwarded(out)[:, : workload.tokens])
        torch.testing.assert_close(workload.to_stats().q_abs_mean[first], expected.q_abs_mean[first], atol=1e-5,
                                   rtol=1e-4)
        return workload

    static, growing = learn(10**6, static=True), learn(10**6, static=False)
    assert static.tokens == growing.tokens == PROMPT + NEW - 1
    torch.testing.assert_close(static.to_stats().q_abs_mean, growing.to_stats().q_abs_mean, atol=1e-5, rtol=1e-4)
    frozen = learn(PROMPT + 5, static=True)
    assert frozen.frozen and frozen.tokens == PROMPT + 5


def test_a_freeze_in_mid_generation_does_not_recompile_the_compiled_step(fresh_dynamo) -> None:
    """The workload freezes inside the first generate(): its compiled step goes on unchanged (before, the freeze
    check was a guard of the step, which compiled again at the freeze, and the next cache compiled a third graph).
    The caches built after the freeze share one more graph, and give identical outputs."""
    from torch._dynamo.utils import counters

    from test_static_cache import compiled

    model = tiny_model("llama")
    workload = workload_statistics(model)
    workload.freeze_at = 2 * PROMPT + 10  # inside the first call: 2 rows x (12 + 19) tokens
    ids = _prompt(17, batch=2)
    graphs, outputs = [], []
    for _ in range(3):
        cache = RopeKVCache(model, budget=16, compress_every=4, static=True, learn_workload=True,
                            protect_prompt=False)
        outputs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                      do_sample=False, pad_token_id=0, compile_config=compiled(),
                                      **cache_kw(model, cache)))
        assert cache.num_compactions >= 3
        del cache
        graphs.append(counters["stats"]["unique_graphs"])
    assert workload.frozen and workload.tokens == 2 * PROMPT + 10
    assert graphs == [1, 2, 2]
    assert torch.equal(outputs[1], outputs[2])


@pytest.mark.parametrize("mode", ["growing", "static", "compiled"])
def test_rows_that_ended_feed_the_workload_nothing_more(mode: str, fresh_dynamo) -> None:
    """generate() feeds a batch's finished rows (their end-of-sequence token, then pad, attention mask 1) until
    the longest row ends; none of that is workload text. Row 1 (left-padded) ends early: the workload learns
    exactly the real tokens each row forwarded, in every decoding mode."""
    from test_static_cache import compiled

    model = tiny_model("llama")
    model.generation_config.pad_token_id = None  # the pad id is known only from the prompt's padding
    short = 3
    ids = _prompt(16, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :short] = 0

    def run(cache=None, **extra):
        kwargs = {} if cache is None else cache_kw(model, cache)
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              pad_token_id=pad, **kwargs, **extra)

    model.generation_config.eos_token_id = None
    pad = 1
    plain = run()
    a0, a1 = plain[0, PROMPT:].tolist(), plain[1, PROMPT:].tolist()
    cut = next(i for i in range(2, NEW - 4) if a1[i] not in a1[:i] + a0 + [pad])
    assert pad not in a0 + a1[:cut]
    ids[1, :short] = pad
    model.generation_config.eos_token_id = a1[cut]

    cache = RopeKVCache(model, budget=64, compress_every=8, static=mode != "growing", learn_workload=True)
    out = run(cache, **({"compile_config": compiled()} if mode == "compiled" else {}))
    assert out[0, PROMPT:].tolist() == a0 and out[1, PROMPT:].tolist() == a1[: cut + 1] + [pad] * (NEW - cut - 1)
    del cache
    workload = workload_statistics(model)
    expected = _calibrated(model, [ids[0].tolist() + a0[:-1], ids[1, short:].tolist() + a1[:cut]])
    assert workload.tokens == expected.tokens == 2 * PROMPT - short + NEW - 1 + cut
    learned = workload.to_stats()
    torch.testing.assert_close(learned.q_mean, expected.q_mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(learned.q_abs_mean, expected.q_abs_mean, atol=1e-5, rtol=1e-4)


def test_a_copied_cache_feeds_the_same_workload() -> None:
    import copy

    model = tiny_model("llama")
    cache = RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)
    twin = copy.deepcopy(cache)
    assert twin._online.learn is workload_statistics(model)


def test_a_dropped_cache_hands_its_deferred_steps_over_as_it_goes() -> None:
    """The hand-over (``WorkloadFeed.hand_over_at_end``) holds the feed's containers, never the statistics: a dropped
    cache's statistics go at once, without the collector, and the workload adopts the steps they had deferred."""
    import gc
    import weakref

    model = tiny_model("llama")
    workload = workload_statistics(model)
    cache = RopeKVCache(model, budget=16, compress_every=8, learn_workload=True)
    out = _generate(model, cache, _prompt(3))
    online = weakref.ref(cache._online)
    assert cache._online._deferred and workload._tokens < _forwarded(out).numel()  # (_tokens: read without a flush)
    gc.collect()
    gc.disable()
    try:
        del cache
        assert online() is None
        assert workload._tokens == _forwarded(out).numel()
    finally:
        gc.enable()


@pytest.mark.slow
def test_learned_statistics_do_not_cost_perplexity_on_smollm2(smollm2) -> None:
    """Decode conditions on real weights: text fed one token per forward after an unlike chat prompt, small budget.
    After earlier calls on other text of the same kind, the default cache scores with the learned prior; its
    perplexity is no worse than the cold cache's (small tolerance)."""
    import math

    import offline_assets

    model, tokenizer = smollm2
    texts = []
    # Technical prose of one kind: the standard library's docstrings are always installed (Debian's doc packages,
    # which the benchmarks use, are not).
    texts = offline_assets.stdlib_docstring_texts(min_chars=6000, limit=4)
    assert len(texts) == 4, texts
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"][:300] for _, text in texts]
    held_out, earlier = pieces[0], pieces[1:]
    prompt = tokenizer("User: write a short poem about the sea.\nAssistant:", add_special_tokens=False)["input_ids"]
    workload = workload_statistics(model)

    def decode(document: list[int]) -> tuple[float, RopeKVCache]:
        """Perplexity of ``document`` fed one token per forward after the prompt (the cache: the default one)."""
        cache = RopeKVCache(model, budget=64, compress_every=32, learn_workload=True)
        kw = cache_kw(model, cache)
        nll = []
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt]), **kw).logits[:, -1]
            for token in document:
                nll.append(-torch.log_softmax(logits.float(), -1)[0, token].item())
                logits = model(input_ids=torch.tensor([[token]]), **kw).logits[:, -1]
        return math.exp(sum(nll) / len(nll)), cache

    workload.reset()  # the session's model: leave it as found (finally)
    try:
        cold, cold_cache = decode(held_out)
        assert cold_cache.workload_prior_tokens == 0 and cold_cache.num_compactions > 0
        workload.reset()  # forget the held-out text itself
        for piece in earlier:  # earlier calls on other text of the same kind
            decode(piece)
        workload.freeze()
        warm, warm_cache = decode(held_out)
        assert warm_cache.workload_prior_tokens == 3 * (len(prompt) + 300)
        assert warm <= cold * 1.03, (warm, cold)
    finally:
        workload.reset()
