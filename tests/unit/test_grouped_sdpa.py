"""The grouped-query sdpa a static cache attends with (``hf_ropekv.model.attention``): transformers' sdpa without
copying the key/value heads for masked queries (a decoding token, a prefill chunk). The switch a static cache makes
to it is checked in ``tests/integration/test_static_cache.py``."""

from __future__ import annotations

import pytest
import torch

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from hf_ropekv.model.attention import _fold_is_cheaper, grouped_sdpa

BATCH, HEADS, KV_HEADS, SLOTS, DIM = 3, 8, 2, 37, 16


class Attention(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def inputs(q_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, HEADS, q_len, DIM, generator=g), torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=g),
            torch.randn(BATCH, KV_HEADS, SLOTS, DIM, generator=g))


def masks(seed: int, q_len: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_row = torch.rand(BATCH, 1, q_len, SLOTS, generator=g) > 0.3
    per_head = torch.rand(BATCH, HEADS, q_len, SLOTS, generator=g) > 0.3
    per_row[..., -1] = per_head[..., -1] = True  # every row and head sees at least one slot
    noise = torch.randn(BATCH, 1, q_len, SLOTS, generator=g)
    additive = torch.where(per_row, 0.0, torch.finfo(torch.float32).min) + noise
    shared = torch.rand(1, 1, q_len, SLOTS, generator=g) > 0.3  # one mask for the whole batch
    shared[..., -1] = True
    return {"bool per row": per_row, "bool per head": per_head, "additive": additive, "one for the batch": shared}


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("kind", ["bool per row", "bool per head", "additive", "one for the batch"])
def test_masked_queries_equal_transformers_sdpa(kind: str, q_len: int) -> None:
    """A decoding token (1) and a prefill chunk (5): every query row sees its own mask row through the fold."""
    query, key, value = inputs(q_len, seed=1)
    mask = masks(seed=2, q_len=q_len)[kind]
    got, weights = grouped_sdpa(Attention(), query, key, value, mask, scaling=0.3)
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    assert weights is None and got.shape == expected.shape == (BATCH, q_len, HEADS, DIM)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_a_mask_broadcast_over_query_tokens_equals_transformers_sdpa() -> None:
    query, key, value = inputs(4, seed=5)
    mask = masks(seed=6)["bool per head"]  # [B, H, 1, S]: the same row for every token
    got, _ = grouped_sdpa(Attention(), query, key, value, mask)
    torch.testing.assert_close(got, sdpa_attention_forward(Attention(), query, key, value, mask)[0], atol=1e-6,
                               rtol=1e-5)


@pytest.mark.parametrize("case", ["no mask", "mask dearer than the key/value copy", "no groups"])
def test_every_other_call_is_transformers_sdpa(case: str) -> None:
    # Repeating an additive (float) mask for 80 query tokens costs more than repeat_kv's copy of 37 slots.
    query, key, value = inputs(80 if case == "mask dearer than the key/value copy" else 1, seed=3)
    mask = None if case == "no mask" else masks(seed=4, q_len=query.shape[2])["additive"]
    module = Attention()
    if case == "no groups":
        module.num_key_value_groups = 1
        key, value = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (key, value))
    if mask is not None:
        assert _fold_is_cheaper(query, key, mask, module.num_key_value_groups) == (case == "no groups")
    got, _ = grouped_sdpa(module, query, key, value, mask)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask)
    assert torch.equal(got, expected)
