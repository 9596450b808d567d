"""A snapshot of what a :class:`RopeKVCache` kept, in numbers and in one line of text.

    print(cache.summary())  # RopeKVCache: kept 318 of 702 tokens (bound: budget 256 + compress_every 64 = 320), ...

``hf_ropekv.last_summary(model)`` gives the one taken when a ``generate()`` call of an enabled model returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CacheSummary"]


@dataclass(frozen=True)
class CacheSummary:
    """What a :class:`RopeKVCache` held at one moment: the cache properties of the same names (counts per row,
    bytes for the whole batch), its ``budget`` and ``compress_every``, and whether it was ``static``."""

    tokens_seen: int
    tokens_kept: int
    num_compactions: int
    bytes_held: int  # the arenas (sized in whole pages) and the slot positions
    full_cache_bytes: int  # what a DynamicCache would hold for the same tokens
    budget: int | None
    compress_every: int
    static: bool = False

    @classmethod
    def from_cache(cls, cache: Any) -> "CacheSummary":
        if not hasattr(cache, "num_compactions"):
            raise TypeError(f"CacheSummary.from_cache needs a RopeKVCache, got {type(cache).__name__}. For a "
                            "DynamicCache, sum the bytes of its layers' keys and values.")
        same = ("tokens_seen", "tokens_kept", "num_compactions", "bytes_held", "full_cache_bytes", "static")
        return cls(budget=cache.options.budget, compress_every=cache.options.compress_every,
                   **{name: getattr(cache, name) for name in same})

    @property
    def bound(self) -> int | None:
        """Most tokens a full-attention layer holds per row and KV head: ``budget + compress_every``."""
        return None if self.budget is None else self.budget + self.compress_every

    @property
    def bytes_fraction(self) -> float | None:
        """``bytes_held / full_cache_bytes``; ``None`` before the cache holds anything."""
        return self.bytes_held / self.full_cache_bytes if self.full_cache_bytes else None

    def __str__(self) -> str:
        bound = ("no budget: nothing is evicted" if self.budget is None
                 else f"bound: budget {self.budget} + compress_every {self.compress_every} = {self.bound}")
        compactions = f"{self.num_compactions} compaction{'' if self.num_compactions == 1 else 's'}"
        share = "" if self.bytes_fraction is None else f" ({self.bytes_fraction:.0%})"
        return (f"RopeKVCache: kept {self.tokens_kept:,} of {self.tokens_seen:,} tokens ({bound}), {compactions}; KV "
                f"{format_bytes(self.bytes_held)} held vs {format_bytes(self.full_cache_bytes)} for a "
                f"DynamicCache{share}")


def format_bytes(count: int) -> str:
    """``count`` bytes in the largest binary unit up to GiB that keeps the number at or above 1 (``"3.25 MiB"``)."""
    power = next((p for p in (3, 2, 1) if count >= 1024**p), 0)
    return f"{count} B" if power == 0 else f"{count / 1024**power:.2f} {('KiB', 'MiB', 'GiB')[power - 1]}"
