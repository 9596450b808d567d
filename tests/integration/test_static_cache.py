"""RopeKVCache(static=True) on the CPU: a fixed arena, every decision taken before the forward.

The reference is the growing cache (``static=False``): with the same options the static cache must keep the same
tokens and so generate the same tokens, eagerly and compiled, across many compactions; with nothing evicted both
equal ``DynamicCache``. On one CUDA device a static cache replays its decode steps as CUDA graphs (tests marked
``gpu``); where graphs cannot hold the model, generate compiles them: on the CPU that path is checked with dynamo's
``eager`` backend, ``fullgraph=True`` (a graph break is an error), in the tests marked ``compile``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import CompileConfig, DynamicCache

from conftest import cache_kw, compiled, generate_new, hand_written_loop, leftovers, padded_batch, tiny_model
from hf_ropekv import FrequencyScorer, RopeKVCache, calibrate, disable, enable
from hf_ropekv.cache.options import PAGE_SIZE
from hf_ropekv.scorers import KeyNormScorer, RandomScorer, RecencyScorer

NEW_TOKENS = 48
BUDGET, EVERY = 16, 4


def generate(model, cache, ids, mask, new=NEW_TOKENS, **kwargs) -> torch.Tensor:
    return generate_new(model, cache, ids, mask, new, **kwargs)


def _calibrated(model):
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5))
    return {"scorer": FrequencyScorer(stats=calibrate(model, None, ids, progress=False))}


OPTIONS = {
    "default": lambda model: {},
    "half-life-8": lambda model: {"scorer": FrequencyScorer(half_life=8)},
    "no-prompt-window": lambda model: {"scorer": FrequencyScorer(prompt_window=0), "window": 2},
    "calibrated": _calibrated,
    "recency": lambda model: {"scorer": RecencyScorer(), "sink": 2},
    "keynorm": lambda model: {"scorer": KeyNormScorer()},
    "random": lambda model: {"scorer": RandomScorer(seed=1), "window": 3},
}


def _same_kept(cache: RopeKVCache, reference: RopeKVCache) -> None:
    assert cache.num_compactions == reference.num_compactions
    assert cache.tokens_kept_per_row == reference.tokens_kept_per_row
    for layer in range(len(cache.layers)):
        assert torch.equal(cache.kept_positions(layer), reference.kept_positions(layer)), layer


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_static_cache_keeps_what_the_growing_cache_keeps(name: str) -> None:
    """Same tokens and the same kept positions in every layer as static=False, in a left-padded batch with many
    compactions; ``cache.static`` says which it is."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6, 3))
    reference = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False, **OPTIONS[name](model))
    expected = generate(model, reference, ids, mask)
    assert reference.num_compactions >= 8 and not reference.static
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, **OPTIONS[name](model))
    assert cache.static and cache.summary().static
    torch.testing.assert_close(generate(model, cache, ids, mask), expected, atol=0, rtol=0)
    _same_kept(cache, reference)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["default", "calibrated", "recency"])
def test_compiled_static_cache_keeps_what_the_growing_cache_keeps(name: str, fresh_dynamo) -> None:
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6, 3))
    reference = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False, **OPTIONS[name](model))
    expected = generate(model, reference, ids, mask)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, **OPTIONS[name](model))
    torch.testing.assert_close(generate(model, cache, ids, mask, compile_config=compiled()), expected, atol=0, rtol=0)
    _same_kept(cache, reference)
    assert fresh_dynamo["stats"]["unique_graphs"] == 1 and dict(fresh_dynamo["graph_break"]) == {}


@pytest.mark.parametrize("compile_config", [None, pytest.param(compiled(), marks=pytest.mark.compile)],
                         ids=["eager", "compiled"])
