"""``RopeKVCache(static=True)`` compiled by ``generate`` gives the eager static cache's tokens, with eviction.

Formerly ``benchmarks/static_exactness.py``. The same left-padded batch is decoded by: the static cache eagerly
(``disable_compile=True``), the growing default cache (``static=False``), and the static cache compiled by
generate itself (``fullgraph=True``: a graph break is an error), twice with fresh caches. On the CPU (float32,
dynamo with the eager backend) all four must agree token for token and the second compiled call must not
compile again. On CUDA (``gpu``; bf16, inductor with CUDA graphs, cuDNN sdpa off) the growing and the eager
static caches must agree, the second compiled call must repeat the first, and where compiled and eager part it
must be at a near-tie of the eager run's logits: bf16 rounding differs between inductor's fused kernels and eager
ones (on an H200 the recorded margins were 0.03-0.11, benchmarks/results/static_exactness_2026-12-01_06141d2).

On CUDA the same models, scorers and batch sizes also run with their decode steps replayed as CUDA graphs of the
eager step (``cuda_graphs=True``; the default cache's mode on one GPU, which the Qwen3-1.7B check runs as a user
gets it): those replay eager's own kernels, so their tokens must equal the eager static cache's exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import hf_ropekv
from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg
from conftest import padded_batch, tiny_model
from test_check_exactness import QWEN3_1_7B, TINY_QWEN3, left_padded, random_qwen3
from test_graphed_step import graphed_steps

BF16_NEAR_TIE = 0.25  # a few bf16 ulps of logits around 10: what a different summation order can flip


def generate(model, cache, ids, mask, steps: int, compile_config: CompileConfig | None) -> tuple[torch.Tensor, list]:
    """Greedy tokens and per-step scores; eager when ``compile_config`` is None, else compiled by generate."""
    extra: dict[str, Any] = {"disable_compile": True} if compile_config is None else {"compile_config": compile_config}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                         **{cache_kwarg(model): cache}, **extra)
    return out.sequences[:, ids.shape[1]:].cpu(), [s.float().cpu() for s in out.scores]


def divergence_margins(reference: torch.Tensor, scores: list, other: torch.Tensor) -> list[float]:
    """Per row that differs: the reference's top-2 logit margin at the first step where ``other`` parts from it."""
    margins = []
    for row in range(reference.shape[0]):
        differ = (reference[row] != other[row]).nonzero()
        if differ.numel():
            top2 = scores[int(differ[0])][row].topk(2).values
            margins.append(float(top2[0] - top2[1]))
    return margins


def run_all(shape, dtype, device, batch, prompt, steps, budget, compress_every, compile_config):
    model = random_qwen3(shape, dtype, device)
    ids, mask = left_padded(batch, prompt, shape["vocab_size"], device)
    options = dict(budget=budget, compress_every=compress_every, protect_prompt=False)
    eager, scores = generate(model, RopeKVCache(model, **options, static=True), ids, mask, steps, None)
    growing_cache = RopeKVCache(model, **options)
    growing, _ = generate(model, growing_cache, ids, mask, steps, None)
    assert growing_cache.num_compactions >= 2, "the check needs eviction inside the generation"
    counters.clear()
    compiled, _ = generate(model, RopeKVCache(model, **options, static=True), ids, mask, steps, compile_config)
    graphs_after_first = counters["stats"]["unique_graphs"]
    again, _ = generate(model, RopeKVCache(model, **options, static=True), ids, mask, steps, compile_config)
    assert graphs_after_first >= 1, "generate did not compile the static cache's decode step"
    assert counters["stats"]["unique_graphs"] == graphs_after_first, "a fresh static cache compiled again"
    if device == "cuda":  # the default cache, as a user gets it: static="auto" and cuda_graphs="auto"
        default_cache = RopeKVCache(model, **options)
        default, _ = generate(model, default_cache, ids, mask, steps, CompileConfig())
        assert default_cache.static and default_cache.cuda_graphs, default_cache.static_reason
        assert graphed_steps(model).graphs_of(default_cache) == 1
        assert torch.equal(default, eager), "the default cache's graphed steps gave other tokens than eager ones"
    return eager, scores, growing, compiled, again


