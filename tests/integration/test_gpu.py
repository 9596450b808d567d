"""The same contracts on a CUDA device, where the Triton kernels run compiled (skipped without CUDA).

Run on a GPU host with ``pytest -m gpu tests/``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import cache_kw, padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv.kernels.compact import compact_reference_, compact_triton_
from hf_ropekv.scorers.rope_scoring import query_weights, score_keys_weighted
from reference import run_and_compare

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(64, 9, 3), (128, 32, 8), (256, 8, 8)])
def test_score_kernel_matches_reference_on_cuda(dtype, head_dim: int, q_heads: int, kv_heads: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(head_dim + q_heads)
    storage = torch.randn(2, kv_heads, 3000, head_dim, device="cuda", dtype=dtype, generator=g)
    keys = storage[:, :, :2500]  # a strided view, as the cache hands it
    F = head_dim // 2
    q_mean = torch.complex(torch.randn(q_heads, F, device="cuda"), torch.randn(q_heads, F, device="cuda"))
    inv_freq = 1.0 / (10000 ** (torch.arange(F, device="cuda", dtype=torch.float32) / F))
    w, c = query_weights(q_mean, q_mean.abs() * 1.3, inv_freq, torch.tensor([777_777, 12], device="cuda"))
    out = torch.full((2, q_heads, 2500), float("nan"), device="cuda")
    got = score_keys_weighted(keys, w, c, backend="triton", out=out)
    want = score_keys_weighted(keys.float(), w, c, backend="torch")
    assert not got.isnan().any()
    err = (got - want).norm() / want.norm()
    assert err < 1e-4, err


@pytest.mark.parametrize("dtype", DTYPES)
def test_compaction_kernel_matches_reference_on_cuda(dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    keys = torch.randn(2, 8, 4096, 128, device="cuda", dtype=dtype, generator=g)
    values = torch.randn_like(keys)
    scores = torch.rand(2, 8, 4096, device="cuda", generator=g)
    keep = scores.topk(2048, dim=-1).indices.sort(-1).values
    # Poison the evicted slots: a kernel that reads a slot it should not copies NaN into the survivors.
    evicted = torch.ones(scores.shape, dtype=torch.bool, device="cuda").scatter_(-1, keep, False)
    for t in (keys, values):
        t.masked_fill_(evicted[..., None], float("nan"))
    expected = [t.clone() for t in (keys, values)]
    compact_reference_(expected, keep)
    compact_triton_((keys, values), keep)
    torch.cuda.synchronize()
    for got, want in zip((keys, values), expected):
        assert not got[:, :, :2048].isnan().any()
        assert torch.equal(got[:, :, :2048], want[:, :, :2048])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_eviction_matches_dynamic_cache_on_cuda(dtype, deterministic_sdpa) -> None:
    model = tiny_model("qwen3").to("cuda", dtype)
    ids, mask = padded_batch(model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    ref = model.generate(**cache_kw(model, DynamicCache(config=model.config)), **kw)
    out = model.generate(**cache_kw(model, RopeKVCache(model, budget=None)), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_eviction_matches_masked_reference_on_cuda(arch: str, attn: str, static: bool, deterministic_sdpa) -> None:
    """tests/integration/test_cache_eviction.py's contract with Triton scoring, compaction and (after the first
    eviction) the decode-attention kernel inside the cache, fp32 so the reference comparison stays tight: every
    layer attends to exactly the tokens it kept. The steps here are plain forwards: no graph, no compile."""
    overrides = dict(head_dim=64, hidden_size=256, num_hidden_layers=3) if arch == "llama" else {}
    model = tiny_model(arch, attn_implementation=attn, **overrides).to("cuda")
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4, static=static)
    run_and_compare(model, cache, [ids.cuda()], mask.cuda(), decode_steps=40, atol=1e-4)
    assert cache.num_compactions >= 8 and cache.evicted


def test_long_generation_stays_bounded_on_cuda() -> None:
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=64, compress_every=32, static=False)
    model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **cache_kw(model, cache), max_new_tokens=600,
                   do_sample=True, pad_token_id=0)
    assert cache.tokens_seen == ids.shape[1] + 599
    assert cache.tokens_kept <= 96 and cache.pages_allocated == 2 * model.config.num_hidden_layers
    assert cache.bytes_held < cache.full_cache_bytes / 5


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_describe_probes_a_cuda_models_rope_on_the_cpu(arch: str) -> None:
    """The RoPE probe runs on a CPU copy of the rotary module: no CUDA kernel (in a fresh process each would be loaded
    before the first token), the model's own module untouched, and the geometry the CPU model gives."""
    from hf_ropekv.model.geometry import describe

    model = tiny_model(arch).cuda()
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    before = {name: buffer.clone() for name, buffer in rotary.named_buffers()}
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        geometry = describe(model)
        torch.cuda.synchronize()
    launched = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA
                and not e.name.startswith(("Memcpy", "Memset"))]  # reading the buffers to the host is expected
    assert not launched, launched[:5]
    want = describe(tiny_model(arch))
    assert geometry.rotary_layout == want.rotary_layout
    assert torch.equal(geometry.inv_freq, want.inv_freq)
    for name, buffer in rotary.named_buffers():
        assert buffer.is_cuda and torch.equal(buffer, before[name])