def test_nothing_evicted_equals_dynamic_cache(compile_config, fresh_dynamo) -> None:
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size)
    expected = generate(model, DynamicCache(config=model.config), ids, mask)
    cache = RopeKVCache(model, budget=200, static=True)
    torch.testing.assert_close(generate(model, cache, ids, mask, compile_config=compile_config), expected, atol=0,
                               rtol=0)
    assert not cache.evicted and cache.num_compactions == 0


def fixed_arena_bytes(model, batch: int, slots: int) -> int:
    """Keys and values of ``slots`` slots in every layer, with int64 slot positions (float32)."""
    config = model.config
    per_layer = 2 * batch * config.num_key_value_heads * slots * config.head_dim * 4
    return config.num_hidden_layers * (per_layer + batch * config.num_key_value_heads * slots * 8)


@pytest.mark.parametrize("prefill", ["one piece", "chunked", "a chunk longer than the arena"])
def test_unpinned_prompt_longer_than_the_arena(prefill: str) -> None:
    """A prompt of 3x the arena, not pinned: in one forward it spills into a temporary arena that the first
    compaction folds back; chunked, it never leaves the fixed arena. Same tokens as the growing cache, and the
    cache ends holding its fixed arena again."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(200, 157))
    options = dict(budget=BUDGET, compress_every=EVERY, protect_prompt=False)
    chunk = {"chunked": {"prefill_chunk_size": 8}, "a chunk longer than the arena": {"prefill_chunk_size": 90}}
    chunk = chunk.get(prefill, {})
    expected = generate(model, RopeKVCache(model, **options), ids, mask, **chunk)
    cache = RopeKVCache(model, **options, static=True)
    torch.testing.assert_close(generate(model, cache, ids, mask, **chunk), expected, atol=0, rtol=0)
    assert cache.bytes_held <= fixed_arena_bytes(model, 2, PAGE_SIZE) < fixed_arena_bytes(model, 2, 200)


def test_a_compaction_right_after_the_prompt_keeps_what_the_growing_cache_keeps() -> None:
    """The default scorer's prompt window (the last queries of the forward just finished) reads the same positions
    in a static cache as in a growing one: an unpinned, left-padded prompt over the budget compacts right after it."""
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(24, 17))
    options = dict(budget=BUDGET, compress_every=EVERY, protect_prompt=False)
    reference = RopeKVCache(model, **options)
    expected = generate(model, reference, ids, mask, new=24)
    cache = RopeKVCache(model, **options, static=True)
    torch.testing.assert_close(generate(model, cache, ids, mask, new=24), expected, atol=0, rtol=0)
    _same_kept(cache, reference)


def _forward_without_positions(model, cache, ids) -> torch.Tensor:
    """``model(input_ids=ids)`` with ``cache`` and nothing else: the model derives positions from the cache."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **cache_kw(model, cache)).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forwards_that_pass_no_positions_equal_dynamic_cache(arch: str) -> None:
    """A prompt, then tokens one at a time, each a bare ``model(input_ids=...)`` call: the model takes the new
    tokens' positions from ``get_seq_length()``, which must count the tokens before the forward, not with them
    (once it counted them, every token was rotated one position too far, the prompt by its own length)."""
    model = tiny_model(arch)
    ids = torch.randint(3, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    caches = {"dynamic": DynamicCache(config=model.config), "static": RopeKVCache(model, budget=200, static=True)}
    logits = {name: [_forward_without_positions(model, cache, ids[:, :20])] for name, cache in caches.items()}
    for step in range(20, 30):
        for name, cache in caches.items():
            logits[name].append(_forward_without_positions(model, cache, ids[:, step:step + 1]))
    for expected, got in zip(logits["dynamic"], logits["static"]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert caches["static"].get_seq_length() == 30 and not caches["static"].evicted


def _question_after_document(model, ids, static) -> tuple[torch.Tensor, RopeKVCache]:
    """A later turn: all but the last 10 tokens of ``ids`` (a document) go in by bare forwards, its last token alone,
    so the cache compacts; then generate() gets the whole sequence and feeds the question the cache has not seen.
    Returns 16 new tokens and the cache."""
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, protect_prompt=False, static=static)
    document = ids.shape[1] - 10
    _forward_without_positions(model, cache, ids[:, :document - 1])
    _forward_without_positions(model, cache, ids[:, document - 1:document])
    assert cache.evicted
    return generate(model, cache, ids, torch.ones_like(ids), new=16), cache


def test_a_question_after_a_compacted_document_matches_the_growing_cache() -> None:
    """A question after a document fed by bare forwards: the static cache keeps and generates what the growing
    cache does."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(4))
    static_tokens, static = _question_after_document(model, ids, True)
    growing_tokens, growing = _question_after_document(model, ids, False)
    torch.testing.assert_close(static_tokens, growing_tokens, atol=0, rtol=0)
    _same_kept(static, growing)


@pytest.mark.parametrize("prefill_chunk", [None, 8])
def test_arenas_exist_before_the_first_forward_and_stay(prefill_chunk: int | None) -> None:
    """Every arena is allocated before the first decoder layer runs (so a compiled or captured prefill never
    allocates one inside a CUDA graph, whose pool the next replay overwrites), and decoding keeps it."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(30, 21))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, protect_prompt=False, static=True)
    held: list[int] = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *a: held.append(cache.bytes_held))
    try:
        chunk = {} if prefill_chunk is None else {"prefill_chunk_size": prefill_chunk}
        generate(model, cache, ids, mask, new=6, **chunk)
    finally:
        handle.remove()
    assert held[0] > 0 and cache.bytes_held > 0
    steps = held[-5:]  # the decoding steps hold the fixed arena, unchanged
    assert len(set(steps)) == 1 and steps[0] <= fixed_arena_bytes(model, 2, PAGE_SIZE)


