"""What one cache's online statistics hand to the model's workload statistics (``statistics.workload``).

:class:`~hf_ropekv.statistics.online.OnlineStatistics` owns one :class:`WorkloadFeed` and keeps the arithmetic of
its own sums; the feed keeps the bookkeeping of learning: whether the workload still learns, which rows of a batch
it learns (a row that has ended is fed filler: ``rows_to_learn``), how many real tokens a forward held, a static
cache's undecayed per-row learning sums and when they go into the workload (``drain``), and what the workload
adopts when the cache is dropped (``hand_over_at_end``). A feed without workload statistics learns nothing.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch

from .workload import WorkloadStatistics


class WorkloadFeed:
    """What one cache's online statistics hand to the model's workload statistics.

    Args:
        workload: the model's workload statistics to feed with every finished forward's real queries (until they
            freeze), or ``None`` (nothing is learned).
        filler_ids: token ids ``generate()`` feeds a batch's finished rows (the model's pad and end-of-sequence
            ids); the ids a prompt is padded with are added as prompts come (see ``rows_to_learn``).
    """

    def __init__(self, workload: WorkloadStatistics | None, filler_ids: Iterable[int] = ()) -> None:
        self.workload = workload
        self._filler: set[int] = {int(t) for t in filler_ids}
        self.deferred_layers: list[tuple[int, ...]] = [()]  # the layers of the owner's deferred steps (one device)
        # A static cache's undecayed per-row sums for the workload, float64 [L_device, B, 3, H_q, F] per device, and
        # the layers of their rows; one dict each for the feed's life (see hand_over_at_end), emptied by reset.
        self.rows: dict[torch.device, torch.Tensor] = {}
        self._layers: dict[torch.device, tuple[int, ...]] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the per-row learning sums (drained first by the owner) and which rows are learned."""
        self.rows.clear()
        self._layers.clear()
        self._step_tokens = 0  # real tokens of the running static decoding step, counted for the workload at its end
        # Which rows the workload learns this decoding step (None: every row), the previous step's, and the
        # excluded rows' index per device (see rows_to_learn).
        self.live: tuple[bool, ...] | None = None
        self._live_before: tuple[bool, ...] | None = None
        self._excluded: dict[tuple, torch.Tensor] = {}

    def hand_over_at_end(self, owner: object, deferred: list[torch.Tensor], layout: str, pairs: int) -> None:
        """Register ``owner`` (the online statistics) with the workload, which flushes it before reading, and hand
        the workload what ``owner`` still holds when it goes (its cache was dropped): the decoding steps
        ``deferred`` (``owner``'s one list for its life) and the static cache's per-row learning sums."""
        workload = self.workload
        if workload is None:
            return
        workload.register(owner)
        # Steps still deferred when owner goes (its cache was dropped) still count. (The finalizers hold the
        # containers and the workload's bound methods, never owner or this feed: owner can still go.)
        ending = weakref.finalize(owner, workload.adopt_steps, deferred, self.deferred_layers, layout, pairs)
        ending.atexit = False
        # ... and so do a static cache's undecayed per-row sums (its buffers go back to the model's pool as it
        # goes, and no other cache can take them before this runs)
        ending = weakref.finalize(owner, workload.adopt_rows, self.rows, self._layers)
        ending.atexit = False

    def learner(self) -> WorkloadStatistics | None:
        """The workload statistics to feed now (``None``: not learning, or they froze)."""
        workload = self.workload
        return None if workload is None or workload.frozen else workload

    # ------------------------------------------------------------------ one forward
    def begin_forward(self, input_ids: torch.Tensor | None, mask: torch.Tensor | None, new: int) -> None:
        """A forward of ``new`` tokens starts (``mask``: its new-token mask, ``input_ids``: its token ids, when the
        model got ids): note which rows it learns."""
        self._step_tokens = 0  # (a static step that raised is not counted by the next forward)
        self._live_before, self.live = self.live, self.rows_to_learn(input_ids, mask, new)

    def begin_static_step(self, batch: int, mask: torch.Tensor | None, new: int) -> None:
        """A static cache's decoding step of ``batch`` rows starts while learning: its fold adds its queries to the
        learning rows; its real tokens count when it ends (``end_forward``)."""
        if self.live is not None and self.live != self._live_before:
            # rows stop (or resume) being learned: what their sums hold so far counts; end_forward zeroes
            # what the step adds to the rows not learned
            self.drain()
        self._step_tokens = self.real_tokens(batch, mask, new)

    def end_forward(self, on_buffers: bool) -> None:
        """The forward finished (its static folds done; ``on_buffers``: the owner's sums are a static cache's): the
        rows not learned lose what the step added to the learning rows, and a static step's real tokens count."""
        if self.live is not None and on_buffers:  # a static step added every row: forget the filler's
            for device, rows in self.rows.items():
                rows.index_fill_(1, self.excluded_rows(device), 0.0)
        if self._step_tokens:  # a static decoding step: its queries are in the per-row learning sums
            tokens, self._step_tokens = self._step_tokens, 0
            learner = self.learner()
            if learner is not None:
                if tokens >= learner.room:  # this step freezes them: what was learned up to here goes in first
                    self.drain()
                learner.count(tokens)

    def rows_reordered(self) -> None:
        """The batch's rows were reordered (beam search, expansion): which rows are learned is known in the old row
        order only; the next step tells again."""
        self.live = self._live_before = None

    # ------------------------------------------------------------------ static caches
    def take_rows(self, take: Callable[..., torch.Tensor], sums: dict[torch.device, torch.Tensor],
                  layers: dict[torch.device, tuple[int, ...]]) -> None:
        """While learning, take per-row learning sums shaped as ``sums`` (of ``layers``) from ``take`` (a static
        cache's ``BufferLease.take``): the compiled step adds to them beside its own sums."""
        if self.learner() is None:
            return
        for device, value in sums.items():
            rows = take(("online_learn_rows", device), tuple(value.shape), value.dtype,
                        lambda v=value: torch.zeros_like(v))
            self.rows[device] = rows  # zeroed by take
            self._layers[device] = layers[device]

    def drain(self) -> None:
        """Add a static cache's undecayed per-row learning sums into the workload, summed over rows, and zero them
        (the queries they hold were counted as their steps ended)."""
        if not self.rows:
            return
        learner = self.learner()
        for device, rows in self.rows.items():
            if learner is not None:
                learner.add_layers(self._layers[device], rows.sum(dim=1))
            rows.zero_()

    # ------------------------------------------------------------------ which rows and tokens are learned
    def real_tokens(self, batch: int, mask: torch.Tensor | None, new: int) -> int:
        """Real tokens of a forward of ``new`` tokens in ``batch`` rows (``mask``: its new-token mask) over the rows
        the workload learns (a host sync only when it has a padding mask)."""
        if self.live is not None:  # a decoding step: one token per row
            real = [True] * batch if mask is None else mask[:, -1].tolist()
            return sum(1 for is_real, learned in zip(real, self.live) if is_real and learned)
        if mask is None:
            return batch * new
        return int(mask.sum())

    def learned(self, parts: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``parts [B, ...]`` on ``device`` with the rows this step does not learn zeroed (``parts`` itself when it
        learns every row)."""
        return parts if self.live is None else parts.index_fill(0, self.excluded_rows(device), 0.0)

    def rows_to_learn(self, input_ids: torch.Tensor | None, mask: torch.Tensor | None,
                      new: int) -> tuple[bool, ...] | None:
        """The rows whose query of this decoding step the workload learns; ``None``: all of them.

        In a batch, ``generate()`` keeps feeding a row that has ended (its end-of-sequence token, then the pad
        token, attention mask 1) until the longest row ends: on GSM8K batches of 64 that was 27-38 % of all the
        positions processed. Those queries are not text of the workload. A decoding step whose input id is a
        filler id (the model's pad and end-of-sequence ids, and the ids prompts were padded with) is left out.
        Costs a host sync per decoding step, only while learning and only for batches of more than one row."""
        if self.learner() is None or input_ids is None:
            return None
        if new > 1:
            if mask is not None and input_ids.shape[-1] == mask.shape[-1] and not bool(mask.all()):
                self._filler.update(input_ids[~mask.to(input_ids.device)].unique().tolist())  # once per prompt
            return None
        if input_ids.shape[0] == 1 or not self._filler:
            return None
        live = tuple(token not in self._filler for token in input_ids[:, -1].tolist())
        return None if all(live) else live

    def excluded_rows(self, device: torch.device) -> torch.Tensor:
        """The rows this step does not learn, as an index on ``device``."""
        key = (device, self.live)
        index = self._excluded.get(key)
        if index is None:
            if len(self._excluded) > 64:  # rows end one by one: few distinct sets per generation
                self._excluded.clear()
            rows = [row for row, learned in enumerate(self.live) if not learned]
            index = self._excluded[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return index
