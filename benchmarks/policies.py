"""Cache policies by name, and the one place a benchmark builds a ``RopeKVCache`` (or transformers'
``QuantizedCache``, the quantized baseline).

A policy is a function that returns the keyword arguments of ``RopeKVCache(model, budget, **kwargs)``; ``full`` is
no RopeKVCache at all (``generate``'s own ``DynamicCache``). A new candidate default is one line in ``POLICIES``.

Peers keep the library's recent window rule (``window=None``: a window that fits the budget), the same as the
default, so that a comparison is between scorers, not windows.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from common import import_hf_ropekv

hf_ropekv = import_hf_ropekv()
from hf_ropekv import scorers  # noqa: E402  (after the checkout import above)
from vote_candidates import CANDIDATES  # noqa: E402

FULL = "full"

#: name -> cache keyword arguments. Built fresh per cache: a scorer may hold state of its own.
POLICIES: dict[str, Callable[[], dict[str, Any]]] = {
    "default": dict,
    "default_nowindow": lambda: {"scorer": hf_ropekv.FrequencyScorer(prompt_window=0)},
    "int8": lambda: {"kv_bits": 8},
    "int8_2x": lambda: {"kv_bits": 8},  # twice the budget: the bytes of the default at this budget
    "recency": lambda: {"scorer": scorers.RecencyScorer()},
    "sink_recent": lambda: {"scorer": scorers.RecencyScorer(), "sink": 4},
    "snapkv": lambda: {"scorer": scorers.SnapKVScorer()},
    "h2o": lambda: {"scorer": scorers.H2OScorer()},
    "rkv": lambda: {"scorer": scorers.RKVScorer()},
    "keynorm": lambda: {"scorer": scorers.KeyNormScorer()},
}
POLICIES.update(CANDIDATES)  # screened prompt votes (vote_candidates.py), not library options
NAMES = (FULL, *POLICIES)


def check(names: list[str]) -> list[str]:
    """``names``, or a ValueError naming the unknown ones and the choices."""
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(NAMES)}")
    return names


def make_cache(model: Any, budget: int | None, policy: str = "default", **options: Any) -> Any:
    """A fresh cache of ``policy`` for ``model`` (``None`` for ``full``); ``options`` (``protect_prompt``,
    ``compress_every``, ``static``, ...) go to ``RopeKVCache`` and win over the policy's."""
    if policy == FULL:
        return None
    if policy.endswith("_2x") and budget is not None:
        budget *= 2
    return hf_ropekv.RopeKVCache(model, budget, **{**POLICIES[policy](), **options})


def quanto_cache(model: torch.nn.Module) -> Any:
    """transformers' ``QuantizedCache`` (quanto backend, int4). quanto's ``unpack`` is served from PyTorch ops so
    that its C++/CUDA extensions are never compiled (minutes with nvcc on every fresh machine)."""
    from optimum.quanto.library.extensions import get_extension
    from transformers import QuantizedCache

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:  # quanto's own pure-PyTorch unpack
        parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
        return torch.cat(parts).to(torch.uint8)

    for name in ("quanto_cpp", "quanto_cuda"):
        try:
            extension = get_extension(name)
        except KeyError:
            continue
        if getattr(extension, "_lib", None) is None:
            extension._lib = types.SimpleNamespace(unpack=unpack)
    return QuantizedCache(backend="quanto", config=model.config, nbits=4)
