"""The capture's fast path of eager decoding steps (``QueryCapture.begin_forward``): same queries, fewer host steps.

The first decoding step of a growing cache takes the checked frame path and learns which rotary call gives which
layer's query; later steps only record the calls and hand the queries over after the forward. The reference is the
frame path itself (the fast path switched off): the online statistics must be bit-identical, and so must the
tokens, on every family with a different rotary calling convention (paired, one tensor per call, partial rotary,
``[B, S, H, D]`` queries).
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_model_families import NAMES, family_model
from conftest import head_shrunk, padded_batch
from transformers import DynamicCache

from hf_ropekv import RopeKVCache
from hf_ropekv.model import rotary
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.hooks.shared_hooks import SharedHooks
from hf_ropekv.model.capture import _Frame, _frame_of
from hf_ropekv.warnings import HfRopeKVWarning
from hf_ropekv.model.geometry import describe
from hf_ropekv.statistics.online import OnlineStatistics
from hf_ropekv.statistics.workload import WorkloadStatistics


class _CountSee:
    """Counts the frame path's deliveries (``_Frame.see``) while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = _Frame.see

        def see(frame, args, kwargs):
            self.calls += 1
            return original(frame, args, kwargs)

        monkeypatch.setattr(_Frame, "see", see)


def _run(model, fast: bool, new_tokens: int = 40):
    ids, mask = padded_batch(128, lengths=(12, 9, 6))
    cache = RopeKVCache(model, budget=20, compress_every=8)
    capture = SharedHooks.of(model).capture
    capture._plan_failed = not fast  # the frame path for every forward: the reference
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, **{cache_kwarg(model): cache})
    cache._online.flush()  # decoding steps not folded yet (OnlineStatistics.DEFER_STEPS) count now
    sums = {device: value.clone() for device, value in cache._online._sums.items()}
    counts = {device: value.clone() for device, value in cache._online._counts.items()}
    took_fast_path = capture._plan is not None
    return out, sums, counts, cache, took_fast_path


@pytest.mark.parametrize("name", NAMES)
def test_fast_path_gives_the_frame_paths_statistics_and_tokens(name: str, monkeypatch) -> None:
    model = family_model(name)
    monkeypatch.setattr(OnlineStatistics, "DEFER_STEPS", 1)  # every step folded at once: bit-identical arithmetic
    counter = _CountSee(monkeypatch)
    out_frames, sums_frames, counts_frames, cache, took = _run(model, fast=False)
    assert not took and cache.evicted
    frame_deliveries, counter.calls = counter.calls, 0
    del cache
    out_fast, sums_fast, counts_fast, cache, took = _run(model, fast=True)
    assert took, "the fast path was never taken"
    assert cache.num_compactions >= 2
    # Frames deliver in the prefill and the first decoding step only; the frame path in every step.
    assert 0 < counter.calls < frame_deliveries / 4
    assert torch.equal(out_fast, out_frames)
    assert sums_fast.keys() == sums_frames.keys()
    for device in sums_frames:
        assert torch.equal(sums_fast[device], sums_frames[device])
        assert torch.equal(counts_fast[device], counts_frames[device])