def test_compiled_static_cache_matches_eager_on_cpu() -> None:
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # generate compiles by itself on accelerators only
    eager, _, growing, compiled, again = run_all(TINY_QWEN3, torch.float32, "cpu", batch=2, prompt=24, steps=24,
                                                 budget=16, compress_every=4, compile_config=config)
    assert torch.equal(growing, eager)
    assert torch.equal(compiled, eager)
    assert torch.equal(again, compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_static_cache_matches_eager_on_cuda_at_qwen3_1_7b(deterministic_sdpa) -> None:
    eager, scores, growing, compiled, again = run_all(
        QWEN3_1_7B, torch.bfloat16, "cuda", batch=4, prompt=1024, steps=256, budget=1024, compress_every=64,
        compile_config=CompileConfig(fullgraph=True))
    assert torch.equal(growing, eager)
    assert torch.equal(again, compiled)
    margins = divergence_margins(eager, scores, compiled)
    assert all(m <= BF16_NEAR_TIE for m in margins), f"compiled parted from eager at clear margins {margins}"


# ---------------------------------------------------------------------------------------------- CUDA, tiny models
# The CPU tests compile with dynamo's "eager" backend; these run what a CUDA user gets (inductor, CUDA graphs) on
# the tiny configs of conftest, float32: the sliding-window and hybrid models, the query-free scorers, and batches
# of several sizes against one compiled step. Inductor's fused float32 kernels round differently from eager ones,
# so where compiled and eager part, the eager run's top-2 margin there must be a float32 near-tie.
F32_NEAR_TIE = 1e-3
SLIDING_ARCHS = ["gemma2", "gemma3_text", "qwen2_sliding", "mistral_sliding"]
CUDA_SCORERS = {
    "default": lambda: {},
    "recency": lambda: {"scorer": hf_ropekv.RecencyScorer(), "sink": 2},
    "keynorm": lambda: {"scorer": hf_ropekv.KeyNormScorer()},
    "random": lambda: {"scorer": hf_ropekv.RandomScorer(seed=1), "window": 3},
    "global": lambda: {"selection": "global", "window": 2},
}


def _tiny_cuda(arch: str):
    return tiny_model(arch).cuda()


def _batch_on_cuda(vocab: int, lengths: tuple[int, ...], seed: int = 0):
    ids, mask = padded_batch(vocab, lengths=lengths, seed=seed)
    return ids.cuda(), mask.cuda()


def _compiled_matches_eager(model, ids, mask, options: dict, steps: int = 40, compactions: int = 3) -> int:
    """Eager growing cache against generate's own compilation of the static cache (twice, fresh caches); returns
    the number of graphs dynamo built."""
    eager_cache = RopeKVCache(model, **options)
    eager, scores = generate(model, eager_cache, ids, mask, steps, None)
    assert eager_cache.num_compactions >= compactions, "the check needs eviction inside the generation"
    outs = []
    for _ in range(2):
        cache = RopeKVCache(model, **options, static=True)
        outs.append(generate(model, cache, ids, mask, steps, CompileConfig(fullgraph=True))[0])
        assert cache.static and cache.num_compactions == eager_cache.num_compactions
    assert torch.equal(outs[1], outs[0]), "a second compiled call gave other tokens"
    margins = divergence_margins(eager, scores, outs[0])
    assert all(m <= F32_NEAR_TIE for m in margins), f"compiled parted from eager at clear margins {margins}"
    graphs = counters["stats"]["unique_graphs"]
    _graphed_matches_static_eager(model, ids, mask, options, steps)
    return graphs


def _graphed_matches_static_eager(model, ids, mask, options: dict, steps: int) -> None:
    """``cuda_graphs=True``: generate hands the decode steps to the graphed executor, which records one graph and
    replays eager's own kernels, so the tokens equal the eager static cache's exactly (no near-tie allowance)."""
    expected, _ = generate(model, RopeKVCache(model, **options, static=True), ids, mask, steps, None)
    cache = RopeKVCache(model, **options, static=True, cuda_graphs=True)
    got, _ = generate(model, cache, ids, mask, steps, CompileConfig(fullgraph=True))
    assert cache.cuda_graphs and graphed_steps(model).graphs_of(cache) == 1
    assert torch.equal(got, expected), "the graphed steps gave other tokens than the eager static cache"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:budget=16 evicts nothing")
@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_sliding_window_models_compiled_on_cuda(arch: str, deterministic_sdpa, fresh_dynamo) -> None:
    model = _tiny_cuda(arch)
    ids, mask = _batch_on_cuda(model.config.vocab_size, (11, 6, 3))
    # every layer of mistral_sliding is a window: nothing to compact, the windows roll
    graphs = _compiled_matches_eager(model, ids, mask, dict(budget=16, compress_every=4),
                                     compactions=0 if arch == "mistral_sliding" else 3)
    assert graphs == 1, f"{graphs} graphs for one decode step"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CUDA_SCORERS))
