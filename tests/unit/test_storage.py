"""Paged storage of one layer (``hf_ropekv.storage.paged.PagedKV``) against plain tensors: what was appended, where
it lives after a compaction, how the arena grows (whole pages, up to the steady-state bound) and what it holds."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_ropekv.cache.options import PAGE_SIZE
from hf_ropekv.storage.paged import PagedKV, compact_arenas

B, H, D = 2, 3, 8


def tokens(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad (reused step views)", "autograd (plain slicing)"])
def test_appends_read_back_as_everything_appended(grad: bool) -> None:
    """Chunks then single tokens, across page boundaries and a truncation back to an earlier length (what a crop
    does): the live keys, values and positions are the appended ones, in order, as views of the arena."""
    gen = torch.Generator().manual_seed(0)
    storage = PagedKV(page_size=4, capacity_hint=12)
    keys, values = tokens(6, gen)
    storage.append(keys, values, first_position=0)
    with torch.set_grad_enabled(grad):
        for step in range(14):
            if storage.length == 11:
                storage.truncate(7)
                keys, values = keys[:, :, :7], values[:, :, :7]
            k, v = tokens(1, gen)
            got_k, got_v = storage.append(k, v, first_position=storage.length)
            keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
            assert torch.equal(got_k, keys) and torch.equal(got_v, values), step
            assert got_k.data_ptr() == storage.keys.data_ptr()  # a view of the arena, never a copy
    assert torch.equal(storage.live_keys(), keys)
    assert storage.live_positions().tolist() == [[list(range(storage.length))] * H] * B


def test_a_reallocated_arena_is_written_not_an_old_view_of_it() -> None:
    gen = torch.Generator().manual_seed(1)
    storage = PagedKV(page_size=4)
    with torch.no_grad():
        for _ in range(3):
            storage.append(*tokens(1, gen), first_position=storage.length)
        storage.select_batch(torch.tensor([1, 0]))  # a new arena (beam reorder)
        k, v = tokens(1, gen)
        got_k, _ = storage.append(k, v, first_position=3)
    assert torch.equal(storage.keys[:, :, 3:4], k) and got_k.data_ptr() == storage.keys.data_ptr()


def test_a_deep_copy_owns_its_arena() -> None:
    gen = torch.Generator().manual_seed(2)
    storage = PagedKV(page_size=4, capacity_hint=8)
    storage.append(*tokens(3, gen), first_position=0)
    with torch.no_grad():
        storage.append(torch.ones(B, H, 1, D), torch.ones(B, H, 1, D), 3)
    twin = copy.deepcopy(storage)
    storage.truncate(3)
    twin.truncate(3)
    with torch.no_grad():
        twin.append(torch.full((B, H, 1, D), 7.0), torch.full((B, H, 1, D), 7.0), 3)
    assert float(storage.keys[0, 0, 3, 0]) == 1.0 and float(twin.keys[0, 0, 3, 0]) == 7.0


def test_compaction_moves_survivors_to_the_front_with_their_positions() -> None:
    """Each (row, head) keeps its own ascending slots; with ``start`` a row's survivors are right-aligned behind
    holes whose position reads -1."""
    gen = torch.Generator().manual_seed(3)
    storage, other = PagedKV(page_size=4), PagedKV(page_size=4)
    keys, values = tokens(10, gen)
    for arena in (storage, other):
        arena.append(keys, values, first_position=5)  # tokens 5..14 (left padding of 5 in generate's indexing)
    keep = torch.stack([torch.stack([torch.randperm(10, generator=gen)[:6].sort().values for _ in range(H)])
                        for _ in range(B)])
    compact_arenas([storage, other], keep)
    want = torch.gather(keys, 2, keep[..., None].expand(-1, -1, -1, D))
    for arena in (storage, other):
        assert arena.length == 6 and arena.num_compactions == 1
        assert torch.equal(arena.live_keys(), want)
        assert torch.equal(arena.live_positions(), keep + 5)
    # Row 1 keeps 2 tokens only: right-aligned in 4 slots behind 2 holes.
    keep2 = torch.full((B, H, 4), -1)
    keep2[0] = torch.tensor([0, 2, 3, 5])
    keep2[1, :, 2:] = torch.tensor([1, 4])
    before = storage.live_keys().clone()
    compact_arenas([storage], keep2, torch.tensor([0, 2]))
    assert storage.length == 4
    assert torch.equal(storage.live_keys()[0], before[0][:, [0, 2, 3, 5]])
    assert torch.equal(storage.live_keys()[1, :, 2:], before[1][:, [1, 4]])
    assert storage.live_positions()[1, :, :2].eq(-1).all()
    assert torch.equal(storage.live_positions()[1, :, 2:], (keep + 5)[1][:, [1, 4]])


def test_the_arena_grows_in_pages_up_to_the_bound_and_gives_back_a_long_prefill() -> None:
    """Whole pages while filling; never past ``capacity_hint`` (budget + compress_every) unless one forward needs
    more; a compaction back under the bound shrinks a prefill's larger arena to it."""
    gen = torch.Generator().manual_seed(4)
    storage = PagedKV(page_size=PAGE_SIZE, capacity_hint=100)
    assert storage.capacity == storage.pages_allocated == storage.bytes_held == 0
    storage.append(*tokens(3, gen), first_position=0)
    assert storage.capacity == PAGE_SIZE and storage.pages_allocated == storage.pages_in_use == 1
    storage.append(*tokens(PAGE_SIZE, gen), first_position=3)
    assert storage.capacity == 100 and storage.pages_allocated == 2  # the second page cut to the bound
    storage.append(*tokens(200, gen), first_position=3 + PAGE_SIZE)  # one forward longer than the bound
    assert storage.capacity == 5 * PAGE_SIZE and storage.length == 267
    keep = torch.arange(0, 267, 2)[:90].expand(B, H, 90)
    compact_arenas([storage], keep)
    assert storage.capacity == 100 and storage.length == 90
    assert storage.live_positions()[0, 0].tolist() == list(range(0, 267, 2))[:90]
    element = torch.empty((), dtype=torch.float32).element_size()
    assert storage.bytes_held == 2 * B * H * 100 * D * element + B * H * 100 * 8  # keys, values, int64 positions


def test_positions_cost_nothing_until_they_are_read() -> None:
    """A layer that never compacts holds keys and values only: no int64 position per slot."""
    gen = torch.Generator().manual_seed(5)
    storage = PagedKV(page_size=4)
    storage.append(*tokens(5, gen), first_position=0)
    element = torch.empty((), dtype=torch.float32).element_size()
    assert storage.bytes_held == 2 * B * H * 8 * D * element
    storage.live_positions()
    assert storage.bytes_held == 2 * B * H * 8 * D * element + B * H * 8 * 8


def test_rows_follow_select_and_repeat() -> None:
    gen = torch.Generator().manual_seed(6)
    storage = PagedKV(page_size=4)
    keys, values = tokens(5, gen)
    storage.append(keys, values, first_position=2)
    storage.select_batch(torch.tensor([1, 1, 0]))
    assert torch.equal(storage.live_keys(), keys[[1, 1, 0]])
    storage.repeat_batch(2)
    assert torch.equal(storage.live_keys(), keys[[1, 1, 1, 1, 0, 0]])
    assert storage.live_positions().shape == (6, H, 5) and storage.live_positions()[5, 2].tolist() == [2, 3, 4, 5, 6]
    storage.clear()
    assert storage.keys is None and storage.length == 0 and storage.bytes_held == 0