@pytest.mark.parametrize("name", ["qwen3", "gptj", "phi4_mini"])
def test_deferred_folds_match_step_by_step_folds_to_rounding(name: str, monkeypatch) -> None:
    """Sixteen decoding steps folded in one go: the statistics of folding each step on its own, to float64
    rounding, and the same tokens."""
    model = family_model(name)
    reference = _run(model, fast=True)
    monkeypatch.setattr(OnlineStatistics, "DEFER_STEPS", 1)
    exact = _run(model, fast=True)
    assert torch.equal(reference[0], exact[0])
    for device in exact[1]:
        torch.testing.assert_close(reference[1][device], exact[1][device], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(reference[2][device], exact[2][device], rtol=1e-12, atol=1e-12)


def _assert_means(snap, geometry, totals: list[torch.Tensor], weight: float) -> None:
    """Each layer's snapshot means are its hand-written decayed total ``[B, H, D]`` over ``weight`` queries."""
    pairs = geometry.rotary_dim // 2
    for layer_idx, total in enumerate(totals):
        mean = total / weight
        expected = torch.complex(mean[..., :pairs], mean[..., pairs : 2 * pairs]).to(torch.complex64)
        torch.testing.assert_close(snap.q_mean[layer_idx], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(snap.tokens, torch.full((totals[0].shape[0],), weight, dtype=torch.float64))


@pytest.mark.parametrize("half_life", [None, 5.0])
def test_flush_is_the_sequential_decayed_sum(half_life) -> None:
    """OnlineStatistics fed the same random decoding-step queries, deferred or folded one step at a time, against
    the decayed sums written out by hand."""
    model = family_model("llama")
    geometry = describe(model)
    layers = tuple(range(geometry.num_layers))
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randn(2, geometry.num_q_heads, 1, geometry.head_dim, generator=g) for _ in layers]
             for _ in range(21)]  # [B, H, 1, D]: a rotate-half model's layout (heads dim 1)
    prompt = [torch.randn(2, 5, geometry.num_q_heads, geometry.head_dim, generator=g) for _ in layers]
    stats = OnlineStatistics(geometry, half_life=half_life)
    stats.begin_forward(None, 5)
    for layer_idx, q in zip(layers, prompt):
        stats.add(layer_idx, q)
    stats.end_forward()
    for step in steps:
        stats.begin_forward(None, 1)
        stats.add_step(layers, step, heads_dim=1)
        stats.end_forward()
    # The first step places the layers' rows (folded at once); the next 16 fold together; 4 are still deferred.
    assert len(stats._deferred) == (21 - 1) % OnlineStatistics.DEFER_STEPS
    f = 1.0 if half_life is None else 0.5 ** (1 / half_life)
    totals = [prompt[i].double().sum(dim=1) * f ** 21  # [B, H, D]
              + sum(step[i][:, :, 0].double() * f ** (20 - j) for j, step in enumerate(steps)) for i in layers]
    _assert_means(stats.snapshot(), geometry, totals, 5 * f ** 21 + sum(f ** (20 - j) for j in range(21)))


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_a_static_step_folds_every_layer_at_once_into_the_decayed_sums(order: str) -> None:
    """A static cache's decoding step keeps its layers' queries and folds them in one go at the device's last
    layer (in order), or, when the layers come in another order, the ones left at the end of the forward, layer by
    layer: both give the decayed sums written out by hand."""
    model = family_model("llama")
    geometry = describe(model)
    layers = tuple(range(geometry.num_layers))
    g = torch.Generator().manual_seed(4)
    steps = [[torch.randn(2, 1, geometry.num_q_heads, geometry.head_dim, generator=g) for _ in layers]
             for _ in range(6)]  # [B, 1, H, D]
    prompt = [torch.randn(2, 5, geometry.num_q_heads, geometry.head_dim, generator=g) for _ in layers]
    stats = OnlineStatistics(geometry, half_life=3.0)
    stats.begin_forward(None, 5)
    for layer_idx, q in zip(layers, prompt):
        stats.add(layer_idx, q)
    stats.end_forward()
    stats.move_to_buffers(lambda purpose, shape, dtype, make: make())
    sums = next(iter(stats._sums.values()))
    for step in steps:
        stats.begin_forward(None, 1)
        sequence = list(zip(layers, step))
        for layer_idx, q in sequence if order == "in order" else sequence[::-1]:
            stats.add(layer_idx, q)
        if order == "in order":
            assert stats._static_step == []  # folded at the last layer, inside the forward
        stats.end_forward()
        assert stats._static_step == [] and next(iter(stats._sums.values())) is sums  # in place
    f = 0.5 ** (1 / 3.0)
    totals = [prompt[i].double().sum(dim=1) * f ** 6  # [B, H, D]
              + sum(step[i][:, 0].double() * f ** (5 - j) for j, step in enumerate(steps)) for i in layers]
    _assert_means(stats.snapshot(), geometry, totals, 5 * f ** 6 + sum(f ** (5 - j) for j in range(6)))


