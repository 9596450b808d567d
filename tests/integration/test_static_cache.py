"""RopeKVCache(static=True): a fixed arena, every decision before the forward, compileable (issue 12).

The reference is the growing cache (``static=False``): with the same options the static cache must keep the
same tokens and so generate the same tokens, eager and compiled, across many compactions; with nothing evicted
both equal ``DynamicCache``. Compilation is checked with dynamo's ``eager`` backend on the CPU, ``fullgraph=True``
(a graph break is an error): what matters here is that the decode step traces as one graph that reads no host
counter, so it is never recompiled for a new step, compaction or cache.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache

from conftest import padded_batch, tiny_model
from hf_ropekv._compat import cache_kwarg
from hf_ropekv import KeyNormScorer, RandomScorer, RecencyScorer, RopeKVCache, SnapKVScorer, calibrate, disable, enable

NEW_TOKENS = 48
BUDGET, EVERY = 16, 4


def generate(model, cache, ids, mask, new=NEW_TOKENS, **kwargs) -> torch.Tensor:
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **{cache_kwarg(model): cache},
        do_sample=False, pad_token_id=0, **kwargs,
    )
    return out[:, ids.shape[1] :]


def hand_written_loop(model, cache, forward, ids, mask, steps: int) -> torch.Tensor:
    """Greedy tokens from calling ``forward`` step by step with ``cache`` (a left-padded prompt, then one token per
    call), as a user's own decoding loop does."""
    attention = mask.clone()
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    kw = {cache_kwarg(model): cache}
    logits = forward(input_ids=ids, attention_mask=attention, position_ids=positions, **kw).logits
    tokens = []
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        attention = torch.cat([attention, torch.ones_like(token)], dim=1)
        positions = positions[:, -1:] + 1
        logits = forward(input_ids=token, attention_mask=attention, position_ids=positions, **kw).logits
    return torch.cat(tokens, dim=1)


def compiled(backend: str = "eager") -> CompileConfig:
    """generate's own compilation, on the CPU too (it compiles only on accelerators by default)."""
    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True
    return config


def _calibrated(model):
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5))
    stats = calibrate(model, None, ids, progress=False)
    return {"stats": stats}


OPTIONS = {
    "default": lambda model: {},
    "global": lambda model: {"selection": "global", "window": 2},
    "half-life-8": lambda model: {"stats_half_life": 8},
    "calibrated": _calibrated,
    "recency": lambda model: {"scorer": RecencyScorer(), "sink": 2},
    "keynorm": lambda model: {"scorer": KeyNormScorer()},
    "random": lambda model: {"scorer": RandomScorer(seed=1), "window": 3},
}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_static_cache_keeps_what_the_growing_cache_keeps(name: str) -> None:
    """Same tokens as static=False in a left-padded batch with many compactions: eager, then compiled."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6, 3))
    options = OPTIONS[name](model)
    reference = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, **options)
    expected = generate(model, reference, ids, mask)
    assert reference.num_compactions >= 8

    eager = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, **options)
    torch.testing.assert_close(generate(model, eager, ids, mask), expected, atol=0, rtol=0)
    assert eager.num_compactions == reference.num_compactions
    assert eager.tokens_kept_per_row == reference.tokens_kept_per_row
    # Every layer kept the same tokens: the static cache ranks its layers together, the growing one layer by layer.
    for mine, theirs in zip(eager._full_layers, reference._full_layers):
        assert torch.equal(mine.storage.live_positions(), theirs.storage.live_positions())

    options = OPTIONS[name](model)  # fresh scorer state
    traced = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, **options)
    torch.testing.assert_close(generate(model, traced, ids, mask, compile_config=compiled()), expected, atol=0, rtol=0)
    assert dict(counters["graph_break"]) == {}


def test_nothing_evicted_equals_dynamic_cache() -> None:
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size)
    expected = generate(model, DynamicCache(config=model.config), ids, mask)
    for config in (None, compiled()):
        cache = RopeKVCache(model, budget=200, static=True)
        torch.testing.assert_close(generate(model, cache, ids, mask, compile_config=config), expected, atol=0, rtol=0)
        assert not cache.evicted


@pytest.mark.parametrize("prefill", ["one piece", "chunked", "a chunk longer than the arena"])
def test_unpinned_prompt_longer_than_the_arena(prefill: str) -> None:
    """A prompt of 3x the arena, not pinned: in one forward it spills into a temporary arena that the first
    compaction folds back; chunked, it never leaves the fixed arena. Same tokens as the growing cache."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(200, 157))
    options = dict(budget=BUDGET, compress_every=EVERY, protect_prompt=False)
    chunk = {"chunked": {"prefill_chunk_size": 8}, "a chunk longer than the arena": {"prefill_chunk_size": 90}}
    chunk = chunk.get(prefill, {})
    expected = generate(model, RopeKVCache(model, **options), ids, mask, **chunk)
    cache = RopeKVCache(model, **options, static=True)
    torch.testing.assert_close(generate(model, cache, ids, mask, **chunk), expected, atol=0, rtol=0)
    arena = cache._full_layers[0].storage
    assert arena.keys is arena._arena[0] and arena.capacity == arena.static_capacity  # back in the fixed arena


