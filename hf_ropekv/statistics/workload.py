"""Query statistics of a model's workload, learned across calls: ``hf_ropekv.workload_statistics(model)``.

A cache gathering online statistics (the default, ``stats=None``) knows only its own prompt and decoding steps
when it first compacts (~100 tokens). Real use is many calls of one workload (an eval loop, a server), so with
``learn_workload=True`` every finished forward of a ``RopeKVCache`` with online statistics also adds its real
queries, summed over batch rows and never decayed, into one :class:`WorkloadStatistics` per model. Real means
text: padding and the filler a batch's finished rows are fed until its longest row ends are left out. A cache built later starts each row's
statistics from them as a prior worth ``prior_tokens`` queries (README, "Workload statistics")::

    row means = (prior_mean * prior_tokens + row_sums) / (prior_tokens + row_counts)

The prior is taken when the cache is built, so a cache's behaviour never changes while it runs; the row's own
sums keep their half-life. A fresh model has no workload statistics: its first cache behaves exactly as before.

Learning is bounded, for reproducibility: the statistics freeze once they hold ``freeze_at`` tokens (or at
``freeze()``); from then on the same input gives the same output. A model serving two domains mixes them until
it freezes: keep one frozen file per domain (``save``) and pass it as ``stats=``, or ``reset()`` in between.

Caches with ``learn_workload=False`` (for now the default), an explicit ``stats=`` or another scorer neither
read nor feed them (a
cache with explicit statistics gathers no queries at all, so feeding would cost it hooks it otherwise skips).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.geometry import ModelGeometry, describe, shared_geometry
from .fingerprint import model_source, weights_fingerprint
from .frequency_stats import FrequencyStats, geometry_metadata

__all__ = ["WorkloadPrior", "WorkloadStatistics", "workload_statistics"]

#: Tokens after which learning stops. Provisional: chosen before it was measured (GSM8K: 300 problems of prompt
#: and answer hold ~100k tokens, and 98 % of the calibrated accuracy was reached with 32k calibration tokens).
DEFAULT_FREEZE_TOKENS = 65536


@dataclass(frozen=True)
class WorkloadPrior:
    """The workload's means when a cache was built: float64 ``[L, 3, H_q, F]`` (real, imaginary, modulus of the
    pre-RoPE query pairs; zeros for layers never fed), the tokens they average and whether learning had frozen."""

    means: torch.Tensor
    tokens: int
    frozen: bool


class WorkloadStatistics:
    """Undecayed sums of every real query of a model's default caches, per layer and query head (float64).

    Args:
        geometry: the model's attention geometry.
        fingerprint: the model's weights fingerprint (``statistics.fingerprint``), recorded in saved files and
            checked when one is loaded; ``None`` when the weights cannot be read.
        source: what the model was loaded from, for messages.
        freeze_at: tokens after which learning stops by itself (provisional default until measured, see
            ``DEFAULT_FREEZE_TOKENS``); settable.
    """

    def __init__(self, geometry: ModelGeometry, fingerprint: str | None = None, source: str = "model",
                 freeze_at: int = DEFAULT_FREEZE_TOKENS) -> None:
        self.geometry = geometry
        self.fingerprint = fingerprint
        self.source = source
        self.freeze_at = freeze_at
        # The online statistics feeding these: their last (< 16) deferred decoding steps are folded in before
        # anything reads the sums, so a call's every step counts even when its cache is dropped right after.
        self._feeders: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.reset()

    def __deepcopy__(self, memo: dict) -> "WorkloadStatistics":
        return self  # one per model: a copied cache keeps feeding its model's workload

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_feeders"] = None  # live caches are not part of the statistics
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._feeders = weakref.WeakSet()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget everything learned (and unfreeze): the next caches behave as on a fresh model."""
        if hasattr(self, "_frozen"):  # steps that live caches deferred before now are forgotten too, not added later
            self._collect()
        # Per device: float64 [L, 3, H_q, F]; a layer's row is fed on its own device only (zeros elsewhere).
        self._sums: dict[torch.device, torch.Tensor] = {}
        self._indices: dict[tuple, torch.Tensor] = {}  # (device, layers) -> the rows index_add_ writes
        self._tokens = 0  # host count of real tokens (one per query position, all layers alike): no sync to read
        self._frozen = False

    @property
    def tokens(self) -> int:
        """Real tokens (query positions) learned so far."""
        self._collect()
        return self._tokens

    @property
    def frozen(self) -> bool:
        """Whether learning has stopped (``freeze_at`` tokens reached, ``freeze()`` called, or a frozen file loaded)."""
        return self._frozen

    @property
    def freeze_at(self) -> int:
        return self._freeze_at

    @freeze_at.setter
    def freeze_at(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"freeze_at must be a positive int (tokens); got {value!r}.")
        self._freeze_at = value

    def freeze(self) -> None:
        """Stop learning now: caches built from here on all start from the same prior. What finished forwards gave
        counts (their deferred decoding steps are folded in first)."""
        self._collect()
        self._frozen = True

    def __repr__(self) -> str:
        state = "frozen" if self._frozen else f"learning until {self._freeze_at}"
        return (f"WorkloadStatistics(model_type={self.geometry.model_type!r}, tokens={self._tokens}, {state}, "
                f"fingerprint={self.fingerprint!r})")

    # ------------------------------------------------------------------ learning (called by OnlineStatistics)
    def add_layers(self, layers: tuple[int, ...], sums: torch.Tensor) -> None:
        """Add batch-summed query parts ``sums [len(layers), 3, H_q, F]`` of ``layers`` (no token count: see
        :meth:`count`). On the queries' device, no host synchronisation."""
        device = sums.device
        total = self._sums.get(device)
        if total is None:
            total = torch.zeros((self.geometry.num_layers,) + tuple(sums.shape[1:]), dtype=torch.float64,
                                device=device)
            self._sums[device] = total
        if len(layers) == 1:
            total[layers[0]] += sums[0]
        elif layers == tuple(range(total.shape[0])):
            total.add_(sums)
        else:
            index = self._indices.get((device, layers))
            if index is None:
                index = self._indices[(device, layers)] = torch.tensor(layers, device=device)
            total.index_add_(0, index, sums.to(torch.float64))

    def register(self, feeder: Any) -> None:
        """Note online statistics that feed these (see ``_collect``)."""
        self._feeders.add(feeder)

    def _collect(self) -> None:
        """Fold the feeders' deferred decoding steps in (only while learning: frozen sums never change)."""
        if not self._frozen:
            for feeder in list(self._feeders):
                feeder.flush()

    def adopt_rows(self, rows: dict[torch.device, torch.Tensor], layers: dict[torch.device, tuple[int, ...]]) -> None:
        """Add the undecayed per-row sums ``[L_device, B, 3, H_q, F]`` a dropped static cache gathered since they were
        last added (its steps were counted as they ended)."""
        if not self._frozen:
            for device, value in rows.items():
                self.add_layers(layers[device], value.sum(dim=1))
        rows.clear()

    def adopt_steps(self, steps: list[torch.Tensor], layers: list[tuple[int, ...]], layout: str, pairs: int) -> None:
        """Add decoding steps a dropped cache had deferred (``[B, L, H, D]`` queries of ``layers[0]``, no padding)."""
        if not steps or self._frozen:
            return
        from ..model.layouts import split_pairs

        q = torch.stack(steps)[..., : 2 * pairs].float()  # [n, B, L, H, 2F]
        real, imag = split_pairs(q, layout, pairs)
        parts = torch.stack((real, imag, torch.hypot(real, imag)), dim=-3)  # [n, B, L, 3, H, F]
        self.add_layers(layers[0], parts.sum(dim=(0, 1), dtype=torch.float64))
        self.count(parts.shape[0] * parts.shape[1])
        steps.clear()

    @property
    def room(self) -> int:
        """Tokens still learned before they freeze (0 once frozen)."""
        return 0 if self._frozen else max(0, self._freeze_at - self._tokens)

    def count(self, tokens: int) -> None:
        """The forward whose queries were just added held ``tokens`` real tokens; freezes at ``freeze_at``."""
        self._tokens += int(tokens)
        if self._tokens >= self._freeze_at:
            self._frozen = True

    # ------------------------------------------------------------------ reading
    def prior(self) -> WorkloadPrior | None:
        """The means now, for a cache being built (``None`` before any token was learned)."""
        self._collect()
        if self._tokens == 0 or not self._sums:
            return None
        totals = list(self._sums.values())
        first = totals[0]
        summed = first.clone() if len(totals) == 1 else sum(t.to(first.device) for t in totals)
        return WorkloadPrior(means=summed / self._tokens, tokens=self._tokens, frozen=self._frozen)

    def to_stats(self) -> FrequencyStats:
        """The means as CPU :class:`FrequencyStats` (what ``stats=`` accepts), with the token count and state."""
        prior = self.prior()
        if prior is None:
            raise ValueError("These workload statistics are empty: generate with a default RopeKVCache first "
                             "(or load a file).")
        means = prior.means.cpu()
        metadata = {
            **geometry_metadata(self.geometry),
            "tokens": self._tokens,
            "source": f"workload statistics of {self.source}",
            "workload_frozen": self._frozen,
        }
        if self.fingerprint is not None:
            metadata.update(weights_fingerprint=self.fingerprint, weights_source=self.source)
        return FrequencyStats(q_mean=torch.complex(means[:, 0].float(), means[:, 1].float()),
                              q_abs_mean=means[:, 2].float(), metadata=metadata)

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """Write the statistics as a ``FrequencyStats`` safetensors file (usable as ``stats=`` too), with the
        token count, frozen state, weights fingerprint and rotary layout."""
        self.to_stats().save(path)

    def load(self, path: str | os.PathLike) -> "WorkloadStatistics":
        """Replace the learned statistics by a file from :meth:`save` (or ``hf_ropekv.calibrate``'s), frozen if the
        file was. Returns ``self``.

        Raises:
            ValueError: the file does not fit the model's geometry, was written for other weights (fingerprint),
                or records no token count.
        """
        stats = FrequencyStats.load(path)
        stats.check_compatible(self.geometry)
        theirs = stats.metadata.get("weights_fingerprint")
        if theirs and self.fingerprint and theirs != self.fingerprint:
            raise ValueError(
                f"{path} holds statistics of weights with fingerprint {theirs} "
                f"({stats.metadata.get('weights_source', 'unknown model')}), but this model ({self.source}) has "
                f"fingerprint {self.fingerprint}: another checkpoint's queries. Learn this model's workload instead "
                "(generate with it, then save), or pass the file as stats= if you mean to use it anyway."
            )
        if stats.tokens < 1:
            raise ValueError(f"{path} records no token count, so it cannot be weighed against new queries; save it "
                             "with WorkloadStatistics.save or hf_ropekv.calibrate.")
        means = torch.stack((stats.q_mean.real, stats.q_mean.imag, stats.q_abs_mean), dim=1).to(torch.float64)
        self.reset()
        self._sums[means.device] = means * stats.tokens
        self._tokens = stats.tokens
        self._frozen = bool(stats.metadata.get("workload_frozen", True))  # calibrate's files: fixed statistics
        return self


#: model -> its workload statistics (weak: they go with the model).
_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, WorkloadStatistics]" = weakref.WeakKeyDictionary()


def workload_statistics(model: nn.Module) -> WorkloadStatistics:
    """The :class:`WorkloadStatistics` of ``model`` (created empty on first use; one per model object)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"workload_statistics needs the model (an nn.Module); got {type(model).__name__}.")
    return _for_model(model, None)


def _for_model(model: nn.Module, geometry: ModelGeometry | None) -> WorkloadStatistics:
    """``workload_statistics(model)``, reusing the geometry a cache already described."""
    known = _BY_MODEL.get(model)
    if known is None:
        geometry = shared_geometry(model, describe(model)) if geometry is None else geometry
        known = _BY_MODEL[model] = WorkloadStatistics(geometry, weights_fingerprint(model), model_source(model))
    return known