def _prompt_then_steps(stats: OnlineStatistics, geometry, static: bool):
    """Feed ``stats`` a prompt in two prefill chunks (3 and 2 tokens) and then six decoding steps, through the growing
    cache's deferred folds or the static step's fold; return the chunks and steps (per layer, batch 2)."""
    layers = tuple(range(geometry.num_layers))
    g = torch.Generator().manual_seed(5)
    chunks = [[torch.randn(2, n, geometry.num_q_heads, geometry.head_dim, generator=g) for _ in layers] for n in (3, 2)]
    steps = [[torch.randn(2, 1, geometry.num_q_heads, geometry.head_dim, generator=g) for _ in layers]
             for _ in range(6)]
    for chunk in chunks:
        stats.begin_forward(None, chunk[0].shape[1])
        for layer_idx, q in zip(layers, chunk):
            stats.add(layer_idx, q)
        stats.end_forward()
    if static:
        stats.move_to_buffers(lambda purpose, shape, dtype, make: make())
    for step in steps:
        stats.begin_forward(None, 1)
        if static:
            for layer_idx, q in zip(layers, step):
                stats.add(layer_idx, q)
        else:
            stats.add_step(layers, [q.transpose(1, 2) for q in step], heads_dim=1)
        stats.end_forward()
    return chunks, steps


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("weight", [0.0, 0.25])
def test_the_prompt_weighs_prompt_weight_once_decoding_counts(static: bool, weight: float) -> None:
    """prompt_weight: the prompt's queries decay like the rest and then weigh ``weight`` against the decoding steps
    (0: the generation's own queries alone), in the deferred folds and in the static step's fold alike; the workload
    learns no prompt at weight 0."""
    model = family_model("llama")
    geometry = describe(model)
    learn = WorkloadStatistics(geometry)
    stats = OnlineStatistics(geometry, half_life=2.0, prompt_weight=weight, learn=learn)
    chunks, steps = _prompt_then_steps(stats, geometry, static)
    f = 0.5 ** (1 / 2.0)
    decay = (f ** 8, f ** 6)  # the first chunk decays by the second's 2 tokens, then both by 6 steps
    totals = [weight * sum(c[i].double().sum(dim=1) * d for c, d in zip(chunks, decay))
              + sum(step[i][:, 0].double() * f ** (5 - j) for j, step in enumerate(steps)) for i in range(len(steps[0]))]
    _assert_means(stats.snapshot(), geometry, totals, weight * (3 * f ** 8 + 2 * f ** 6) + sum(f ** (5 - j) for j in range(6)))
    stats.flush()
    assert learn.tokens == (12 if weight == 0 else 12 + 10)  # 6 steps x 2 rows (+ the prompts' 5 x 2)


def test_the_prompt_alone_scores_until_a_decoding_step_counts() -> None:
    """prompt_weight 0 still scores with the prompt before any decoding step has finished (a compaction during the
    prompt, or at the first step's first layer): there is nothing else to score with."""
    model = family_model("llama")
    geometry = describe(model)
    q = torch.randn(2, 4, geometry.num_q_heads, geometry.head_dim, generator=torch.Generator().manual_seed(9))
    weighted, plain = OnlineStatistics(geometry, half_life=2.0, prompt_weight=0.0), OnlineStatistics(geometry, half_life=2.0)
    for stats in (weighted, plain):
        stats.begin_forward(None, 4)
        for layer_idx in range(geometry.num_layers):
            stats.add(layer_idx, q)
        stats.end_forward()
        stats.begin_forward(None, 1)  # a decoding step begins; its queries do not count yet
    for layer_idx in range(geometry.num_layers):
        torch.testing.assert_close(weighted.snapshot().for_layer(layer_idx), plain.snapshot().for_layer(layer_idx))


