"""A static cache's decode steps, however they run, give the eager static cache's tokens, with eviction.

Formerly ``benchmarks/static_exactness.py``. The same left-padded batch is decoded by the static cache eagerly
(``disable_compile=True``), by the growing cache (``static=False``), and by the static cache the way generate runs
it: on one CUDA device replayed CUDA graphs of the eager step (the default, ``static="auto"``), which run eager's
own kernels and must give its tokens exactly; where a graph cannot hold the model, generate's own compilation
(``fullgraph=True``: a graph break is an error), twice with fresh caches, the second compiling nothing new.

On the CPU (``compile``: float32, dynamo's eager backend) every run must agree token for token. On CUDA (``gpu``:
bf16, inductor with CUDA graphs, cuDNN sdpa off) compiled and eager may part only at a near-tie of the eager run's
logits: bf16 rounding differs between inductor's fused kernels and eager ones (on an H200 the recorded margins were
0.03-0.11, benchmarks/results/static_exactness_2026-12-01_06141d2). The compiled path is forced on one GPU by the
attachment's capturability check (private: ``hf_ropekv.adapter.attach.not_capturable``), as a model split over
devices would be.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import CompileConfig

from conftest import cache_kw, compiled, padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv.scorers import KeyNormScorer, RandomScorer, RecencyScorer
from test_check_exactness import QWEN3_1_7B, TINY_QWEN3, left_padded, random_qwen3

BF16_NEAR_TIE = 0.25  # a few bf16 ulps of logits around 10: what a different summation order can flip
F32_NEAR_TIE = 1e-3


def generate(model, cache, ids, mask, steps: int, compile_config: CompileConfig | None = None,
             eager: bool = False) -> tuple[torch.Tensor, list]:
    """Greedy tokens and per-step scores: eager (``eager=True``), generate's default, or its compilation."""
    extra: dict[str, Any] = {"disable_compile": True} if eager else {}
    if compile_config is not None:
        extra["compile_config"] = compile_config
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                         **cache_kw(model, cache), **extra)
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


@pytest.fixture
def compiled_steps(monkeypatch):
    """Static caches built in the test decode through generate's compilation, not CUDA graphs (see the docstring)."""
    from hf_ropekv.adapter import attach

    monkeypatch.setattr(attach, "not_capturable", lambda model, device: "a model a CUDA graph cannot hold (test)")


def compiled_twice(model, ids, mask, options, steps, config, counters) -> tuple[torch.Tensor, torch.Tensor]:
    """generate's compilation of two fresh static caches: their tokens; the second compiles nothing new."""
    first, _ = generate(model, RopeKVCache(model, **options, static=True), ids, mask, steps, config)
    graphs = counters["stats"]["unique_graphs"]
    second, _ = generate(model, RopeKVCache(model, **options, static=True), ids, mask, steps, config)
    assert graphs >= 1, "generate did not compile the static cache's decode step"
    assert counters["stats"]["unique_graphs"] == graphs, "a fresh static cache compiled again"
    return first, second


@pytest.mark.compile
def test_compiled_static_cache_matches_eager_on_cpu(fresh_dynamo) -> None:
    model = random_qwen3(TINY_QWEN3, torch.float32, "cpu")
    ids, mask = left_padded(2, 24, TINY_QWEN3["vocab_size"], "cpu")
    options = dict(budget=16, compress_every=4, protect_prompt=False)
    eager, _ = generate(model, RopeKVCache(model, **options, static=True), ids, mask, 24, eager=True)
    growing_cache = RopeKVCache(model, **options)
    growing, _ = generate(model, growing_cache, ids, mask, 24)
    assert growing_cache.num_compactions >= 2, "the check needs eviction inside the generation"
    first, second = compiled_twice(model, ids, mask, options, 24, compiled(), fresh_dynamo)
    assert torch.equal(growing, eager) and torch.equal(first, eager) and torch.equal(second, eager)


