"""When each batch row compacts, and what the layers then hold: host arithmetic on Python ints, never a GPU sync.

A row counts only its own real tokens, so it follows the schedule it would follow alone. Decoding compacts on a
clock all rows share (every ``compress_every`` steps, from the first): each row above ``budget`` comes back to it,
so a batch pays one scoring round per ``compress_every`` steps. A row that would exceed ``budget + compress_every``
(after a long multi-token forward) compacts at once. Rows holding fewer real tokens than the longest sit
right-aligned behind "holes" (slots the attention mask hides; a row's left padding is its first holes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def row_target(kept: int, new: int, budget: int | None, compress_every: int, decode_step: int | None = None) -> int:
    """Real tokens a row holding ``kept`` keeps before ``new`` more arrive. ``decode_step``: decoding steps before
    this single-token forward (the clock ticks at multiples of ``compress_every``), ``None`` for a multi-token one;
    a chunk longer than ``compress_every`` makes room for its own excess."""
    if budget is None:
        return kept
    if kept + new > budget + compress_every:
        return max(0, min(kept, budget - max(0, new - compress_every)))
    if new == 1 and decode_step is not None and decode_step % compress_every == 0 and kept + new > budget:
        return budget
    return kept


@dataclass(frozen=True)
class Plan:
    """One forward's compaction plan for the full-attention layers: tokens per row ``seen`` before it (padding
    included) and ``new`` in it, slots per row before and after the compaction (the same for every row, layer and
    head), and real tokens each row holds before and after it."""

    seen: int
    new: int
    slots_before: int
    slots_after: int
    kept_before: tuple[int, ...]
    kept_after: tuple[int, ...]

    @cached_property  # read by every layer of every forward
    def compacts(self) -> bool:
        return self.slots_after != self.slots_before or self.kept_after != self.kept_before

    @property
    def holes_after(self) -> tuple[int, ...]:
        """Slots in front of each row's real tokens after the compaction."""
        return tuple(self.slots_after - kept for kept in self.kept_after)

    @property
    def evicting_rows(self) -> tuple[int, ...]:
        """Rows that drop real tokens in this compaction."""
        return tuple(r for r, (a, b) in enumerate(zip(self.kept_after, self.kept_before)) if a < b)


def plan_forward(seen: int, new: int, slots: int, holes: tuple[int, ...], budget: int | None, compress_every: int,
                 decode_step: int | None = None) -> Plan:
    """The plan of a forward appending ``new`` tokens to layers of ``slots`` slots with ``holes`` per row."""
    kept = tuple(slots - h for h in holes)
    targets = tuple(row_target(k, new, budget, compress_every, decode_step) for k in kept)
    # Nothing stored yet (the first forward; a padded row's ``kept`` is then negative): nothing to compact.
    if targets == kept or slots == 0:
        return Plan(seen, new, slots, slots, kept, kept)
    # Some row compacts: every row drops its holes, and the layers shrink to the longest row.
    return Plan(seen, new, slots, max(targets), kept, targets)
