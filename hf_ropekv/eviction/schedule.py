"""When each batch row compacts, and what the layers then hold: a pure function of counts kept on the host.

Every row follows the schedule it would follow alone, so its output depends on nothing but its own tokens:

- it counts only its own real tokens (padding never counts toward the budget);
- during decoding, compactions happen on a clock that every row shares *and* would see alone: every
  ``compress_every`` decoding steps, starting with the first. At such a step each row holding more
  than ``budget`` real tokens comes back to ``budget``. A row that would exceed ``budget + compress_every``
  between ticks (possible only after a long multi-token forward) compacts at once;
- a multi-token forward (a prompt chunk, a later user turn) compacts the rows it would take past
  ``budget + compress_every``.

The clock is what is shared, deliberately: every row of a batch then compacts at the same steps, so a batch
pays for one scoring round per ``compress_every`` steps instead of one per row, and the count of decoding
steps is the same for a row alone and in any batch. Each row still holds at most ``budget +
compress_every`` real tokens.

transformers needs one key/value length per layer for the whole batch, so a row that holds fewer real tokens
than the longest sits right-aligned behind "holes" (slots the attention mask hides; a row's left padding is
its first holes). :meth:`RopeKVCache._attention_mask_for` builds that mask from the same plan.

Everything here is host arithmetic on Python ints: planning never synchronises with the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def row_target(kept: int, new: int, budget: int | None, compress_every: int, decode_step: int | None = None) -> int:
    """Real tokens a row holding ``kept`` keeps before ``new`` more arrive.

    ``decode_step``: for a single-token forward, how many decoding steps came before it (0, 1, 2, ...);
    ``None`` for a multi-token forward. The clock ticks when that count is a multiple of ``compress_every``:
    the same points as a chunked prefill with chunks of ``compress_every`` tokens, whose every chunk
    compacts what is over the budget. A chunk longer than ``compress_every`` (a long prompt that is not
    pinned) makes room for its own excess.
    """
    if budget is None:
        return kept
    if kept + new > budget + compress_every:
        return max(0, min(kept, budget - max(0, new - compress_every)))
    if new == 1 and decode_step is not None and decode_step % compress_every == 0 and kept + new > budget:
        return budget
    return kept


@dataclass(frozen=True)
class Plan:
    """One forward's compaction plan for the full-attention layers.

    Attributes:
        seen: tokens per row the cache had seen before this forward (padding included).
        new: tokens this forward appends.
        slots_before / slots_after: key/value slots per row before and after the compaction (same for every
            row, layer and head); ``slots_after == slots_before`` when nothing is compacted.
        kept_before / kept_after: real tokens each row holds before and after the compaction.
    """

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


def plan_forward(
    seen: int,
    new: int,
    slots: int,
    holes: tuple[int, ...],
    budget: int | None,
    compress_every: int,
    decode_step: int | None = None,
) -> Plan:
    """The plan of a forward appending ``new`` tokens to layers holding ``slots`` slots with ``holes`` per row.

    ``decode_step``: see :func:`row_target`.
    """
    kept = tuple(slots - h for h in holes)
    targets = tuple(row_target(k, new, budget, compress_every, decode_step) for k in kept)
    # Nothing stored yet (the first forward): nothing to compact, whatever the new tokens will need. (``holes``
    # then counts the left padding among the new tokens, so a padded row's ``kept`` is negative.)
    if targets == kept or slots == 0:
        return Plan(seen, new, slots, slots, kept, kept)
    # Some row compacts: every row then drops its holes, and the layers shrink to the longest row.
    return Plan(seen, new, slots, max(targets), kept, targets)
