"""The compaction plan (hf_ropekv.eviction.schedule): the bound, the shared decoding clock, rows on their own counts."""

from __future__ import annotations

import random

from hf_ropekv.eviction.schedule import plan_forward, row_target


def simulate(prompt: int, steps: int, budget: int, every: int) -> list[int]:
    """Real tokens one row holds after each decoding step, decided by row_target alone."""
    kept, history = prompt, []
    for step in range(steps):
        kept = row_target(kept, 1, budget, every, step) + 1
        history.append(kept)
    return history


def test_a_row_never_holds_more_than_budget_plus_compress_every() -> None:
    rng = random.Random(0)
    for _ in range(200):
        budget, every = rng.randint(1, 40), rng.randint(1, 20)
        prompt = rng.randint(0, budget)
        history = simulate(prompt, 300, budget, every)
        assert max(history) <= budget + every
        assert history[-1] >= min(budget, prompt + 300)  # never below the budget once it got there


def test_decoding_compacts_on_the_shared_clock_only() -> None:
    # Every 4 decoding steps (after 0, 4, 8, ... earlier steps), rows above the budget come back to it; other
    # steps never compact.
    assert row_target(19, 1, 16, 4, decode_step=4) == 16
    assert row_target(19, 1, 16, 4, decode_step=0) == 16
    assert row_target(19, 1, 16, 4, decode_step=5) == 19
    assert row_target(15, 1, 16, 4, decode_step=8) == 15  # at or under the budget after the new token: nothing
    # Past budget + compress_every between ticks (after a long turn), a row compacts at once.
    assert row_target(20, 1, 16, 4, decode_step=3) == 16


def test_multi_token_forwards_compact_rows_they_would_take_past_the_bound() -> None:
    assert row_target(10, 6, 16, 4) == 10
    assert row_target(15, 6, 16, 4) == 16 - 2  # room for the chunk's own excess over compress_every
    assert row_target(0, 100, 16, 4) == 0


def test_plan_layout_and_holes() -> None:
    plan = plan_forward(seen=30, new=1, slots=19, holes=(0, 5, 2), budget=16, compress_every=4, decode_step=8)
    assert plan.kept_before == (19, 14, 17)
    assert plan.kept_after == (16, 14, 16) and plan.slots_after == 16
    assert plan.holes_after == (0, 2, 0) and plan.evicting_rows == (0, 2)
    idle = plan_forward(seen=30, new=1, slots=19, holes=(0, 5, 2), budget=16, compress_every=4, decode_step=7)
    assert not idle.compacts and idle.slots_after == 19
    assert plan_forward(30, 1, 19, (0, 5, 2), None, 4, 8).compacts is False


def test_a_first_forward_longer_than_the_bound_compacts_nothing() -> None:
    # An unpinned prompt of 64 tokens, one row with 7 left pads: nothing is stored yet, so nothing is compacted
    # (this used to plan a compaction of the empty layers and crash); the next forward brings the rows back.
    plan = plan_forward(seen=0, new=64, slots=0, holes=(0, 7), budget=16, compress_every=4)
    assert not plan.compacts and plan.slots_after == 0 and plan.holes_after == (0, 7)
    after = plan_forward(seen=64, new=1, slots=64, holes=(0, 7), budget=16, compress_every=4, decode_step=0)
    assert after.kept_after == (16, 16) and after.slots_after == 16
