"""One compilation of a static cache's decode step for every batch size (issue 27, item 3).

With ``dynamic_batch=True`` (and under the default ``"auto"`` once the model has compiled a step of more than one
row), generate's compiled forward marks the batch dimension dynamic: the step's inputs and every buffer the cache leased
(``hf_ropekv.storage.buffers.BATCH_DIMS``), with batch 1 not specialised (``_compat.batch_one_not_specialised``).
Without that, on torch 2.13 (CPU, dynamo's "eager" backend) batches 3, 2, 5, 1, 16 cost 3 compilations (batch 3;
batch 2, after which dynamo's automatic dynamic shapes take over; batch 1, which dynamic shapes specialise); with
the batch marked dynamic but batch 1 specialised, 2; with both, 1. On transformers 5.17 that alone still gave
batch 1 a graph of its own (2 in all, whichever came first): its rotary embeddings expand ``inv_freq`` over the batch
for a batched matmul (``LlamaRotaryEmbedding.forward``, modeling_llama.py:115-122), whose reshape guards
``batch != 1``; a compiled step runs them on all rows' positions as one row (``_compat.rotary_batch_folded``).
Under inductor that row is padded by two positions: inductor's decomposition of the rotary's ``torch.cat((freqs,
freqs), -1)`` checked the contiguity of an expansion whose stride was the number of positions, guarding it != 1.
"""

from __future__ import annotations

import gc
import inspect

import pytest
import torch
from packaging.version import Version
from torch._dynamo.utils import counters

from conftest import padded_batch, tiny_model
from test_static_cache import compiled, generate

from hf_ropekv import RopeKVCache
from hf_ropekv.storage.buffers import BATCH_DIMS, BufferLease, batch_dim

BUDGET, EVERY, NEW = 16, 4, 32


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = tuple(4 + (3 * row) % 7 for row in range(size))  # left padding in every batch of more than one row
    return padded_batch(128, lengths=lengths, seed=size)


def _one_graph_for(sizes: tuple[int, ...], backend: str, dynamic_batch: bool | str = True) -> None:
    graphs = _graphs_for(tiny_model("llama"), sizes, dynamic_batch, backend)
    assert dict(counters["graph_break"]) == {}
    assert graphs == [1] * len(sizes), graphs


@pytest.mark.parametrize("sizes", [(3, 2, 5, 1, 16), (1, 4, 2)])
def test_one_compile_for_every_batch_size(sizes: tuple[int, ...]) -> None:
    """``dynamic_batch=True``: one budget, batches of several sizes (batch 1 first or late): one graph, no
    recompilation; each batch's tokens are the growing (eager) cache's."""
    _one_graph_for(sizes, "eager")


@pytest.mark.parametrize("sizes", [(3, 2, 5, 1, 16), (1, 1, 1)])
def test_auto_compiles_once_unless_batch_one_came_first(sizes: tuple[int, ...]) -> None:
    """The default ``dynamic_batch="auto"``: an eval loop that starts with its largest batch (its last batch smaller,
    then 1) compiles once; so does a process of batch 1 alone, with the batch left static."""
    _one_graph_for(sizes, "eager", dynamic_batch="auto")


def _has_cpp_compiler() -> bool:
    try:  # imported here, not at collection: inductor pulls in triton (conftest: TRITON_INTERPRET)
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # no compiler found (InvalidCxxCompiler), or a torch without this helper
        return False
    return True


def test_one_compile_for_every_batch_size_under_inductor(tmp_path, monkeypatch) -> None:
    """The same under inductor (generate's default backend; about 30 s on 2 CPU cores, a fresh inductor cache).
    Before the folded rotary was padded (``_compat._FOLD_PADDING``), transformers 5.17 compiled batch 1 again here
    and under inductor + CUDA graphs on an H200: inductor's ``cat`` decomposition guarded ``batch != 1``, which
    dynamo's own trace (the "eager" backend) never sees."""
    if not _has_cpp_compiler():
        pytest.skip("inductor on the CPU needs a C++ compiler")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    _one_graph_for((3, 2, 1, 5), "inductor", dynamic_batch="auto")