@pytest.mark.compile
def test_statistics_are_never_allocated_inside_a_compiled_forward(monkeypatch, fresh_dynamo) -> None:
    """generate compiles a chunked prefill chunk by chunk. A running sum of the query statistics created inside a
    compiled call would, under CUDA graphs, live in the graph's pool and be overwritten by the next replay (H200,
    ea25e5a: "accessing tensor output of CUDAGraphs that has been overwritten"). The sums must be created and grown
    where nothing is compiled. (Private: the online statistics' ``_place`` is where the sums are made.)"""
    from hf_ropekv.statistics.online import OnlineStatistics

    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(30, 21))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, protect_prompt=False,
                                           static=True), ids, mask, new=8, prefill_chunk_size=8)
    places: list[bool] = []
    place = OnlineStatistics._place

    def recording_place(self, layers, like):
        places.append(torch.compiler.is_compiling())
        return place(self, layers, like)

    monkeypatch.setattr(OnlineStatistics, "_place", recording_place)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, protect_prompt=False, static=True)
    got = generate(model, cache, ids, mask, new=8, prefill_chunk_size=8, compile_config=compiled())
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert places and not any(places)


@pytest.mark.compile
@pytest.mark.parametrize("lengths", [(9,), (9, 5)])
def test_compiled_step_is_compiled_once(lengths: tuple[int, ...], fresh_dynamo) -> None:
    """No recompilation for a new step, a compaction, or a new cache of the same batch size and budget (a new
    generate() call). Batch 1 matters: there a slice of the growing attention mask keeps the mask's stride, which
    changes every step (a recompile with dynamic strides on the H200 made CUDA graphs record again at every step)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY), ids, mask)
    torch._dynamo.config.error_on_recompile = True
    graphs = []
    for _ in range(3):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        torch.testing.assert_close(generate(model, cache, ids, mask, compile_config=compiled()), expected, atol=0,
                                   rtol=0)
        assert cache.num_compactions >= 8
        del cache
        gc.collect()
        graphs.append(fresh_dynamo["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1]  # what the first generate() compiled serves the later ones


FORWARD_COMPILED = "model.forward = torch.compile(model.forward)"


@pytest.mark.compile
@pytest.mark.parametrize(("arch", "pattern", "steps", "compactions", "positions"), [
    ("llama", FORWARD_COMPILED, 30, 5, True),
    ("llama", FORWARD_COMPILED, 30, 5, False),  # position_ids left to the model: from get_seq_length()
    ("llama", "torch.compile(model)", 30, 5, True),
    ("qwen2_sliding", FORWARD_COMPILED, 24, 4, True),  # a hybrid model: its sliding-window layers are static too
    ("qwen2_sliding", FORWARD_COMPILED, 24, 4, False),
])
def test_compiled_forward_in_a_hand_written_loop(arch: str, pattern: str, steps: int, compactions: int,
                                                 positions: bool, fresh_dynamo) -> None:
    """transformers' documented pattern, model.forward = torch.compile(model.forward), and the whole module
    compiled, called step by step, with position_ids or without: the model's hooks prepare each forward eagerly in
    both; at most the prompt's graph and the decode step's, the growing cache's tokens."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))

    def loop(cache, forward) -> torch.Tensor:
        return hand_written_loop(model, cache, forward, ids, mask, steps=steps, positions=positions)

    with torch.no_grad():
        expected = loop(RopeKVCache(model, budget=BUDGET, compress_every=EVERY), model)
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        eager_forward = model.forward
        if pattern == "torch.compile(model)":
            forward = torch.compile(model, backend="eager", fullgraph=True)
        else:
            forward = model
            model.forward = torch.compile(eager_forward, backend="eager", fullgraph=True)
        try:
            torch.testing.assert_close(loop(cache, forward), expected, atol=0, rtol=0)
        finally:
            model.forward = eager_forward
    assert cache.num_compactions >= compactions
    assert fresh_dynamo["stats"]["unique_graphs"] <= 2  # the prompt's shape and the decode step's