@pytest.mark.gpu
@pytest.mark.compile
def test_static_cache_at_qwen3_1_7b_on_cuda(deterministic_sdpa, fresh_dynamo, monkeypatch) -> None:
    """The default cache (static, graphs) gives the eager static cache's tokens exactly; so does the growing cache;
    the compiled path parts from eager only at bf16 near-ties and repeats itself."""
    model = random_qwen3(QWEN3_1_7B, torch.bfloat16, "cuda")
    ids, mask = left_padded(4, 1024, QWEN3_1_7B["vocab_size"], "cuda")
    options = dict(budget=1024, compress_every=64, protect_prompt=False)
    eager, scores = generate(model, RopeKVCache(model, **options, static=True), ids, mask, 256, eager=True)
    growing_cache = RopeKVCache(model, **options, static=False)
    growing, _ = generate(model, growing_cache, ids, mask, 256)
    assert growing_cache.num_compactions >= 2
    default_cache = RopeKVCache(model, **options)
    default, _ = generate(model, default_cache, ids, mask, 256)
    # Two graphs: the steps before the first eviction (sdpa, exact) and those after it (the decode kernel).
    assert default_cache.static and vars(model)["get_compiled_call"].graphed.graphs_of(default_cache) == 2
    parts = "eager top-2 margins where they part:"
    assert torch.equal(default, eager), f"graphed != eager ({parts} {divergence_margins(eager, scores, default)})"
    assert torch.equal(growing, eager), f"growing != eager ({parts} {divergence_margins(eager, scores, growing)})"
    from hf_ropekv.adapter import attach

    monkeypatch.setattr(attach, "not_capturable", lambda model, device: "a model a CUDA graph cannot hold (test)")
    first, second = compiled_twice(model, ids, mask, options, 256, CompileConfig(fullgraph=True), fresh_dynamo)
    assert torch.equal(second, first)
    margins = divergence_margins(eager, scores, first)
    assert all(m <= BF16_NEAR_TIE for m in margins), f"compiled parted from eager at clear margins {margins}"


# ---------------------------------------------------------------------------------------------- CUDA, tiny models
# What a CUDA user gets on the tiny configs of conftest, float32: the sliding-window and hybrid models, the
# query-free scorers, batches of several sizes. Graphed steps must give the eager static cache's tokens exactly;
# compiled ones may part from eager only at a float32 near-tie of its logits.
SLIDING_ARCHS = ["gemma2", "gemma3_text", "qwen2_sliding", "mistral_sliding"]
CUDA_SCORERS = {
    "default": lambda: {},
    "recency": lambda: {"scorer": RecencyScorer(), "sink": 2},
    "keynorm": lambda: {"scorer": KeyNormScorer()},
    "random": lambda: {"scorer": RandomScorer(seed=1), "window": 3},
}


def _on_cuda(vocab: int, lengths: tuple[int, ...], seed: int = 0):
    ids, mask = padded_batch(vocab, lengths=lengths, seed=seed)
    return ids.cuda(), mask.cuda()


def graphed_matches_eager(model, ids, mask, options: dict, steps: int = 40) -> None:
    """The default cache on one GPU: graphed steps, two recordings (before the first eviction and after it), the
    eager static cache's tokens exactly."""
    expected, _ = generate(model, RopeKVCache(model, **options, static=True), ids, mask, steps, eager=True)
    cache = RopeKVCache(model, **options)
    got, _ = generate(model, cache, ids, mask, steps)
    recordings = 2 if cache.num_compactions else 1  # a model whose layers all slide never evicts
    assert cache.static and vars(model)["get_compiled_call"].graphed.graphs_of(cache) == recordings
    assert torch.equal(got, expected), "the graphed steps gave other tokens than the eager static cache"


