"""``RopeKVCache(cuda_graphs=True)``: a static cache's decode step replayed from a CUDA graph of the eager forward
(``hf_ropekv.hooks.graphed_step``), no compile.

On the CPU: the option's checks, the eager fallback off CUDA, the ``static="auto"`` threshold, and the property the
replay rests on: a static decode step reads no tensor besides its inputs, the model's weights and the tensors the
executor keys its graphs by (``RopeKVCache._recorded_step_tensors``). On CUDA (``-m gpu``): the eager static
cache's tokens, one recording per cache.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import CompileConfig

from conftest import ARCHS, padded_batch, tiny_model
from test_model_families import NAMES as FAMILY_NAMES, family_model
from hf_ropekv import HfRopeKVWarning, KeyNormScorer, RopeKVCache
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.cache import auto_static

BUDGET, EVERY = 16, 4


def generate(model, cache, ids, mask, new, **kwargs) -> torch.Tensor:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, **{cache_kwarg(model): cache}, **kwargs)
    return out[:, ids.shape[1]:]


def compile_everywhere() -> CompileConfig:
    """generate's compile config, on the CPU too (it compiles on accelerators only by default)."""
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    return config


def graphed_steps(model):
    """The model's graphed decode-step executor (on its get_compiled_call wrapper)."""
    return vars(model)["get_compiled_call"].graphed


def test_cuda_graphs_needs_a_cache_that_can_be_static() -> None:
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="cuda_graphs=True replays a static cache's decode step.*static=True"):
        RopeKVCache(model, budget=BUDGET, static=False, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be True .*, False .* or \"auto\""):
        RopeKVCache(model, budget=BUDGET, static=True, cuda_graphs="yes")
    assert not RopeKVCache(model, budget=BUDGET, static=False).cuda_graphs  # "auto" on a growing cache: nothing


def test_off_cuda_the_steps_run_eagerly_with_one_warning() -> None:
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True), ids, mask, 20,
                        disable_compile=True)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, cuda_graphs=True)
    with pytest.warns(HfRopeKVWarning, match="decodes eagerly: the model runs on cpu") as caught:
        tokens = generate(model, cache, ids, mask, 20, compile_config=compile_everywhere())
    assert len([w for w in caught if issubclass(w.category, HfRopeKVWarning)]) == 1
    torch.testing.assert_close(tokens, expected, atol=0, rtol=0)
    assert graphed_steps(model).recordings == 0 and cache.num_compactions >= 2


def test_a_model_over_several_devices_is_not_captured() -> None:
    """A capture records one device's stream: layers on another device would run once while capturing, never at
    replay. Such a model (``device_map``) decodes eagerly; so does one on the CPU. (Checked on the rule itself:
    this machine has one device; a meta lm_head stands in for the second.)"""
    from hf_ropekv.hooks.graphed_step import not_capturable

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

    from hf_ropekv.hooks.graphed_step import _Recorded

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


@pytest.mark.parametrize("cuda_graphs, on_one_gpu, new, static, graphs", [
    (True, False, auto_static.AUTO_GRAPHED_MIN_NEW_TOKENS, True, True),
    (True, False, auto_static.AUTO_GRAPHED_MIN_NEW_TOKENS - 1, False, False),
    (False, True, auto_static.AUTO_GRAPHED_MIN_NEW_TOKENS, False, False),  # compiling needs AUTO_STATIC_MIN_NEW_TOKENS
    ("auto", True, auto_static.AUTO_GRAPHED_MIN_NEW_TOKENS, True, True),  # the default, on one CUDA device
    ("auto", True, auto_static.AUTO_GRAPHED_MIN_NEW_TOKENS - 1, False, False),
    ("auto", False, auto_static.AUTO_GRAPHED_MIN_NEW_TOKENS, False, False),  # elsewhere generate would compile
])
def test_auto_goes_static_from_far_fewer_tokens_with_cuda_graphs(cuda_graphs, on_one_gpu, new, static, graphs,
                                                                 caplog, monkeypatch) -> None:
    """``static="auto"`` goes static from AUTO_GRAPHED_MIN_NEW_TOKENS where its steps replay graphs: with
    ``cuda_graphs=True``, or the default ``"auto"`` where the model is on one CUDA device (here the CPU stands in
    for it: ``not_capturable`` patched; off a single GPU the default would compile, from AUTO_STATIC_MIN_NEW_TOKENS)."""
    model = tiny_model("qwen3")
    if on_one_gpu:
        monkeypatch.setattr(auto_static, "not_capturable", lambda model, device: None)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9,))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, cuda_graphs=cuda_graphs)
    # static here: the CPU cannot capture, so its steps run eagerly (with a warning), as checked above
    expect = pytest.warns(HfRopeKVWarning, match="runs on cpu") if static else contextlib.nullcontext()
    with caplog.at_level(logging.INFO), expect:
        generate(model, cache, ids, mask, new, compile_config=compile_everywhere())
    assert cache.static is static and cache.cuda_graphs is graphs
    assert cache.static_reason.removeprefix("auto: ") in caplog.text  # the one INFO line says which and why
    if static:
        assert "replays the decode step as a CUDA graph" in cache.static_reason
        assert "static, replaying CUDA graphs" in caplog.text
    elif cuda_graphs is True or on_one_gpu and cuda_graphs == "auto":
        assert "AUTO_GRAPHED_MIN_NEW_TOKENS" in cache.static_reason
    else:
        assert "AUTO_STATIC_MIN_NEW_TOKENS" in cache.static_reason