@pytest.mark.filterwarnings("ignore:hf_ropekv.enable. budget=16 is small")
def test_enable_static_and_the_wrappers_go_with_the_caches() -> None:
    """enable(static=True) generates the growing cache's tokens; the generate methods a static cache wraps
    (prepare_inputs_for_generation, get_compiled_call, ...) go when its cache goes, enable's own with disable()."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY), ids, mask)
    before = set(model.__dict__)
    enable(model, budget=BUDGET, compress_every=EVERY, static=True)
    enabled_wrappers = set(model.__dict__) - before
    assert enabled_wrappers  # enable's own (generate, the cache preparation)
    out = generate(model, None, ids, mask)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert set(model.__dict__) == before | enabled_wrappers  # the call's cache is gone: so are its wrappers
    disable(model)
    assert set(model.__dict__) == before and leftovers(model) == []


@pytest.mark.compile
def test_compiled_generate_runs_multi_token_forwards_eagerly(fresh_dynamo) -> None:
    """generate sends each chunk of a chunked prefill through its compiled forward. With a static cache only
    the decode step is compiled: one graph, whatever the chunk size or the prompt's length, and no recompile
    for a later call of the same batch size (on an H200 the chunks' graphs took 80 of a 133 s warm-up)."""
    model = tiny_model("llama")
    options = dict(budget=BUDGET, compress_every=EVERY, protect_prompt=False)
    runs = [((60, 41), 8), ((45, 30), 16), ((9, 5), 4)]
    expected = [generate(model, RopeKVCache(model, **options, static=True), *padded_batch(128, lengths), new=12,
                         prefill_chunk_size=chunk) for lengths, chunk in runs]
    torch._dynamo.reset()
    fresh_dynamo.clear()
    compactions = []
    for i, ((lengths, chunk), tokens) in enumerate(zip(runs, expected)):
        cache = RopeKVCache(model, **options, static=True)
        torch._dynamo.config.error_on_recompile = i > 0
        try:
            got = generate(model, cache, *padded_batch(128, lengths), new=12, prefill_chunk_size=chunk,
                           compile_config=compiled())
        finally:
            torch._dynamo.config.error_on_recompile = False
        torch.testing.assert_close(got, tokens, atol=0, rtol=0)
        assert fresh_dynamo["stats"]["unique_graphs"] == 1  # the decode step
        compactions.append(cache.num_compactions)
    assert compactions[0] >= 5  # the first prompt spilled out of the arena chunk after chunk


def test_compileable_and_the_arena_bound() -> None:
    """A static cache is compileable (transformers asks before compiling); its arena holds budget + compress_every
    slots in whole pages (sized for the generate() call when that is shorter), a growing cache's is not."""
    model = tiny_model("llama")
    assert RopeKVCache(model, budget=100, compress_every=28, static=True).is_compileable
    assert not RopeKVCache(model, budget=100, compress_every=28, static=False).is_compileable
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    cache = RopeKVCache(model, budget=100, compress_every=28, static=True)
    generate(model, cache, ids, mask, new=300)
    assert cache.num_compactions >= 2
    assert fixed_arena_bytes(model, 2, 100) < cache.bytes_held <= fixed_arena_bytes(model, 2, 2 * PAGE_SIZE)


@pytest.mark.compile
@pytest.mark.parametrize("other_arch", ["qwen3", "llama"])
def test_a_static_cache_is_bound_to_its_model(other_arch: str, fresh_dynamo) -> None:
    """Like a growing cache, a static one refuses another model's forward, naming both classes, before it stores
    anything: a fresh cache in another model's generate(), and a cache whose compiled decode steps ran on its
    own model (no eager check consumed their announce) continued by another model's eager forward."""
    model, other = tiny_model("llama"), tiny_model(other_arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    fresh = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    with pytest.raises(ValueError, match=f"built for a LlamaForCausalLM.*{type(other).__name__} runs a forward"):
        generate(other, fresh, ids, mask, new=4)
    assert fresh.tokens_seen == 0
    used = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    generate(model, used, ids, mask, new=12, compile_config=compiled())
    assert fresh_dynamo["stats"]["unique_graphs"] == 1 and used.num_compactions > 0  # the steps ran compiled
    seen, kept = used.tokens_seen, [used.kept_positions(i) for i in range(len(used.layers))]
    grown = torch.cat([mask, torch.ones(2, seen + 1 - mask.shape[1], dtype=mask.dtype)], dim=1)
    step = dict(input_ids=ids[:, :1], attention_mask=grown, **cache_kw(other, used))
    with pytest.raises(ValueError, match="bound to it"), torch.no_grad():
        other(**step)
    assert used.tokens_seen == seen
    assert all(torch.equal(used.kept_positions(i), k) for i, k in enumerate(kept))
    with torch.no_grad():
        model(**step)  # its own model continues it


def test_beam_search_and_sampled_sequences() -> None:
    """Beam reordering and expanded rows happen in place; same tokens as the growing cache."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    for extra in ({"num_beams": 3}, {"do_sample": True, "num_return_sequences": 2}):
        outs = []
        for static in (False, True):
            torch.manual_seed(0)
            cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=static)
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0,
                                       **cache_kw(model, cache), **{"do_sample": False, **extra}))
            assert cache.num_compactions >= 5
        torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


def test_the_next_cache_takes_over_the_buffers_of_one_that_is_gone() -> None:
    """CUDA graphs replay at the addresses they recorded: a new static cache of the same model and shapes takes
    the buffers of a freed one (never those of a live one), zeroed: same tokens. Private by nature: the pool and the
    lease are how addresses are kept (``hf_ropekv.storage.buffers``)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))

    def run():
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        out = generate(model, cache, ids, mask, new=12)
        return cache, out, {t.data_ptr() for t in cache._lease.tensors()}

    first, out, addresses = run()
    alive, alive_out, alive_addresses = run()  # the first is still alive: its buffers are its own
    assert addresses and not addresses & alive_addresses
    del first, alive
    again, again_out, again_addresses = run()
    assert again_addresses in (addresses, alive_addresses)
    torch.testing.assert_close(again_out, out, atol=0, rtol=0)  # buffers are zeroed when taken over
    del again
    import hf_ropekv

    hf_ropekv.detach(model)  # frees what the model pooled; the next cache allocates anew and still works
    _, fresh_out, fresh_addresses = run()
    torch.testing.assert_close(fresh_out, out, atol=0, rtol=0)