def compiled_matches_eager(model, ids, mask, options: dict, counters, steps: int = 40, compactions: int = 3) -> None:
    eager_cache = RopeKVCache(model, **options, static=False)
    eager, scores = generate(model, eager_cache, ids, mask, steps)
    assert eager_cache.num_compactions >= compactions, "the check needs eviction inside the generation"
    first, second = compiled_twice(model, ids, mask, options, steps, CompileConfig(fullgraph=True), counters)
    assert torch.equal(second, first), "a second compiled call gave other tokens"
    margins = divergence_margins(eager, scores, first)
    assert all(m <= F32_NEAR_TIE for m in margins), f"compiled parted from eager at clear margins {margins}"
    # At most two graphs: the steps before the first eviction (sdpa) and those after it (the decode kernel).
    assert counters["stats"]["unique_graphs"] <= 2, "more graphs than the decode step's two attention paths"


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:budget=16 evicts nothing")
@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_sliding_window_models_graphed_on_cuda(arch: str, deterministic_sdpa) -> None:
    model = tiny_model(arch).cuda()
    ids, mask = _on_cuda(model.config.vocab_size, (11, 6, 3))
    graphed_matches_eager(model, ids, mask, dict(budget=16, compress_every=4))


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:budget=16 evicts nothing")
@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_sliding_window_models_compiled_on_cuda(arch: str, deterministic_sdpa, fresh_dynamo, compiled_steps) -> None:
    model = tiny_model(arch).cuda()
    ids, mask = _on_cuda(model.config.vocab_size, (11, 6, 3))
    # every layer of mistral_sliding is a window: nothing to compact, the windows roll
    compiled_matches_eager(model, ids, mask, dict(budget=16, compress_every=4), fresh_dynamo,
                           compactions=0 if arch == "mistral_sliding" else 3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_SCORERS))
def test_query_free_scorers_graphed_on_cuda(name: str, deterministic_sdpa) -> None:
    model = tiny_model("llama").cuda()
    ids, mask = _on_cuda(model.config.vocab_size, (12, 9, 6))
    graphed_matches_eager(model, ids, mask, dict(budget=16, compress_every=4, **CUDA_SCORERS[name]()))


@pytest.mark.gpu
def test_a_growing_caches_logits_do_not_hang_on_a_static_cache_beside_it_on_cuda(deterministic_sdpa) -> None:
    """A growing cache attends the same way (the decode kernel once it evicted) whether or not a static cache of its
    model is alive: the same logits, bit for bit, alone and beside one (before 74b6aca: sdpa alone, the kernel
    beside a static cache)."""
    model = tiny_model("llama").cuda()
    ids, mask = _on_cuda(model.config.vocab_size, (12, 9, 6))

    def growing_logits() -> torch.Tensor:
        cache = RopeKVCache(model, budget=16, compress_every=4, static=False)
        _, scores = generate(model, cache, ids, mask, 24)
        assert cache.num_compactions >= 2, "the check needs eviction inside the generation"
        return torch.stack(scores)

    alone = growing_logits()
    beside = RopeKVCache(model, budget=16, compress_every=4, static=True)  # attached to the model, never used
    assert torch.equal(growing_logits(), alone), "a static cache alive beside it changed a growing cache's logits"
    del beside


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(CUDA_SCORERS))
def test_query_free_scorers_compiled_on_cuda(name: str, deterministic_sdpa, fresh_dynamo, compiled_steps) -> None:
    model = tiny_model("llama").cuda()
    ids, mask = _on_cuda(model.config.vocab_size, (12, 9, 6))
    compiled_matches_eager(model, ids, mask, dict(budget=16, compress_every=4, **CUDA_SCORERS[name]()), fresh_dynamo)


@pytest.mark.gpu
def test_graphed_steps_for_every_batch_size_on_cuda(deterministic_sdpa) -> None:
    """No compile: two recordings per cache (before and after the first eviction) at every batch size, 1 to 64
    rows, each giving the eager static cache's tokens exactly; the last cache gone, the model is as it was."""
    model = tiny_model("llama").cuda()
    for size in (3, 2, 5, 1, 16, 64):
        lengths = tuple(4 + (3 * row) % 7 for row in range(size))
        ids, mask = _on_cuda(model.config.vocab_size, lengths, seed=size)
        graphed_matches_eager(model, ids, mask, dict(budget=16, compress_every=4), 32)
    assert "get_compiled_call" not in vars(model)  # the last cache gone, its graphs and wrappers went with it