@pytest.mark.parametrize("prefill_chunk", [None, 8])
def test_arenas_exist_before_the_first_forward(prefill_chunk: int | None) -> None:
    """The cache allocates every arena before the first forward runs (so a compiled prefill never allocates
    one inside a CUDA graph, whose pool the next replay overwrites), at the address decoding then uses."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(30, 21))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, protect_prompt=False, static=True)
    seen = []

    def check(module, args, kwargs):
        storages = [layer.storage for layer in cache._full_layers]
        seen.append(all(s.keys is not None and s.write_index is not None for s in storages))

    first_layer = model.model.layers[0]
    handle = first_layer.register_forward_pre_hook(check, with_kwargs=True)
    try:
        chunk = {} if prefill_chunk is None else {"prefill_chunk_size": prefill_chunk}
        generate(model, cache, ids, mask, new=6, **chunk)
    finally:
        handle.remove()
    assert seen and all(seen)
    arena = cache._full_layers[0].storage
    assert arena.keys is arena._arena[0]
    assert arena.keys.dtype == model.dtype and arena.keys.shape[:2] == (2, model.config.num_key_value_heads)


def test_statistics_are_never_allocated_inside_a_compiled_forward(monkeypatch) -> None:
    """generate compiles a chunked prefill chunk by chunk. A running sum of the query statistics created inside a
    compiled call would, under CUDA graphs, live in the graph's pool and be overwritten by the next replay (H200,
    ea25e5a: "accessing tensor output of CUDAGraphs that has been overwritten"). The sums must be created and
    grown where nothing is compiled, so a forward's queries are folded in after it, eagerly."""
    from hf_ropekv.statistics.online import OnlineStatistics

    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(30, 21))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, protect_prompt=False,
                                           static=True), ids, mask, new=8, prefill_chunk_size=8)
    places: list[bool] = []
    place = OnlineStatistics._place

    def recording_place(self, layer_idx, like):
        places.append(torch.compiler.is_compiling())
        return place(self, layer_idx, like)

    monkeypatch.setattr(OnlineStatistics, "_place", recording_place)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, protect_prompt=False, static=True)
    got = generate(model, cache, ids, mask, new=8, prefill_chunk_size=8, compile_config=compiled())
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert places and not any(places)


@pytest.mark.parametrize("lengths", [(9,), (9, 5)])
def test_compiled_step_is_compiled_once(lengths: tuple[int, ...]) -> None:
    """No recompilation for a new step, a compaction, or a new cache of the same batch size and budget (a new
    generate() call); the arena keeps its address from step to step. Batch 1 matters: there a slice of the
    growing attention mask keeps the mask's stride, which changes every step (a recompile with dynamic strides
    on the H200 made CUDA graphs record again at every step)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
    torch._dynamo.config.error_on_recompile = True
    graphs = []
    try:
        for _ in range(3):
            cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
            generate(model, cache, ids, mask, compile_config=compiled())
            assert cache.num_compactions >= 8
            keys = cache._full_layers[0].storage.keys
            assert keys is cache._full_layers[0].storage._arena[0]
            del cache
            gc.collect()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert graphs[0] == graphs[-1]  # what the first generate() compiled serves the later ones


@pytest.mark.parametrize("pattern", ["model.forward = torch.compile(model.forward)", "torch.compile(model)"])
def test_compiled_forward_in_a_hand_written_loop(pattern: str) -> None:
    """transformers' documented pattern, model.forward = torch.compile(model.forward), and the whole module
    compiled, called step by step: the model's hooks prepare each forward eagerly in both."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))

    def loop(cache, forward) -> torch.Tensor:
        return hand_written_loop(model, cache, forward, ids, mask, steps=30)

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
    assert cache.num_compactions >= 5
    assert counters["stats"]["unique_graphs"] <= 2  # the prompt's shape and the decode step's