def test_query_free_scorers_compiled_on_cuda(name: str, deterministic_sdpa, fresh_dynamo) -> None:
    model = _tiny_cuda("llama")
    ids, mask = _batch_on_cuda(model.config.vocab_size, (12, 9, 6))
    _compiled_matches_eager(model, ids, mask, dict(budget=16, compress_every=4, **CUDA_SCORERS[name]()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dynamic_batch, sizes, expected", [
    ("auto", (3, 2, 5, 1, 16, 64), [1] * 6),
    (True, (1, 4, 2), [1] * 3),
    ("auto", (1, 1, 4, 2, 1, 8), [1, 1, 2, 2, 2, 2]),
    (False, (1, 1, 4), [1, 1, 2]),
])
def test_compiles_per_batch_size_on_cuda(dynamic_batch, sizes, expected, deterministic_sdpa, fresh_dynamo) -> None:
    """The dynamo graphs after each batch size at one budget, under inductor and CUDA graphs; each batch's tokens
    are the eager cache's. The batch dimension dynamic (``True``, or the default ``"auto"`` once a batch has had
    more than one row): one graph for 1 to 64 rows. ``"auto"`` from batch 1: that graph static, then one more at the
    first larger batch, which every later size (batch 1 included) reuses. ``False``: one graph per size until torch
    makes the dimension dynamic."""
    model = _tiny_cuda("llama")
    graphs = []
    for size in sizes:
        lengths = tuple(4 + (3 * row) % 7 for row in range(size))
        ids, mask = _batch_on_cuda(model.config.vocab_size, lengths, seed=size)
        options = dict(budget=16, compress_every=4)
        eager, scores = generate(model, RopeKVCache(model, **options), ids, mask, 32, None)
        cache = RopeKVCache(model, **options, static=True, dynamic_batch=dynamic_batch)
        got, _ = generate(model, cache, ids, mask, 32, CompileConfig(fullgraph=True))
        margins = divergence_margins(eager, scores, got)
        assert all(m <= F32_NEAR_TIE for m in margins), f"batch {size}: parted from eager at {margins}"
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == expected, f"graphs after each batch size: {graphs}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_steps_for_every_batch_size_on_cuda(deterministic_sdpa) -> None:
    """``cuda_graphs=True`` compiles nothing: one recording per cache at every batch size, 1 to 64 rows, each
    giving the eager static cache's tokens exactly."""
    model = _tiny_cuda("llama")
    for size in (3, 2, 5, 1, 16, 64):
        lengths = tuple(4 + (3 * row) % 7 for row in range(size))
        ids, mask = _batch_on_cuda(model.config.vocab_size, lengths, seed=size)
        _graphed_matches_static_eager(model, ids, mask, dict(budget=16, compress_every=4), 32)
    assert graphed_steps(model).recordings == 6