def test_shrink_heads_pulls_each_head_toward_its_layers_head_average() -> None:
    """shrink_heads = k: each head's means are (its sums + k * the row's head-averaged means) / (count + k), for the
    means and the moduli alike; the token count is the real one."""
    geometry = describe(family_model("llama"))
    pairs = geometry.rotary_dim // 2
    g = torch.Generator().manual_seed(11)
    queries = [torch.randn(2, 5, geometry.num_q_heads, geometry.head_dim, generator=g) for _ in range(geometry.num_layers)]
    k = 3.0
    stats = OnlineStatistics(geometry, shrink_heads=k)
    stats.begin_forward(None, 5)
    for layer_idx, q in enumerate(queries):
        stats.add(layer_idx, q)
    stats.end_forward()
    snap = stats.snapshot()
    for layer_idx, q in enumerate(queries):
        q = q.double()
        pairs_sum = torch.complex(q[..., :pairs], q[..., pairs : 2 * pairs]).sum(dim=1)  # [B, H, F]
        moduli_sum = torch.hypot(q[..., :pairs], q[..., pairs : 2 * pairs]).sum(dim=1)
        for got, total in ((snap.q_mean[layer_idx], pairs_sum), (snap.q_abs_mean[layer_idx], moduli_sum)):
            expected = head_shrunk(total / 5, 5, k)
            torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(snap.tokens, torch.full((2,), 5.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="shrink_heads must be a number of queries >= 0"):
        OnlineStatistics(geometry, shrink_heads=-1.0)


def test_shrink_within_a_kv_group_pulls_each_head_toward_its_groups_average() -> None:
    """shrink_within="kv_group": the average is over the query heads that share a KV head (heads j*G .. j*G+G-1),
    not over the layer's; the two differ, and the layer's is what the default computes."""
    geometry = describe(family_model("llama"))
    group = geometry.num_q_heads // geometry.num_kv_heads
    assert group > 1 and geometry.num_kv_heads > 1  # else the two averages coincide and this proves nothing
    pairs = geometry.rotary_dim // 2
    g = torch.Generator().manual_seed(12)
    queries = [torch.randn(2, 4, geometry.num_q_heads, geometry.head_dim, generator=g) for _ in range(geometry.num_layers)]
    k = 5.0
    snaps = {}
    for within in ("kv_group", "layer"):
        stats = OnlineStatistics(geometry, shrink_heads=k, shrink_within=within)
        stats.begin_forward(None, 4)
        for layer_idx, q in enumerate(queries):
            stats.add(layer_idx, q)
        stats.end_forward()
        snaps[within] = stats.snapshot()
    for layer_idx, q in enumerate(queries):
        q = q.double()
        moduli_sum = torch.hypot(q[..., :pairs], q[..., pairs : 2 * pairs]).sum(dim=1)  # [B, H, F]
        for head in range(geometry.num_q_heads):
            first = head // group * group
            pooled = moduli_sum[:, first : first + group].mean(dim=1) / 4
            expected = (moduli_sum[:, head] + k * pooled) / (4 + k)
            torch.testing.assert_close(snaps["kv_group"].q_abs_mean[layer_idx][:, head], expected.float(),
                                       rtol=1e-5, atol=1e-6)
    assert not torch.allclose(snaps["kv_group"].q_abs_mean[0], snaps["layer"].q_abs_mean[0])
    with pytest.raises(ValueError, match="shrink_within must be one of"):
        OnlineStatistics(geometry, shrink_within="model")
    with pytest.raises(ValueError, match="shrink_within must be one of"):  # as benchmarks set it: an attribute
        stats.shrink_within = "model"


def test_prompt_weight_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prompt_weight must be a number >= 0"):
        OnlineStatistics(describe(family_model("llama")), prompt_weight=-1.0)


def test_a_step_that_breaks_the_learned_pattern_warns_and_falls_back_to_frames(monkeypatch) -> None:
    model = family_model("llama")
    counter = _CountSee(monkeypatch)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    cache = RopeKVCache(model, budget=20, compress_every=8)
    capture = SharedHooks.of(model).capture
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, **kw)
        assert capture._plan is not None
        capture._plan = capture._plan + (None,)  # as if an earlier step had made one more rotary call
        counter.calls = 0
        with pytest.warns(HfRopeKVWarning, match="rotary calls where earlier steps made"):
            step = torch.tensor([[5]])
            model(input_ids=step, use_cache=True, **kw)
        assert capture._plan is None and capture._plan_failed and counter.calls == 0
        model(input_ids=torch.tensor([[6]]), use_cache=True, **kw)
    assert counter.calls == model.config.num_hidden_layers  # the checked path again, one query per layer


