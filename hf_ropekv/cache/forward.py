"""The one prologue of every forward: its checks, its compaction plan, the decode clock and the compaction."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..eviction.compactor import Compactor
from ..eviction.schedule import Plan, plan_forward
from .layers import CROPPABLE_FIX
from .options import CacheOptions
from .rows import BatchRows


class ForwardCoordinator:
    """What the full-attention layers of one cache ask before they store a forward's tokens: the forward's plan
    (``planned_slots``) and its prologue (``before_update``). ``model_class``: the class name of the cache's model
    (None: built from a config).

    The plan is a pure function of the cache's state, memoised per forward, so the mask (built before any layer
    runs) and the layers agree on it. The prologue runs at the first full-attention layer's update (a static cache:
    before the forward), so every layer is compacted before any writes and no returned tensor aliases a compacted
    arena.
    """

    def __init__(self, options: CacheOptions, full_layers: list, rows: BatchRows, compactor: Compactor,
                 model_class: str | None) -> None:
        self.options = options
        self.full_layers = full_layers
        self.rows = rows
        self.compactor = compactor
        self.model_class = model_class
        self.reset()

    def reset(self) -> None:
        self.plan: Plan | None = None  # this forward's compaction plan (memoised by seen, new, slots)
        self.decode_steps = 0  # single-token forwards started: the compaction clock (hf_ropekv.eviction.schedule)
        self.prompt_tokens: int | None = None  # pinned prompt length once decoding started
        self.announced = False  # the model's forward pre-hook announced the running forward
        self.rollback_expected = False  # generate announced a decoding mode that rolls the cache back

    def plan_for(self, new: int, seen_without_full_layers: int = 0) -> Plan:
        """This forward's plan of ``new`` tokens (memoised)."""
        # Read from the first full-attention layer, which no update of this forward has reached yet (sliding
        # layers in front of it may already have counted the new tokens).
        first = self.full_layers[0] if self.full_layers else None
        seen = first.tokens_seen if first is not None else seen_without_full_layers
        slots = first.storage.length if first is not None else seen
        plan = self.plan
        if plan is None or (plan.seen, plan.new, plan.slots_before) != (seen, new, slots):
            step = self.decode_steps if new == 1 else None
            plan = plan_forward(seen, new, slots, self.rows.current_holes(), self.options.budget,
                                self.options.compress_every, step)
            self.plan = plan
        return plan

    def pinned_tokens(self, seen: int) -> int:
        """Tokens of each row (padding included) that are never evicted: the prompt, when pinned."""
        if not self.options.protect_prompt:
            return 0
        return self.prompt_tokens if self.prompt_tokens is not None else seen

    def before_update(self, layer: Any, key_states: torch.Tensor, kwargs: dict) -> None:
        """Called by a growing full-attention layer before it writes: the first layer of a forward runs the prologue
        (with the padding from the update's arguments where the model's hooks gave none)."""
        rows = self.rows
        if layer is not self.full_layers[0]:  # a later layer follows the first one's plan: only check the batch
            if key_states.shape[0] != rows.batch_size:
                rows.check_batch(key_states.shape[0])
            return
        self.check_announced()
        seen, new = layer.tokens_seen, key_states.shape[-2]
        rows.check_batch(key_states.shape[0])
        rows.observe_update(seen + new, new, key_states.device, kwargs, from_model=self.model_class is not None)
        self.prologue(seen, new)

    def check_announced(self) -> None:
        """At the first full-attention layer of every eager forward: refuse a forward that reached the cache without
        its model's pre-hook announcing it (another model runs it); consume the announce."""
        if self.model_class is not None and not self.announced:
            running = _running_model_class()  # None: update() called directly (no model forward), which is fine
            if running is not None:
                other = f"another {running}" if running == self.model_class else f"a {running}"
                raise ValueError(f"This RopeKVCache was built for a {self.model_class} and is bound to it, but {other} "
                                 "runs a forward with it. Build a cache for each model: RopeKVCache(the_model, ...).")
        self.announced = False

    def prologue(self, seen: int, new: int) -> Plan:
        """The start of every forward of ``new`` tokens once its padding is known: refuse what cannot be done, fix
        the plan, advance the decode clock and compact every full-attention layer if the plan says so."""
        budget = self.options.budget
        if self.rollback_expected and budget is not None:
            # Assisted decoding sends the prompt and then each draft as multi-token forwards; the prompt check
            # below would take them all for prompt and fail with a misleading message.
            real = seen + new - min(self.rows.pads_host)
            pins_too_much = self.prompt_tokens is None and self.options.protect_prompt and real > budget
            if pins_too_much or self.plan_for(new).compacts:
                raise ValueError("RopeKVCache cannot crop once it evicts, and this decoding mode rolls the cache back: "
                                 f"this step would take it to {real} tokens, past budget={budget}. {CROPPABLE_FIX}")
        if self.prompt_tokens is None:
            if new == 1 and seen > 0:
                self.prompt_tokens = seen  # first decoding step: the prompt is complete
            elif self.options.protect_prompt and budget is not None:
                real = seen + new - min(self.rows.pads_host)
                if real > budget:
                    raise ValueError(f"The prompt has {real} tokens but budget={budget}; a pinned prompt must fit in "
                                     f"the budget. Raise `budget` to at least {real} plus room for the answer, or pass "
                                     "`protect_prompt=False` to let prompt tokens be evicted too.")
        plan = self.plan_for(new)
        if new == 1:
            self.decode_steps += 1
        if plan.compacts:
            self.rows.record_compaction(plan, from_model=self.model_class is not None)
            self.compactor.compact(self.full_layers, plan, self.rows.pads, self.rows.pads_host,
                                   self.pinned_tokens(seen))
        return plan


def _running_model_class() -> str | None:
    """The class of the outermost ``nn.Module`` being called on this stack (for an error message only)."""
    found = None
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and hasattr(owner, "config"):
            found = type(owner).__name__
        frame = frame.f_back
    return found
