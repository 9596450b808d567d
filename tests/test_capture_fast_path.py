"""The capture's fast path of eager decoding steps (``QueryCapture.begin_forward``): same queries, fewer host steps.

The first decoding step of a growing cache takes the checked frame path and learns which rotary call gives which
layer's query; later steps only record the calls and hand the queries over after the forward. The reference is the
frame path itself (the fast path switched off): the online statistics must be bit-identical, and so must the
tokens, on every family with a different rotary calling convention (paired, one tensor per call, partial rotary,
``[B, S, H, D]`` queries).
"""

from __future__ import annotations

import pytest
import torch
from test_model_families import NAMES, family_model
from conftest import padded_batch
from transformers import DynamicCache

from hf_ropekv import RopeKVCache, rotary
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.attach import SharedHooks
from hf_ropekv.capture import _Frame


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
    sums = {device: value.clone() for device, value in cache._online._sums.items()}
    counts = {device: value.clone() for device, value in cache._online._counts.items()}
    took_fast_path = capture._plan is not None
    return out, sums, counts, cache, took_fast_path


@pytest.mark.parametrize("name", NAMES)
def test_fast_path_gives_the_frame_paths_statistics_and_tokens(name: str, monkeypatch) -> None:
    model = family_model(name)
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
        with pytest.warns(RuntimeWarning, match="rotary calls where earlier steps made"):
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