def _graphs_for(model, sizes: tuple[int, ...], dynamic_batch: bool | str, backend: str = "eager") -> list[int]:
    """Compiled generations of ``sizes`` on ``model`` (generate's compilation with ``backend``), each checked against
    the growing cache's tokens; the graph count after each."""
    graphs = []
    for size in sizes:
        ids, mask = _batch(size)
        expected = generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False), ids, mask,
                            new=NEW)
        cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, dynamic_batch=dynamic_batch)
        got = generate(model, cache, ids, mask, new=NEW, compile_config=compiled(backend))
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        assert cache.num_compactions >= 2
        graphs.append(counters["stats"]["unique_graphs"])
        del cache
        gc.collect()
    return graphs


def test_dynamic_batch_false_specialises_the_step_to_its_batch_size() -> None:
    """``dynamic_batch=False`` leaves the batch size to torch: one graph while the size stays, a second one at the
    first other size (torch's automatic dynamic shapes then make the dimension dynamic: the third size reuses it),
    and the same tokens as the growing cache throughout. With the default, the same sizes share one graph."""
    model = tiny_model("llama")
    assert _graphs_for(model, (3, 3, 2, 5), dynamic_batch=False) == [1, 1, 2, 2]
    torch._dynamo.reset()
    counters.clear()
    assert _graphs_for(tiny_model("llama"), (3, 3, 2, 5), dynamic_batch=True) == [1, 1, 1, 1]


def test_auto_keeps_batch_one_static_until_a_larger_batch() -> None:
    """``dynamic_batch="auto"``: batch 1 compiles with the batch static (the short warm-up); the model's first
    larger batch compiles once more, with the batch dynamic, and every size after it, batch 1 included, reuses a
    graph. With ``dynamic_batch=True`` the same sizes share one graph; with ``False`` batch 1 and batch 4 compile a
    graph each (torch then makes the dimension dynamic) and the later sizes reuse them. Tokens are the growing
    cache's throughout."""
    model = tiny_model("llama")
    assert _graphs_for(model, (1, 1, 4, 1, 2, 5), dynamic_batch="auto") == [1, 1, 2, 2, 2, 2]
    torch._dynamo.reset()
    counters.clear()
    assert _graphs_for(tiny_model("llama"), (1, 4, 1, 2), dynamic_batch=True) == [1, 1, 1, 1]
    torch._dynamo.reset()
    counters.clear()
    assert _graphs_for(tiny_model("llama"), (1, 4, 1, 2), dynamic_batch=False) == [1, 2, 2, 2]


def test_auto_says_once_why_a_larger_batch_compiles_again(caplog) -> None:
    """The second compile ``"auto"`` costs (batch 1 first, then more rows) is logged once at INFO level, naming the
    setting that avoids it; a model whose first batch has more rows compiles once and logs nothing."""
    import logging

    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="hf_ropekv.hooks.generate_methods"):
        _graphs_for(model, (1, 3, 2), dynamic_batch="auto")
        _graphs_for(tiny_model("llama"), (4, 1), dynamic_batch="auto")
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_ropekv.hooks.generate_methods"]
    assert len(lines) == 1, lines
    assert "3 rows" in lines[0] and "LlamaForCausalLM" in lines[0] and "dynamic_batch=True" in lines[0]


def test_auto_is_per_model() -> None:
    """What ``"auto"`` has seen belongs to one model: a second model's batch-1 steps are not marked dynamic because
    the first one decoded batch 4 (dynamo may still reuse the first model's graph for them: it guards the
    parameters' shapes, not the module), and both give the growing cache's tokens."""
    first, second = tiny_model("llama"), tiny_model("llama")
    _graphs_for(first, (4,), dynamic_batch="auto")
    _graphs_for(second, (1,), dynamic_batch="auto")
    assert first.get_compiled_call.batch_above_one_seen
    assert not second.get_compiled_call.batch_above_one_seen
    _graphs_for(second, (2,), dynamic_batch="auto")
    assert second.get_compiled_call.batch_above_one_seen


