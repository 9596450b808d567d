"""The options of a :class:`~hf_ropekv.RopeKVCache`, validated once, before anything uses them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: How a budget's survivors are ranked: each layer on its own, or once for all layers.
SELECTIONS = ("global", "per_layer")
#: The default recent window: what measured best on GSM8K (README, "Quality"), capped for small budgets.
DEFAULT_WINDOW = 32
#: The workload prior's default weight: as many queries as a few prompts (provisional until measured).
DEFAULT_PRIOR_TOKENS = 512
#: The default head shrinkage of online statistics, in queries: chosen on GSM8K's tune split (64 and 256 tried,
#: 73 -> 81 / 84 of 150 at G = 48) and confirmed on the report split (140 -> 157 of 300; README, "Quality").
DEFAULT_HEAD_SHRINK = 256
#: Off until the test suite stops assuming that two calls on one model are independent (calls that learn are
#: not: the second scores with the first one's queries).
LEARN_WORKLOAD_BY_DEFAULT = False
#: The values ``static`` takes: ``"auto"`` (the default) lets ``generate()`` decide per cache (``cache.auto_static``).
STATIC_MODES = (True, False, "auto")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_at_least_zero(value: Any) -> bool:
    """A real number (not a bool) in ``[0, inf)``: a weight or a pseudo-count."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < float("inf")


@dataclass(frozen=True)
class CacheOptions:
    """Every plain option of ``RopeKVCache`` (the scorer and statistics are objects, resolved by the cache).

    Construction validates all of them first, so a wrong type gets a ``ValueError`` naming the option and the
    fix instead of a ``TypeError`` from the arithmetic that would have used it.
    """

    budget: int | None = None
    compress_every: int = 128
    page_size: int = 64
    window: int | None = None  # None: the default window (see ``recent_window``)
    sink: int = 0
    protect_prompt: bool = True
    selection: str = "per_layer"
    seed: int = 0
    stats_half_life: float | None = 128
    static: bool | str = "auto"  # True, False, or "auto": compiled where it pays (see cache.auto_static)
    learn_workload: bool = LEARN_WORKLOAD_BY_DEFAULT  # feed and read the model's workload statistics
    prior_tokens: float = DEFAULT_PRIOR_TOKENS  # the workload prior's weight, in queries
    stats_prompt_weight: float = 1.0  # what the prompt's queries weigh against the generation's (0: left out)
    stats_head_shrink: float = DEFAULT_HEAD_SHRINK  # pseudo-count pulling each head toward its layer's average
    # a static cache's compiled step serves every batch size (False: the first one; "auto": batch 1 alone until
    # the model compiles a step of more rows)
    dynamic_batch: bool | str = "auto"
    # a static cache's decode steps replay a CUDA graph of the eager step instead of generate's compiled one (True),
    # never (False), or where static="auto" made the cache static on one CUDA device ("auto", the default)
    cuda_graphs: bool | str = "auto"

    def __post_init__(self) -> None:
        budget = self.budget
        if budget is not None and (not _is_int(budget) or budget < 1):
            raise ValueError(f"budget must be a positive int (tokens to keep) or None (never evict); got {budget!r}.")
        for name in ("compress_every", "page_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}.")
        if self.window is not None and (not _is_int(self.window) or self.window < 0):
            raise ValueError(f"window must be an int >= 0 or None (the default); got {self.window!r}.")
        if not _is_int(self.sink) or self.sink < 0:
            raise ValueError(f"sink must be an int >= 0; got {self.sink!r}.")
        if budget is not None and self.recent_window + self.sink >= budget:
            raise ValueError(
                f"window ({self.recent_window}) + sink ({self.sink}) must be smaller than budget ({budget}), or "
                "nothing is left to choose."
            )
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}; got {self.selection!r}.")
        if not (isinstance(self.static, bool) or self.static == "auto"):
            raise ValueError(
                f"static must be True (a fixed arena, compileable), False (a growing cache, eager) or \"auto\" (the "
                f"default: compiled on CUDA for long generations, else eager); got {self.static!r}."
            )
        if self.cuda_graphs is True and self.static is False:
            raise ValueError(
                "cuda_graphs=True replays a static cache's decode step; this cache is static=False (growing, eager). "
                "Pass static=True, or static=\"auto\" (the default)."
            )
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise ValueError(
                f"cuda_graphs must be True (a static cache's decode steps replay a CUDA graph of the eager step), "
                f"False (generate compiles them) or \"auto\" (the default: graphs where static=\"auto\" made the "
                f"cache static on one CUDA device, compile for static=True); got {self.cuda_graphs!r}."
            )
        for name in ("protect_prompt", "learn_workload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}.")
        if not (isinstance(self.dynamic_batch, bool) or self.dynamic_batch == "auto"):
            raise ValueError(
                f"dynamic_batch must be True (one compiled step for every batch size), False (compiled for the "
                f"first batch size) or \"auto\" (the default: static while the model has compiled only batch 1, "
                f"dynamic from its first batch of more rows); got {self.dynamic_batch!r}."
            )
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int; got {self.seed!r}.")
        half_life = self.stats_half_life
        if half_life is not None and (isinstance(half_life, bool) or not isinstance(half_life, (int, float))
                                      or not half_life > 0):
            raise ValueError(f"stats_half_life must be a positive number of tokens or None; got {half_life!r}.")
        weight = self.stats_prompt_weight
        if not _is_finite_at_least_zero(weight):
            raise ValueError(
                f"stats_prompt_weight must be a number >= 0 (1: the prompt's queries count like the generation's, "
                f"0: they are left out once decoding counts); got {weight!r}."
            )
        shrink = self.stats_head_shrink
        if not _is_finite_at_least_zero(shrink):
            raise ValueError(
                f"stats_head_shrink must be a number of queries >= 0 (how far each query head's statistics are "
                f"pulled toward its layer's head average; 0 keeps every head on its own); got {shrink!r}."
            )
        prior = self.prior_tokens
        if not _is_finite_at_least_zero(prior):
            raise ValueError(
                f"prior_tokens must be a number >= 0 (the workload prior's weight in queries; 0 ignores it); "
                f"got {prior!r}."
            )

    @property
    def recent_window(self) -> int:
        """The recent window the cache protects: ``window`` if given, else ``min(32, budget // 4)`` (0 without a
        budget)."""
        return default_window(self.window, self.budget)

    @property
    def auto_window(self) -> bool:
        """Whether the window is the default one, which yields to a long pinned prompt (an explicit one never)."""
        return self.window is None

    @property
    def steady_slots(self) -> int | None:
        """Slots a full-attention layer holds at most in steady state: ``budget + compress_every``."""
        return None if self.budget is None else self.budget + self.compress_every


#: The keyword options ``RopeKVCache`` and ``hf_ropekv.enable`` accept besides ``budget`` and ``stats``.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CacheOptions) if f.name != "budget") + ("scorer",)


def default_window(window: int | None, budget: int | None) -> int:
    """The recent window a cache uses: ``window`` if given, else ``min(32, budget // 4)`` (0 without a budget)."""
    if window is not None:
        return window
    return 0 if budget is None else min(DEFAULT_WINDOW, budget // 4)
