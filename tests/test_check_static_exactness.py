"""``RopeKVCache(static=True)`` compiled by ``generate`` gives the eager static cache's tokens, with eviction.

Formerly ``benchmarks/static_exactness.py``. The same left-padded batch is decoded by: the static cache eagerly
(``disable_compile=True``), the growing default cache (``static=False``), and the static cache compiled by
generate itself (``fullgraph=True``: a graph break is an error), twice with fresh caches. On the CPU (float32,
dynamo with the eager backend) all four must agree token for token and the second compiled call must not
compile again. On CUDA (``gpu``; bf16, inductor with CUDA graphs, cuDNN sdpa off) the growing and the eager
static caches must agree, the second compiled call must repeat the first, and where compiled and eager part it
must be at a near-tie of the eager run's logits: bf16 rounding differs between inductor's fused kernels and eager
ones (on an H200 the recorded margins were 0.03-0.11, benchmarks/results/static_exactness_2026-12-01_06141d2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg
from test_check_exactness import QWEN3_1_7B, TINY_QWEN3, left_padded, random_qwen3

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