def test_enable_static() -> None:
    """enable(static=True) generates the growing cache's tokens; disable() takes away every method hf_ropekv
    wrapped on the model (generate's prepare_inputs_for_generation and get_compiled_call among them)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY), ids, mask)
    before = set(model.__dict__)
    enable(model, budget=BUDGET, compress_every=EVERY, static=True)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0)
    torch.testing.assert_close(out[:, ids.shape[1] :], expected, atol=0, rtol=0)
    assert {"get_compiled_call", "prepare_inputs_for_generation"} <= set(model.__dict__)
    disable(model)
    assert set(model.__dict__) == before


def test_compiled_generate_runs_multi_token_forwards_eagerly() -> None:
    """generate sends each chunk of a chunked prefill through its compiled forward. With a static cache only
    the decode step is compiled: one graph, whatever the chunk size or the prompt's length, and no recompile
    for a later call of the same batch size (on an H200 the chunks' graphs took 80 of a 133 s warm-up)."""
    model = tiny_model("llama")
    options = dict(budget=BUDGET, compress_every=EVERY, protect_prompt=False)
    runs = [((60, 41), 8), ((45, 30), 16), ((9, 5), 4)]
    expected = [generate(model, RopeKVCache(model, **options, static=True), *padded_batch(128, lengths), new=12,
                         prefill_chunk_size=chunk) for lengths, chunk in runs]
    torch._dynamo.reset()
    counters.clear()
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
        assert counters["stats"]["unique_graphs"] == 1  # the decode step
        compactions.append(cache.num_compactions)
    assert compactions[0] >= 5  # the first prompt spilled out of the arena chunk after chunk


def test_compileable_and_the_arena_size() -> None:
    model = tiny_model("llama")
    assert RopeKVCache(model, budget=100, compress_every=28, page_size=64, static=True).is_compileable
    assert not RopeKVCache(model, budget=100, compress_every=28).is_compileable
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    cache = RopeKVCache(model, budget=100, compress_every=28, page_size=64, static=True)
    generate(model, cache, ids, mask, new=4)
    keys = cache._full_layers[0].storage.keys
    assert keys.shape[2] == 128  # budget + compress_every, whole pages
    per_token = 2 * keys.shape[0] * keys.shape[1] * keys.shape[3] * keys.element_size() * len(cache._full_layers)
    assert cache.bytes_held <= 1.1 * 128 * per_token * (1 + 8 / (2 * keys.shape[3] * keys.element_size()))


def test_clear_refusals() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="static=True needs a budget"):
        RopeKVCache(model, static=True)
    with pytest.raises(ValueError, match="needs the model, not its config"):
        RopeKVCache(model.config, budget=16, stats=None, scorer=RecencyScorer(), static=True)
    with pytest.raises(ValueError, match="static=False"):
        RopeKVCache(model, budget=16, scorer=SnapKVScorer(window=4), static=True)


@pytest.mark.parametrize("other_arch", ["qwen3", "llama"])
def test_a_static_cache_is_bound_to_its_model(other_arch: str) -> None:
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
    assert counters["stats"]["unique_graphs"] == 1 and used.num_compactions > 0  # the steps ran compiled
    seen, keys = used.tokens_seen, used._full_layers[0].storage.keys.clone()
    grown = torch.cat([mask, torch.ones(2, seen + 1 - mask.shape[1], dtype=mask.dtype)], dim=1)
    step = dict(input_ids=ids[:, :1], attention_mask=grown, **{cache_kwarg(other): used})
    with pytest.raises(ValueError, match="bound to it"), torch.no_grad():
        other(**step)
    assert used.tokens_seen == seen and torch.equal(used._full_layers[0].storage.keys, keys)
    with torch.no_grad():
        model(**step)  # its own model continues it


@pytest.mark.gpu
def test_cuda_graphs_replay_the_decode_step() -> None:
    """On CUDA, generate's own compilation (inductor, CUDA graphs): the eager static cache's tokens, CUDA graphs
    not skipped (every tensor the step mutates is a static address), no recompile for a second cache."""
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in padded_batch(model.config.vocab_size, lengths=(11, 6, 3)))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True), ids, mask,
                        disable_compile=True)
    graphs = []
    for _ in range(2):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        torch.testing.assert_close(generate(model, cache, ids, mask, compile_config=CompileConfig(fullgraph=True)),
                                   expected, atol=0, rtol=0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] > 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert cache.num_compactions >= 8


@pytest.mark.gpu
def test_cuda_graphs_compiled_chunked_prefill() -> None:
    """generate's compilation with a chunked prefill: the chunks run eagerly (see
    test_compiled_generate_runs_multi_token_forwards_eagerly), the decode steps replay CUDA graphs; no arena
    may live in a CUDA graph's pool, where the next replay would overwrite it. Same tokens as the eager static
    cache."""
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in padded_batch(model.config.vocab_size, lengths=(11, 6, 3)))
    chunked = dict(prefill_chunk_size=4)
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True), ids, mask,
                        disable_compile=True, **chunked)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    torch.testing.assert_close(generate(model, cache, ids, mask, compile_config=CompileConfig(fullgraph=True),
                                        **chunked), expected, atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] == 1 and counters["inductor"]["cudagraph_skips"] == 0


