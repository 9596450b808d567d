"""The model's RMSNorms in one kernel each, in the forwards of a cache that evicted (``hf_ropekv.model.fused_norms``).

On the CPU the kernel runs under Triton's interpreter where the product keeps it to CUDA (``runs_the_kernel`` is
patched to accept CPU tensors), so the wiring is tested here: which modules are taken, that nothing changes before the
first compaction (``DynamicCache``'s logits bit for bit), that every norm of a later forward runs the kernel with the
eager norm's result (float32: to a few units in the last place), and that the instance forwards go with the hooks and
never travel with a copy of the model. The ``gpu`` test decodes a bf16 model with the default cache, graphed.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import DynamicCache

from conftest import cache_kw, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv.kernels import rms_norm as kernel
from hf_ropekv.model import fused_norms
from hf_ropekv.model.fused_norms import fusable_norms


@pytest.fixture
def kernel_on_cpu(triton_interpreter, monkeypatch):
    """Norms of CPU tensors run the interpreted kernel; returns the list of the kernel's calls (their row lengths)."""
    calls = []
    real = kernel.rms_norm

    def counted(x, weight, eps, out=None):
        calls.append(x.shape[-1])
        return real(x, weight, eps, out)

    monkeypatch.setattr(fused_norms, "runs_the_kernel", lambda tensor: True)
    monkeypatch.setattr(fused_norms, "rms_norm", counted)
    return calls


def _norm_count(model) -> int:
    layers = model.config.num_hidden_layers
    return layers * 4 + 1  # Qwen3: input, post-attention, query and key norms per layer, and the final norm


def test_the_llama_rms_norm_families_are_taken_and_others_not() -> None:
    qwen3 = tiny_model("qwen3")
    assert len(fusable_norms(qwen3)) == _norm_count(qwen3)
    assert len(fusable_norms(tiny_model("llama"))) == 2 * tiny_model("llama").config.num_hidden_layers + 1
    # Gemma scales by (1 + weight), in float32 before it rounds: not the Llama norm.
    assert fusable_norms(tiny_model("gemma2")) == []
    assert fusable_norms(tiny_model("gemma3_text")) == []


def _logits(model, cache, ids, steps: int) -> list[torch.Tensor]:
    """Logits of a prefill then ``steps`` greedy one-token forwards."""
    out, logits = model(ids, **cache_kw(model, cache), use_cache=True), []
    for _ in range(steps):
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(nxt, **cache_kw(model, out.past_key_values if cache is None else cache), use_cache=True)
    return logits


def test_nothing_runs_the_kernel_before_the_first_compaction(kernel_on_cpu) -> None:
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(int(torch.seed()) % 2**31))
    with torch.no_grad():
        expected = _logits(model, DynamicCache(config=model.config), ids, 6)
        got = _logits(model, RopeKVCache(model, budget=None, static=False), ids, 6)
    assert kernel_on_cpu == []
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("static", [False, True])
def test_after_a_compaction_every_norm_runs_the_kernel_with_the_eager_result(kernel_on_cpu, monkeypatch,
                                                                             static) -> None:
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(int(torch.seed()) % 2**31))
    with torch.no_grad():
        fused_cache = RopeKVCache(model, budget=8, compress_every=4, protect_prompt=False, static=static)
        fused = _logits(model, fused_cache, ids, 8)
        calls = len(kernel_on_cpu)
        monkeypatch.setattr(fused_norms, "runs_the_kernel", lambda tensor: False)  # the eager norms, same cache
        plain = _logits(model, RopeKVCache(model, budget=8, compress_every=4, protect_prompt=False, static=static),
                        ids, 8)
    assert len(kernel_on_cpu) == calls
    assert fused_cache.num_compactions > 0
    # Both compact the 20-token prompt at the first decoding step: the static cache before the forward (all of its
    # norms fused), the growing one at its first layer's update, so that forward keeps the eager norms.
    assert calls == (8 if static else 7) * _norm_count(model)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_forwards_go_with_the_hooks_and_never_with_a_copy(kernel_on_cpu) -> None:
    model = tiny_model("qwen3")
    cache = RopeKVCache(model, budget=8, protect_prompt=False)
    norms = fusable_norms(model)
    assert all(isinstance(vars(m).get("forward"), fused_norms._NormForward) for m in norms)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin_norms = fusable_norms(twin)
        assert not any(isinstance(vars(m).get("forward"), fused_norms._NormForward) for m in twin_norms)
        x = torch.randn(3, twin_norms[0].weight.shape[0])
        assert torch.equal(twin_norms[0](x), type(twin_norms[0]).forward(twin_norms[0], x))
    del cache
    import gc

    gc.collect()
    assert not any("forward" in vars(m) for m in norms)


@pytest.mark.gpu
def test_the_default_cache_decodes_with_the_kernel_norms_on_cuda(deterministic_sdpa) -> None:
    """bf16, graphed: the kernel runs once tokens are evicted, and the tokens equal those of the same cache with the
    eager norms up to a near-tie of the eager run's logits."""
    model = tiny_model("qwen3", num_hidden_layers=4).to("cuda", torch.bfloat16)
    ids = torch.randint(3, 128, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)

    def run(fused: bool):
        cache = RopeKVCache(model, budget=24, protect_prompt=False)
        saved = fused_norms.runs_the_kernel
        fused_norms.runs_the_kernel = (lambda t: t.is_cuda) if fused else (lambda t: False)
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                                 **cache_kw(model, cache))
        finally:
            fused_norms.runs_the_kernel = saved
        return out.sequences[:, ids.shape[1]:], out.scores, cache

    plain, scores, _ = run(False)
    fused, _, cache = run(True)
    assert cache.num_compactions > 0
    for row in range(plain.shape[0]):
        differ = (plain[row] != fused[row]).nonzero()
        if differ.numel():
            top2 = scores[int(differ[0])][row].float().topk(2).values
            assert float(top2[0] - top2[1]) < 0.25, f"row {row} parted at a clear margin"