def test_dynamic_batch_can_change_between_caches_of_one_model() -> None:
    """Caches of one model share its leased buffers (BufferPool); one that marked them dynamic before does not stop
    a later ``dynamic_batch=False`` cache (or the reverse) from compiling and giving the growing cache's tokens."""
    model = tiny_model("llama")
    _graphs_for(model, (2,), dynamic_batch=True)
    _graphs_for(model, (2, 4), dynamic_batch=False)
    _graphs_for(model, (3,), dynamic_batch=True)
    assert dict(counters["graph_break"]) == {}


def test_another_budget_is_another_compile() -> None:
    """The arena's length is static: a budget with another arena (whole pages: 64 slots, then 128) compiles once
    more, and its batches share that graph."""
    model = tiny_model("llama")
    for budget, size in ((BUDGET, 2), (BUDGET, 3), (100, 2), (100, 5)):
        ids, mask = _batch(size)
        generate(model, RopeKVCache(model, budget=budget, compress_every=EVERY, static=True), ids, mask, new=NEW,
                 compile_config=compiled())
    assert counters["stats"]["unique_graphs"] == 2


def test_every_leased_purpose_has_a_batch_dim(monkeypatch) -> None:
    """Every purpose a static cache leases a buffer for is listed in BATCH_DIMS, and its dimension is the batch:
    caught on generations with online statistics (their sums and counts are leased too) and learning."""
    taken: list[tuple] = []
    take = BufferLease.take

    def recording_take(self, purpose, shape, dtype, make):
        taken.append((purpose, tuple(shape)))
        return take(self, purpose, shape, dtype, make)

    monkeypatch.setattr(BufferLease, "take", recording_take)
    size = 3
    ids, mask = _batch(size)
    for arch in ("llama", "qwen2_sliding"):  # the hybrid model leases its static windows too
        model = tiny_model(arch)
        generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True), ids, mask, new=NEW)
    # learning the workload leases per-row learning sums
    generate(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, learn_workload=True), ids,
             mask, new=NEW)
    kinds = {purpose[0] for purpose, _ in taken}
    assert kinds == set(BATCH_DIMS), "a purpose leased but not listed, or listed but never leased"
    for purpose, shape in taken:
        dim = batch_dim(purpose)
        assert dim is None or shape[dim] == size, (purpose, shape)
    with pytest.raises(KeyError, match="BATCH_DIMS"):
        batch_dim(("a_new_purpose", 0))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_folded_rotary_is_bitwise_the_rotary(arch: str) -> None:
    """The rotary modules a compiled step runs with the batch folded into one row (transformers 5.17: those that
    expand their frequencies over the batch; 5.24: none) give exactly their unfolded cos / sin, and are unpatched
    after the context."""
    from hf_ropekv import _compat

    model = tiny_model(arch)
    found = _compat.batch_expanding_rotaries(model)
    assert bool(found) == (_compat.TRANSFORMERS_VERSION < Version("5.24")), found
    rotary = model.model.rotary_emb
    x = torch.zeros(3, 2, 64)
    positions = torch.tensor([[0, 1], [7, 8], [2900, 2901]])
    kwargs = {"layer_type": "sliding_attention"} if "layer_type" in inspect.signature(rotary.forward).parameters else {}
    expected = rotary(x, position_ids=positions, **kwargs)
    with _compat.rotary_batch_folded([rotary]):
        folded = rotary(x, position_ids=positions, **kwargs)
    assert "forward" not in rotary.__dict__
    for got, want in zip(folded, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0, rtol=0)
