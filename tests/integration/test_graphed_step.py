"""A static cache's decode step replayed from a CUDA graph of the eager forward (``hf_ropekv.adapter.graphed_step``),
the default on one CUDA device.

On the CPU: the rule for what can be captured, the eager fallback off CUDA, and the property the replay rests on: a
static decode step reads no tensor besides its inputs, the model's weights and the tensors the executor keys its
graphs by (``RopeKVCache._recorded_step_tensors``, private: the executor's contract with the cache). On CUDA the
tokens are checked against the eager static cache in ``test_static_cache.py`` (``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import ARCHS, FAMILY_NAMES, compiled, family_model, generate_new, padded_batch, tiny_model
from hf_ropekv import HfRopeKVWarning, RopeKVCache
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.scorers import KeyNormScorer

BUDGET, EVERY = 16, 4


def generate(model, cache, ids, mask, new, **kwargs) -> torch.Tensor:
    return generate_new(model, cache, ids, mask, new, **kwargs)


def test_off_cuda_the_executor_runs_the_steps_eagerly_with_one_warning(monkeypatch) -> None:
    """Where the cache's attachment hands the steps to the graphed executor (forced here: private
    ``adapter.attach.not_capturable``), the executor itself finds the CPU: one warning per cache, eager steps, the
    eager static cache's tokens, nothing recorded."""
    from hf_ropekv.adapter import attach

    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True), ids, mask, 20,
                        disable_compile=True)
    monkeypatch.setattr(attach, "not_capturable", lambda model, device: None)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    with pytest.warns(HfRopeKVWarning, match="decodes eagerly, without CUDA graphs: the model runs on cpu") as caught:
        tokens = generate(model, cache, ids, mask, 20, compile_config=compiled())
    assert len([w for w in caught if issubclass(w.category, HfRopeKVWarning)]) == 1
    torch.testing.assert_close(tokens, expected, atol=0, rtol=0)
    graphed = vars(model)["get_compiled_call"].graphed
    assert graphed.recordings == 0 and graphed.graphs_of(cache) == 0 and cache.num_compactions >= 2


def test_a_model_over_several_devices_is_not_captured() -> None:
    """A capture records one device's stream: layers on another device would run once while capturing, never at
    replay. Such a model (``device_map``) decodes eagerly; so does one on the CPU. (Checked on the rule itself:
    this machine has one device; a meta lm_head stands in for the second.)"""
    from hf_ropekv.adapter.graphed_step import not_capturable

    model = tiny_model("qwen3")
    assert "runs on cpu" in not_capturable(model, torch.device("cpu"))
    assert not_capturable(model, torch.device("cuda")) is None  # (the rule only: one device, no ranks)
    model.lm_head.to("meta")
    assert "spans 2 devices (cpu, meta)" in not_capturable(model, torch.device("cuda"))


def test_a_recorded_step_keeps_no_reference_to_its_cache() -> None:
    """The graphs live until their cache is freed (a finalizer drops them), so a graph's kept output must not hold
    the cache (``past_key_values``): the cache, its buffers and its graphs would live as long as the model. A replay
    hands out fresh tensors and the running cache. (A stand-in graph: recording needs CUDA.)"""
    import weakref

    from transformers.modeling_outputs import CausalLMOutputWithPast

    from hf_ropekv.adapter.graphed_step import _Recorded

    class Graph:
        replays = 0

        def replay(self) -> None:
            Graph.replays += 1

    class Cache:
        pass

    cache, logits, step_input = Cache(), torch.randn(1, 1, 8), torch.randn(1, 1)
    recorded = _Recorded(Graph(), [step_input.clone()], CausalLMOutputWithPast(logits=logits, past_key_values=cache),
                         cache)
    other = Cache()
    new_input = torch.randn(1, 1)
    out = recorded.replay([new_input], other)
    assert Graph.replays == 1 and torch.equal(recorded.inputs[0], new_input)
    assert out.past_key_values is other
    assert torch.equal(out.logits, logits) and out.logits.data_ptr() != logits.data_ptr()
    gone = weakref.ref(cache)
    del cache
    assert gone() is None  # by reference counting alone


