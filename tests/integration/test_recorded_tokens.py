"""Behaviour pinned while the code moves: greedy (and seeded sampled) tokens of a set of configurations.

``tests/data/recorded_tokens.json`` holds the tokens each configuration below generated when it was recorded,
before the redesign of issue 25 moved any code. A refactor must reproduce them exactly. They cover the
scorers, both selections, guards, the static cache, padded batches, a sliding/hybrid model, beam search,
sampling, ``enable()`` and a quantized model.

The configurations that evict with online statistics were recorded again when head shrinkage became the default
(``head_shrink=256``, 2026-12-03; with 0 every one of them gave the tokens recorded before);
``llama-unshrunk-padded`` keeps the earlier default's tokens (``llama-default-padded`` as first recorded).

Retired with ``selection="global"`` (2026-12-05, one ranking for all layers, no longer an option): the
configurations ``llama-global-padded``, ``qwen2-global-padded`` and the global ``llama-paper-point``. Their
replacements (``qwen2-default-padded``, ``llama-paper-point-per-layer``) were recorded at that change.

Recorded again when the default window began to leave the scorer part of a tight room (7822dfc, 2026-12-06):
``llama-beam2``, ``llama-sampled``, ``qwen3-default-padded`` and ``gemma3-default-padded``, whose 12-token prompt
leaves a room of 4 at budget 16 (the window now takes 2 of it).

Recorded again when a tight room became split evenly, the window taking its floor half (2026-12-06): every
configuration whose 9-token row has a room of 7 at budget 16 (its window went from 4 to 3 slots); the others held.

Record again only for a deliberate behaviour change, and say why in the commit:

    HF_ROPEKV_RECORD=1 python -m pytest tests/test_recorded_tokens.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import hf_ropekv
from conftest import padded_batch, tiny_model
from hf_ropekv import FrequencyScorer, FrequencyStats, RopeKVCache
from hf_ropekv.scorers import H2OScorer, KeyNormScorer, RandomScorer, RecencyScorer, RKVScorer, SnapKVScorer

RECORD = os.environ.get("HF_ROPEKV_RECORD") == "1"
DATA = Path(__file__).parent / "data" / "recorded_tokens.json"
NEW_TOKENS = 40
BUDGET, EVERY = 16, 8


def _cache_kwarg(model) -> str:
    from hf_ropekv import _compat

    return _compat.cache_kwarg(model)


def _generate(model, cache: Any, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> list[list[int]]:
    extra = {} if cache is None else {_cache_kwarg(model): cache}
    kwargs = {"do_sample": False, **kwargs}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0, **extra,
                         **kwargs)
    return out[:, ids.shape[1]:].tolist()


def _calibrated_stats(model) -> FrequencyStats:
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(7))
    return hf_ropekv.calibrate(model, None, ids, progress=False)


def _quanto_model(arch: str):
    quanto = pytest.importorskip("optimum.quanto")
    model = tiny_model(arch)
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    return model


def _run(arch: str, *, batch: str = "padded", model_fn: Callable | None = None, enable: dict | None = None,
         generate: dict | None = None, **cache_kwargs) -> Callable[[], list[list[int]]]:
    def run() -> list[list[int]]:
        model = model_fn(arch) if model_fn is not None else tiny_model(arch)
        if batch == "padded":
            ids, mask = padded_batch(lengths=(12, 9, 6), seed=1)
        else:
            ids, mask = padded_batch(lengths=(10,), seed=2)
        kwargs = dict(cache_kwargs)
        if kwargs.pop("calibrated", False):
            kwargs["scorer"] = FrequencyScorer(stats=_calibrated_stats(model))
        if enable is not None:
            with hf_ropekv.enabled(model, **enable):
                return _generate(model, None, ids, mask, **(generate or {}))
        cache = RopeKVCache(model, **kwargs)
        if generate and generate.get("do_sample"):
            torch.manual_seed(3)
        return _generate(model, cache, ids, mask, **(generate or {}))

    return run


CONFIGS: dict[str, Callable[[], list[list[int]]]] = {
    "llama-default-padded": _run("llama", budget=BUDGET, compress_every=EVERY),
    "llama-unshrunk-padded": _run("llama", budget=BUDGET, compress_every=EVERY, scorer=FrequencyScorer(head_shrink=0)),
    "llama-default-single": _run("llama", batch="single", budget=BUDGET, compress_every=EVERY),
    "llama-paper-point-per-layer": _run("llama", budget=BUDGET, compress_every=EVERY, window=0,
                                        scorer=FrequencyScorer(half_life=None, head_shrink=0)),
    "llama-guards-unpinned": _run("llama", budget=BUDGET, compress_every=EVERY, window=3, sink=2,
                                  protect_prompt=False),
    "llama-calibrated": _run("llama", budget=BUDGET, compress_every=EVERY, calibrated=True),
    "llama-recency": _run("llama", budget=BUDGET, compress_every=EVERY, scorer=RecencyScorer()),
    "llama-keynorm": _run("llama", budget=BUDGET, compress_every=EVERY, scorer=KeyNormScorer()),
    "llama-random": _run("llama", budget=BUDGET, compress_every=EVERY, scorer=RandomScorer()),
    "llama-snapkv": _run("llama", budget=BUDGET, compress_every=EVERY, scorer=SnapKVScorer(window=4)),
    "llama-h2o": _run("llama", budget=BUDGET, compress_every=EVERY, scorer=H2OScorer()),
    "llama-rkv": _run("llama", budget=BUDGET, compress_every=EVERY, scorer=RKVScorer(window=4)),
    "llama-static-padded": _run("llama", budget=BUDGET, compress_every=EVERY, static=True),
    "llama-beam2": _run("llama", batch="single", budget=BUDGET, compress_every=EVERY, generate=dict(num_beams=2)),
    "llama-sampled": _run("llama", budget=BUDGET, compress_every=EVERY, generate=dict(do_sample=True, top_k=20)),
    "llama-enable": _run("llama", enable=dict(budget=BUDGET, compress_every=EVERY)),
    "qwen3-default-padded": _run("qwen3", budget=BUDGET, compress_every=EVERY),
    "qwen2-default-padded": _run("qwen2", budget=BUDGET, compress_every=EVERY),
    "gemma3-default-padded": _run("gemma3_text", budget=BUDGET, compress_every=EVERY),
    "mistral-sliding-default": _run("mistral_sliding", budget=BUDGET, compress_every=EVERY),
    "llama-quanto-int8": _run("llama", model_fn=_quanto_model, budget=BUDGET, compress_every=EVERY),
    "llama-unbounded": _run("llama", budget=None),
}


def _recorded() -> dict[str, list[list[int]]]:
    return json.loads(DATA.read_text()) if DATA.exists() else {}


@pytest.fixture(scope="module")
def recording():
    """Collects fresh tokens when recording; writes them once at the end of the module."""
    fresh: dict[str, list[list[int]]] = {}
    yield fresh
    if RECORD and fresh:
        DATA.parent.mkdir(exist_ok=True)
        merged = {**_recorded(), **fresh}
        DATA.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tokens_equal_the_recorded_ones(name: str, recording) -> None:
    tokens = CONFIGS[name]()
    if RECORD:
        recording[name] = tokens
        return
    recorded = _recorded()
    assert name in recorded, f"no recorded tokens for {name!r}: record them (see the module docstring)"
    assert tokens == recorded[name], f"{name}: tokens differ from the ones recorded before the redesign"


def test_configurations_really_evict() -> None:
    """The recorded configurations are worth pinning only if they evict (else they equal DynamicCache's)."""
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(12, 9, 6), seed=1)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
    _generate(model, cache, ids, mask)
    assert cache.evicted and cache.num_compactions >= 3