def test_beam_search_and_sampled_sequences() -> None:
    """Beam reordering happens in place (the arena keeps its address); same tokens as the growing cache."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    for extra in ({"num_beams": 3}, {"do_sample": True, "num_return_sequences": 2}):
        outs = []
        for static in (False, True):
            torch.manual_seed(0)
            cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=static)
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, pad_token_id=0,
                                       **{cache_kwarg(model): cache}, **{"do_sample": False, **extra}))
            assert cache.num_compactions >= 5
        torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


def test_next_cache_takes_over_the_buffers_of_one_that_is_gone() -> None:
    """CUDA graphs replay at the addresses they recorded: a new static cache of the same model and shapes takes
    the arenas, clock and statistics buffers of a freed one (never those of a live one)."""
    from hf_ropekv import release_static_buffers

    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))

    def run():
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        out = generate(model, cache, ids, mask, new=12)
        addresses = (cache._full_layers[1].storage.keys.data_ptr(), next(iter(cache._online._sums.values())).data_ptr(),
                     cache._static_driver.clock_on_first_device()[0].data_ptr())
        return cache, out, addresses

    first, out, addresses = run()
    alive, alive_out, alive_addresses = run()  # the first is still alive: its buffers are its own
    assert not set(addresses) & set(alive_addresses)
    del first, alive
    _, again, again_addresses = run()
    assert again_addresses in (addresses, alive_addresses)
    torch.testing.assert_close(again, out, atol=0, rtol=0)  # buffers are zeroed when taken over
    release_static_buffers(model)  # frees what the model kept; the next cache allocates anew and still works
    torch.testing.assert_close(run()[1], out, atol=0, rtol=0)


def test_a_new_batch_size_lets_the_pooled_buffers_go() -> None:
    """The model's pool keeps the buffers of one configuration: a static cache of another batch size lets the
    pooled ones go (they could not serve it) instead of holding both sets; its own replace them when it goes."""
    from hf_ropekv.storage.buffers import BufferPool

    def rows(purpose, tensor: torch.Tensor) -> int:  # the batch dimension: sums [L, B, 3, H, F]; arenas, counts
        return tensor.shape[1] if purpose[0] == "online_sums" else tensor.shape[0]

    model = tiny_model("llama")
    pool = BufferPool.of(model)
    for lengths in ((9, 5, 7), (9,)):  # batch 3, then batch 1
        ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
        generate(model, cache, ids, mask, new=6)
        assert not pool.free  # every pooled buffer was taken over or let go
        del cache
        gc.collect()
        pooled = {purpose: t for purpose, t in pool.free.items() if purpose[0] != "clock"}
        assert len(pooled) == 2 * model.config.num_hidden_layers + 2  # keys and values per layer, sums, counts
        assert {rows(*item) for item in pooled.items()} == {len(lengths)}  # batch 1's only, after batch 3's


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


def test_a_step_captured_into_a_cuda_graph_reads_the_clock_like_a_compiled_one(monkeypatch) -> None:
    """A decode step recorded as a CUDA graph of the eager forward (``benchmarks/graphed_step_probe.py``) replays
    whatever host values its recording read: it must get the step clock's device scalars, as a compiled step
    does, and skip the eager announce check (its eager run consumed the announce). The capture is simulated
    here (CPU): ``step_is_recorded`` is what every such branch of the library asks."""
    from hf_ropekv.storage import buffers

    model = tiny_model("qwen3")
    cache = RopeKVCache(model, budget=16, compress_every=4, static=True, protect_prompt=False)
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    generate(model, cache, ids, torch.ones_like(ids), new=6, disable_compile=True)
    seen = cache.get_seq_length()
    assert not buffers.step_is_recorded() and isinstance(seen, int) and isinstance(cache.get_query_offset(), int)
    assert torch.compile(buffers.step_is_recorded, backend="eager", fullgraph=True)() is True

    monkeypatch.setattr(buffers, "_CUDA_BUILT", True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert buffers.step_is_recorded()
    first_slot, seen_before = cache._static_driver.clock_on_first_device()
    assert cache.get_seq_length() is seen_before and cache.get_query_offset() is first_slot
    # The capture's run of the forward comes after the eager run consumed the announce: not refused as another
    # model's forward (what the check says of an unannounced forward while a model runs).
    from hf_ropekv.cache import forward as coordination

    monkeypatch.setattr(coordination, "_running_model_class", lambda: type(model))
    cache.coordinator.announced = False
    layer = cache.coordinator.full_layers[0]
    k = torch.randn(1, model.config.num_key_value_heads, 1, model.config.head_dim)
    layer.update(k, torch.randn_like(k))
