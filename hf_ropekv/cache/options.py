"""The options of a :class:`~hf_ropekv.RopeKVCache`: the only place their defaults are written, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: Slots per storage page: capacity grows in whole pages.
PAGE_SIZE = 64
#: The seed of the tie-break noise (which depends on the token and head only, never on the batch).
SEED = 0
#: The default recent window, capped at a quarter of the budget: what measured best on GSM8K.
DEFAULT_WINDOW = 32


@dataclass(frozen=True)
class CacheOptions:
    """Every plain option of ``RopeKVCache`` (the scorer is an object, resolved by the cache). A wrong value gets a
    ``ValueError`` naming the option and the fix."""

    budget: int | None = None  # tokens kept per row, KV head and layer after a compaction; None: never evict
    compress_every: int = 128  # compact once this many tokens beyond the budget have accumulated
    # recent tokens never evicted; None: min(32, budget // 4), cut per row so that the scorer chooses at least 16
    # slots of the room beside a pinned prompt (half of it when the room is under 32)
    window: int | None = None
    sink: int = 0  # first tokens of each row never evicted
    protect_prompt: bool = True  # pin the prompt (every token before the first decoding step) within the budget
    # True: a fixed arena whose decode steps replay a CUDA graph on one CUDA device (generate compiles them on
    # several devices or ranks); False: growing layers, eager steps; "auto": static where graphs can run.
    static: bool | str = "auto"
    kv_bits: int | None = None  # 8: the kept keys and values in int8 with a scale per token and head

    def __post_init__(self) -> None:
        budget = self.budget
        if budget is not None and (not _is_int(budget) or budget < 1):
            raise ValueError(f"budget must be a positive int (tokens to keep) or None (never evict); got {budget!r}.")
        if not _is_int(self.compress_every) or self.compress_every < 1:
            raise ValueError(f"compress_every must be a positive int; got {self.compress_every!r}.")
        if self.window is not None and (not _is_int(self.window) or self.window < 0):
            raise ValueError(f"window must be an int >= 0 or None (the default); got {self.window!r}.")
        if not _is_int(self.sink) or self.sink < 0:
            raise ValueError(f"sink must be an int >= 0; got {self.sink!r}.")
        if budget is not None and self.recent_window + self.sink >= budget:
            raise ValueError(f"window ({self.recent_window}) + sink ({self.sink}) must be smaller than budget "
                             f"({budget}), or nothing is left to choose.")
        if not isinstance(self.protect_prompt, bool):
            raise ValueError(f"protect_prompt must be True or False; got {self.protect_prompt!r}.")
        if not (isinstance(self.static, bool) or self.static == "auto"):
            raise ValueError(
                f"static must be \"auto\" (the default: a fixed arena replaying CUDA graphs on one CUDA device, "
                f"else growing), True (always the fixed arena) or False (always growing, eager); got {self.static!r}.")
        if self.kv_bits not in (None, 8):
            raise ValueError(f"kv_bits must be None (16-bit keys and values) or 8 (int8 with scales); got "
                             f"{self.kv_bits!r}.")

    @property
    def recent_window(self) -> int:
        """``window`` if given, else ``min(32, budget // 4)`` (0 without a budget)."""
        if self.window is not None:
            return self.window
        return 0 if self.budget is None else min(DEFAULT_WINDOW, self.budget // 4)

    @property
    def steady_slots(self) -> int | None:
        """Slots a full-attention layer holds at most in steady state: ``budget + compress_every``."""
        return None if self.budget is None else self.budget + self.compress_every


#: The keyword options ``RopeKVCache`` and ``hf_ropekv.enable`` accept besides ``budget``.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CacheOptions) if f.name != "budget") + ("scorer",)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
