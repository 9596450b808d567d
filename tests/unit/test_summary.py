"""CacheSummary: the numbers and the one line ``print(cache.summary())`` shows (no model involved)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import DynamicCache

from hf_ropekv import CacheSummary
from hf_ropekv.cache.summary import format_bytes


def summary(**fields) -> CacheSummary:
    values = dict(tokens_seen=1042, tokens_kept=299, num_compactions=12, bytes_held=3 * 2**20,
                  full_cache_bytes=12 * 2**20, budget=256, compress_every=64)
    return CacheSummary(**{**values, **fields})


def test_the_fields_are_the_documented_ones() -> None:
    assert [f.name for f in dataclasses.fields(CacheSummary)] == [
        "tokens_seen", "tokens_kept", "num_compactions", "bytes_held", "full_cache_bytes", "budget",
        "compress_every", "static"]
    assert summary().static is False  # the default of a summary made by hand


def test_one_line_with_the_bound_and_the_share_of_a_dynamic_cache() -> None:
    assert str(summary()) == (
        "RopeKVCache: kept 299 of 1,042 tokens (bound: budget 256 + compress_every 64 = 320), 12 compactions; "
        "KV 3.00 MiB held vs 12.00 MiB for a DynamicCache (25%)"
    )
    assert summary().bound == 320 and summary().bytes_fraction == 0.25
    one = summary(num_compactions=1, bytes_held=5 * 2**30, full_cache_bytes=4 * 2**30)
    assert "1 compaction;" in str(one) and "(125%)" in str(one) and "5.00 GiB held vs 4.00 GiB" in str(one)


def test_without_a_budget_or_bytes() -> None:
    unbounded = summary(tokens_seen=5, tokens_kept=5, num_compactions=0, bytes_held=0, full_cache_bytes=0,
                        budget=None, compress_every=128)
    assert unbounded.bound is None and unbounded.bytes_fraction is None
    assert str(unbounded) == (
        "RopeKVCache: kept 5 of 5 tokens (no budget: nothing is evicted), 0 compactions; KV 0 B held vs 0 B for a "
        "DynamicCache"
    )


@pytest.mark.parametrize("count, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536 * 1024, "1.50 MiB"),
                                         (2**30 - 1, "1024.00 MiB"), (5 * 2**40, "5120.00 GiB")])
def test_format_bytes(count: int, text: str) -> None:
    assert format_bytes(count) == text


def test_a_summary_is_frozen_and_made_of_a_rope_kv_cache_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary().tokens_kept = 1
    with pytest.raises(TypeError, match="needs a RopeKVCache, got DynamicCache"):
        CacheSummary.from_cache(DynamicCache())