def test_an_explicit_static_cache_compiles_by_default() -> None:
    """``static=True`` asked for a compileable cache: with the default ``cuda_graphs="auto"`` generate compiles its
    decode steps (no graph executor, no recording); ``cuda_graphs=True`` hands them to the executor."""
    model = tiny_model("qwen3")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9,))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    assert cache.static and not cache.cuda_graphs and cache.options.cuda_graphs == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error", HfRopeKVWarning)  # the executor would warn: "decodes eagerly: ... on cpu"
        generate(model, cache, ids, mask, 8, compile_config=compile_everywhere())
    assert graphed_steps(model).graphs_of(cache) == 0
    assert RopeKVCache(model, budget=BUDGET, static=True, cuda_graphs=True).cuda_graphs


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
    generate(model, cache, ids, mask, 12, compile_config=compile_everywhere())
    return outside, fingerprints, cache, fresh


@pytest.mark.parametrize("arch, options", [
    *[(arch, {}) for arch in ARCHS],
    ("qwen3", {"learn_workload": True}),  # the workload's learning rows, updated in the step
    ("qwen3", {"scorer": KeyNormScorer()}),  # no query statistics in the step
    ("gemma3_text", {"learn_workload": True}),
])
@pytest.mark.filterwarnings("ignore:budget=16 evicts nothing")  # mistral_sliding: every layer slides
def test_a_static_decode_step_reads_only_its_inputs_weights_and_recorded_tensors(arch, options) -> None:
    """A CUDA graph replays the addresses its capture read. The executor copies the step's inputs in and keys its
    graphs by the addresses of ``_recorded_step_tensors()``; anything else the step read (a tensor the cache makes
    anew for a step, a host value turned into a tensor) would be replayed stale. Every decode step, across
    compactions, with left padding, on every test architecture (sliding-window layers among them), with the
    workload's learning rows and with a scorer that needs no queries."""
    outside, fingerprints, cache, fresh = _reads_outside(tiny_model(arch), **options)
    assert len(outside) == 11 and fresh == [[]] * 11  # (hf_ropekv's own layers make no host tensor in the step)
    assert cache.num_compactions >= 2 or not cache.coordinator.full_layers  # (an all-sliding model evicts nothing)
    assert outside == [{}] * 11, outside[0]
    assert len(set(fingerprints)) == 1


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_rope_family_reads_only_its_inputs_weights_and_recorded_tensors(name) -> None:
    """The same on every RoPE family of ``test_model_families`` (fused QKV, partial rotary, interleaved pairs, one
    rotary call per tensor, sinks). A family's own code may make host tensors in the step (Falcon's fused-QKV split
    indexes with ``[-2]`` and ``[-1]`` on transformers 5.17): their values must not change from step to step."""
    outside, fingerprints, cache, fresh = _reads_outside(family_model(name))
    assert len(outside) == 11 and cache.num_compactions >= 2
    assert all(step == fresh[0] for step in fresh), fresh
    assert outside == [{}] * 11, outside[0]
    assert len(set(fingerprints)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_graphed_steps_give_the_eager_static_tokens_on_cuda(arch) -> None:
    """CUDA: the graph replays eager's kernels, so the tokens equal the eager static cache's exactly, across
    compactions, with padding and (Gemma 2) sliding-window layers; one recording per cache, a new one for a new
    cache; a second generate() continuing the same cache replays its graph."""
    model = tiny_model(arch, attn_implementation="eager" if arch == "gemma2" else None).cuda()
    ids, mask = (t.cuda() for t in padded_batch(model.config.vocab_size, lengths=(11, 6, 3)))
    expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True), ids, mask, 40,
                        disable_compile=True)
    for round_ in range(2):
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, cuda_graphs=True)
        tokens = generate(model, cache, ids, mask, 40)
        torch.testing.assert_close(tokens, expected, atol=0, rtol=0)
        assert graphed_steps(model).graphs_of(cache) == 1 and graphed_steps(model).recordings == round_ + 1
        assert cache.num_compactions >= 8
    # The same cache, continued (prompt reuse): the eager static cache continued gives the reference.
    reference = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True)
    generate(model, reference, ids, mask, 40, disable_compile=True)
    more = torch.cat([ids, expected], dim=1)
    more_mask = torch.cat([mask, torch.ones_like(expected)], dim=1)
    expected_more = generate(model, reference, more, more_mask, 10, disable_compile=True)
    torch.testing.assert_close(generate(model, cache, more, more_mask, 10), expected_more, atol=0, rtol=0)
    assert graphed_steps(model).recordings == 2