def test_a_recorded_step_that_raises_leaves_no_recording_behind() -> None:
    model = family_model("qwen3")
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    cache = RopeKVCache(model, budget=20, compress_every=8)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, **kw)
        assert SharedHooks.of(model).capture._plan is not None

        def fail(*args):
            raise RuntimeError("boom")

        handle = model.model.layers[1].mlp.register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="boom"):
            model(input_ids=torch.tensor([[7]]), use_cache=True, **kw)
        handle.remove()
        assert rotary._LOCAL.state.recording is not None  # the raising step's recording is still set ...
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): DynamicCache(config=model.config)})
    assert rotary._LOCAL.state.recording is None  # ... until the model's next forward, another cache's included


def test_deferred_queries_are_bounded_in_bytes(monkeypatch) -> None:
    """A large batch folds before DEFER_STEPS steps once the held queries pass DEFER_BYTES."""
    model = family_model("llama")
    geometry = describe(model)
    layers = tuple(range(geometry.num_layers))
    stats = OnlineStatistics(geometry, half_life=None)
    g = torch.Generator().manual_seed(5)
    one_step = 4 * geometry.num_layers * geometry.num_q_heads * geometry.head_dim * 4  # bytes, batch 4, float32
    monkeypatch.setattr(OnlineStatistics, "DEFER_BYTES", 3 * one_step)
    held = []
    for _ in range(9):
        stats.begin_forward(None, 1)
        stats.add_step(layers, [torch.randn(4, geometry.num_q_heads, 1, geometry.head_dim, generator=g)
                                for _ in layers], heads_dim=1)
        stats.end_forward()
        held.append(len(stats._deferred))
    assert held == [0, 1, 2, 3, 0, 1, 2, 3, 0]  # the first step places the rows; then a fold every 4 steps


def _wrapped(model) -> list[bool]:
    """Per attention module: whether its forward goes through a capture frame now."""
    capture = SharedHooks.of(model).capture
    return [isinstance(_frame_of(a.__dict__.get("forward")), _Frame) for a in capture.attention_modules]


def test_recorded_steps_bypass_the_attention_wrappers_and_multi_token_forwards_get_them_back(monkeypatch) -> None:
    model = family_model("qwen3")
    counter = _CountSee(monkeypatch)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    cache = RopeKVCache(model, budget=20, compress_every=8)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **kw)  # the prompt: the frame path
        assert _wrapped(model) == [True] * layers and counter.calls == layers
        model(input_ids=torch.tensor([[5]]), use_cache=True, **kw)  # the first decoding step learns the plan
        assert _wrapped(model) == [True] * layers and counter.calls == 2 * layers
        for token in (6, 7, 8):  # recorded steps: no wrapper is called, the queries still arrive
            model(input_ids=torch.tensor([[token]]), use_cache=True, **kw)
            assert _wrapped(model) == [False] * layers and counter.calls == 2 * layers
        model(input_ids=torch.tensor([[9, 10]]), use_cache=True, **kw)  # two tokens: the frames again
        assert _wrapped(model) == [True] * layers and counter.calls == 3 * layers
    del cache, kw
    gc.collect()  # the last cache gone: its hooks and wrappers too
    assert not any("forward" in layer.self_attn.__dict__ for layer in model.model.layers)


def test_a_growing_cache_decoding_compiled_warns_and_takes_the_frame_path() -> None:
    """A recorded step whose rotary calls never reach the recording (dynamo traced them) is reported, not lost silently."""
    model = family_model("llama")
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = RopeKVCache(model, budget=20, compress_every=8)
    capture = SharedHooks.of(model).capture
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **kw)
        model(input_ids=torch.tensor([[5]]), use_cache=True, **kw)  # learns the plan
        assert capture._plan is not None
        inner = model.model
        original = inner.forward
        inner.forward = torch.compile(original, backend="eager", fullgraph=False)
        try:
            torch._dynamo.reset()
            with pytest.warns(HfRopeKVWarning, match="hf_ropekv"):
                model(input_ids=torch.tensor([[6]]), use_cache=True, **kw)
        finally:
            inner.forward = original
            torch._dynamo.reset()
        assert capture._plan_failed and _wrapped(model) == [True] * model.config.num_hidden_layers
