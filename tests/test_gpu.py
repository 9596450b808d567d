"""The same contracts on a CUDA device, where the Triton kernels run compiled (skipped without CUDA).

Run on a GPU host with ``pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv.kernels.compact import compact_reference_, compact_triton_
from hf_ropekv.scorers.rope_scoring import query_weights, score_keys_weighted
from test_cache_eviction import run_and_compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

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
    expected = [t.clone() for t in (keys, values)]
    compact_reference_(expected, keep)
    compact_triton_((keys, values), keep)
    torch.cuda.synchronize()
    for got, want in zip((keys, values), expected):
        assert torch.equal(got[:, :, :2048], want[:, :, :2048])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_eviction_matches_dynamic_cache_on_cuda(dtype, deterministic_sdpa) -> None:
    model = tiny_model("qwen3").to("cuda", dtype)
    ids, mask = padded_batch(model.config.vocab_size)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    ref = model.generate(past_key_values=DynamicCache(config=model.config), **kw)
    out = model.generate(past_key_values=RopeKVCache(model, budget=None), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_eviction_matches_masked_reference_on_cuda() -> None:
    """Triton scoring and compaction inside the cache, fp32 so the reference comparison stays tight."""
    model = tiny_model("llama", head_dim=64, hidden_size=256, num_attention_heads=4).to("cuda")
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4)
    run_and_compare(model, cache, [ids.cuda()], mask.cuda(), decode_steps=40, atol=1e-4)
    assert cache.num_compactions >= 8


def test_long_generation_stays_bounded_on_cuda() -> None:
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=64, compress_every=32)
    model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache, max_new_tokens=600,
                   do_sample=True, pad_token_id=0)
    assert cache.tokens_seen == ids.shape[1] + 599
    assert cache.tokens_kept <= 96 and cache.pages_allocated == 2 * len(cache._full_layers)