def test_a_new_batch_size_lets_the_pooled_buffers_go() -> None:
    """The model's pool keeps the buffers of one configuration: after a static cache of another batch size, only
    buffers of the new size are pooled (the model never holds both). Private: the pool's free buffers."""
    from hf_ropekv.storage.buffers import BufferPool

    model = tiny_model("llama")
    pool = BufferPool.of(model)
    for lengths in ((9, 5, 7), (9,)):  # batch 3, then batch 1
        ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        generate(model, cache, ids, mask, new=6)
        batch_sized = [t for t in cache._lease.tensors() if t.dim() >= 3]
        del cache
        gc.collect()
        pooled = [t for t in pool.free.values() if t.dim() >= 3]
        assert len(pooled) == len(batch_sized) > 0
        assert {len(lengths)} == {t.shape[0] if t.dim() == 4 else t.shape[1] for t in pooled}


def test_temporary_arena_hides_no_garbage(monkeypatch) -> None:
    """A forward longer than the fixed arena spills into a temporary one that attention reads whole: its unused
    slots must be finite (a masked slot still multiplies its zero weight). Poisoned: torch.empty gives NaN."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(200, 157))
    options = dict(budget=BUDGET, compress_every=EVERY, protect_prompt=False)
    expected = generate(model, RopeKVCache(model, **options), ids, mask, new=20)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    out = generate(model, RopeKVCache(model, **options, static=True), ids, mask, new=20)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_a_static_cache_switches_the_model_to_grouped_sdpa_while_it_lives() -> None:
    """An sdpa grouped-query model attends with hf_ropekv's grouped sdpa (no copy of the key/value heads under the
    mask) while a static cache is about, again after the user set sdpa back; the tokens are those transformers'
    sdpa gives, and the model has sdpa back once the caches are gone. An eager model is left alone."""
    model = tiny_model("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids, mask = padded_batch(model.config.vocab_size, lengths=(14, 9))

    def run() -> torch.Tensor:
        cache = RopeKVCache(model, budget=12, compress_every=4, protect_prompt=False, static=True)
        assert model.config._attn_implementation not in ("sdpa", "eager")
        return generate(model, cache, ids, mask, new=24)

    grouped = run()
    assert model.config._attn_implementation == "sdpa"  # the cache went: sdpa is back
    cache = RopeKVCache(model, budget=12, compress_every=4, protect_prompt=False, static=True)
    model.config._attn_implementation = "sdpa"  # the user opts out for this cache's whole generation
    stock = generate(model, cache, ids, mask, new=24)
    assert torch.equal(grouped, stock)
    del cache
    assert model.config._attn_implementation == "sdpa" and leftovers(model) == []
    growing = RopeKVCache(model, budget=12, static=False)  # a growing cache too (its attention needs no static one)
    assert model.config._attn_implementation not in ("sdpa", "eager")
    del growing
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model("llama", attn_implementation="eager")
    kept = RopeKVCache(eager, budget=12, static=True)
    assert eager.config._attn_implementation == "eager" and kept.static


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_the_default_cache_on_one_gpu_replays_graphs_of_the_eager_static_step(arch: str, deterministic_sdpa) -> None:
    """static="auto" on one CUDA device is static and replays its decode steps as CUDA graphs of the eager step:
    the tokens equal the eager static cache's exactly, across compactions, with padding and (Gemma 2) sliding
    windows; two recordings per cache (the steps before the first eviction attend with sdpa, those after it with the
    decode kernel); a second generate() continuing the same cache still gives the eager tokens.
    (Private: the graphed executor's recording count, ``get_compiled_call.graphed``.)"""
    model = tiny_model(arch).cuda()
    ids, mask = (t.cuda() for t in padded_batch(model.config.vocab_size, lengths=(11, 6, 3)))
    reference = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    expected = generate(model, reference, ids, mask, new=40, disable_compile=True)
    for round_ in range(2):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
        assert cache.static
        torch.testing.assert_close(generate(model, cache, ids, mask, new=40), expected, atol=0, rtol=0)
        graphed = vars(model)["get_compiled_call"].graphed
        assert graphed.graphs_of(cache) == 2 and graphed.recordings == 2 * (round_ + 1)
        assert cache.num_compactions >= 8
    more = torch.cat([ids, expected], dim=1)
    more_mask = torch.cat([mask, torch.ones_like(expected)], dim=1)
    expected_more = generate(model, reference, more, more_mask, new=10, disable_compile=True)
    torch.testing.assert_close(generate(model, cache, more, more_mask, new=10), expected_more, atol=0, rtol=0)


@pytest.mark.gpu
def test_the_default_cache_on_one_gpu_takes_bare_forwards_and_a_later_question(deterministic_sdpa) -> None:
    """On one CUDA device the default cache is static: bare ``model(...)`` forwards equal ``DynamicCache``'s with
    nothing evicted, and a question generated after a document fed by bare forwards (compacted) gives the growing
    cache's tokens."""
    model = tiny_model("qwen3").cuda()
    ids = torch.randint(3, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(4)).cuda()
    dynamic, cache = DynamicCache(config=model.config), RopeKVCache(model, budget=200)
    assert cache.static
    for part in (ids[:, :60], ids[:, 60:61], ids[:, 61:62]):
        torch.testing.assert_close(_forward_without_positions(model, cache, part),
                                   _forward_without_positions(model, dynamic, part), atol=1e-4, rtol=1e-4)
    graphed, _ = _question_after_document(model, ids, "auto")
    growing, _ = _question_after_document(model, ids, False)
    torch.testing.assert_close(graphed, growing, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.compile
def test_where_graphs_cannot_hold_the_model_generate_compiles_the_step(monkeypatch, fresh_dynamo,
                                                                      deterministic_sdpa) -> None:
    """A static cache whose model a graph cannot hold (several devices or ranks; simulated by the attachment's
    capturability check, private) decodes with generate's own compilation (inductor, CUDA graph trees): no CUDA
    graph skipped (every tensor the step mutates is a static address), no recompile for a second cache, the same
    tokens twice, and the eager static cache's tokens except where the eager run's top-2 logits are a float32
    near-tie (inductor's fused kernels round differently)."""
    from hf_ropekv.adapter import attach

    monkeypatch.setattr(attach, "not_capturable", lambda model, device: "simulated: the model spans 2 devices")
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in padded_batch(model.config.vocab_size, lengths=(11, 6, 3)))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
              do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    eager = model.generate(**cache_kw(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)),
                           disable_compile=True, **kw)
    outs, graphs = [], []
    for _ in range(2):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        outs.append(model.generate(**cache_kw(model, cache), compile_config=CompileConfig(fullgraph=True), **kw))
        graphs.append(fresh_dynamo["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] > 0
    assert fresh_dynamo["inductor"]["cudagraph_skips"] == 0
    assert cache.num_compactions >= 8
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    new = ids.shape[1]
    for row in range(ids.shape[0]):
        differ = (eager.sequences[row, new:] != outs[0].sequences[row, new:]).nonzero()
        if differ.numel():
            top2 = eager.scores[int(differ[0])][row].float().topk(2).values
            assert float(top2[0] - top2[1]) <= 1e-3, f"row {row}: compiled parted from eager at a clear margin"