class _ReadsOutside(TorchDispatchMode):
    """The storages every op reads that no op of the same forward made: what a captured graph reads by address.

    Tensors the step makes from host values (``torch.tensor(...)``, indexing with a list: ``aten.lift_fresh``) are
    kept apart, by value (``fresh``): a capture bakes such a value in, or refuses the host copy (the executor then
    decodes eagerly). That is sound only when the value is the same at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.read: dict[int, tuple] = {}
        self.fresh: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            self.fresh.append((tuple(args[0].shape), args[0].dtype, tuple(args[0].flatten().tolist())))
            out = func(*args, **(kwargs or {}))
            self.made.add(out.untyped_storage().data_ptr())
            return out
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                address = t.untyped_storage().data_ptr()
                if address not in self.made:
                    self.read.setdefault(address, (tuple(t.shape), t.dtype, str(func)))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.read:
                self.made.add(t.untyped_storage().data_ptr())
        return out


def _reads_outside(model, **options) -> tuple[list[dict[int, tuple]], list[tuple[int, ...]], RopeKVCache,
                                                list[list[tuple]]]:
    """Run 12 greedy tokens of a left-padded batch with a static cache, each decode step eagerly under
    :class:`_ReadsOutside` where the graphed executor would stand; per step, what it read besides its inputs, the
    model's weights and ``_recorded_step_tensors()``, and those tensors' addresses."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    outside: list[dict[int, tuple]] = []
    fresh: list[list[tuple]] = []
    fingerprints: list[tuple[int, ...]] = []

    def step(*args, **kwargs):  # where the graphed executor stands: records what the eager step reads
        cache = kwargs[cache_kwarg(model)]
        allowed = weights | {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                             if isinstance(t, torch.Tensor)}
        recorded = cache._recorded_step_tensors()
        allowed |= {t.untyped_storage().data_ptr() for t in recorded}
        fingerprints.append(tuple(t.data_ptr() for t in recorded))
        with _ReadsOutside() as reads:
            out = model(*args, **kwargs)
        outside.append({address: what for address, what in reads.read.items() if address not in allowed})
        fresh.append(reads.fresh)
        return out

    model.get_compiled_call = lambda *a, **k: step  # set before the cache: its wrapper chains to it
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, protect_prompt=False, **options)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(24, 17))
    generate(model, cache, ids, mask, 12, compile_config=compiled())
    return outside, fingerprints, cache, fresh


@pytest.mark.parametrize("arch, options", [
    *[(arch, {}) for arch in ARCHS],
    ("qwen3", {"scorer": KeyNormScorer()}),  # no query statistics in the step
])
@pytest.mark.filterwarnings("ignore:budget=16 evicts nothing")  # mistral_sliding: every layer slides
def test_a_static_decode_step_reads_only_its_inputs_weights_and_recorded_tensors(arch, options) -> None:
    """A CUDA graph replays the addresses its capture read. The executor copies the step's inputs in and keys its
    graphs by the addresses of ``_recorded_step_tensors()``; anything else the step read (a tensor the cache makes
    anew for a step, a host value turned into a tensor) would be replayed stale. Every decode step, across
    compactions, with left padding, on every test architecture (sliding-window layers among them), and with a scorer
    that needs no queries."""
    outside, fingerprints, cache, fresh = _reads_outside(tiny_model(arch), **options)
    assert len(outside) == 11 and fresh == [[]] * 11  # (hf_ropekv's own layers make no host tensor in the step)
    assert cache.num_compactions >= 2 or not cache.coordinator.full_layers  # (an all-sliding model evicts nothing)
    assert outside == [{}] * 11, outside[0]
    assert len(set(fingerprints)) == 1


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_rope_family_reads_only_its_inputs_weights_and_recorded_tensors(name) -> None:
    """The same on every RoPE family of ``conftest.FAMILIES`` (fused QKV, partial rotary, interleaved pairs, one
    rotary call per tensor, sinks). A family's own code may make host tensors in the step (Falcon's fused-QKV split
    indexes with ``[-2]`` and ``[-1]`` on transformers 5.17): their values must not change from step to step."""
    outside, fingerprints, cache, fresh = _reads_outside(family_model(name))
    assert len(outside) == 11 and cache.num_compactions >= 2
    assert all(step == fresh[0] for step in fresh), fresh
    assert outside == [{}] * 11, outside[0]
    assert len(set(fingerprints)) == 1
