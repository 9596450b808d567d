"""Per-layer selection compacts every layer at the first layer of a forward, in one op set (``Compactor.compact``).

The reference is the earlier timing, each layer compacted at its own update (``_LayerByLayer`` below, a subclass of
the private ``ForwardCoordinator``: the timing of compaction is the mechanism under test): the kept
slots and positions of every layer and the generated tokens must be identical, across many compactions, with a
left-padded batch, a prefill in chunks, unpinned prompts longer than the budget, and the scorers that read
recent queries.
"""

from __future__ import annotations

import pytest
import torch
from conftest import padded_batch, tiny_model

from hf_ropekv import FrequencyScorer, RopeKVCache
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.cache.forward import ForwardCoordinator
from hf_ropekv.scorers import SnapKVScorer


class _LayerByLayer(ForwardCoordinator):
    """The earlier timing: the first layer compacts only itself, every later layer at its own update."""

    def __init__(self, coordinator: ForwardCoordinator) -> None:
        self.__dict__.update(coordinator.__dict__)  # the same options, layers, rows and compactor

    def prologue(self, seen, new):
        layers = self.full_layers
        self.full_layers = layers[:1]
        try:
            return super().prologue(seen, new)
        finally:
            self.full_layers = layers

    def before_update(self, layer, key_states, kwargs):
        super().before_update(layer, key_states, kwargs)
        if layer is not self.full_layers[0] and self.plan.compacts:
            pinned = self.pinned_tokens(self.plan.seen)
            self.compactor.compact([layer], self.plan, self.rows.pads, self.rows.pads_host, pinned)


def _generate(model, layer_by_layer, ids, mask, generate_options=None, **options):
    cache = RopeKVCache(model, budget=24, compress_every=6, **options)
    if layer_by_layer:
        cache.coordinator = _LayerByLayer(cache.coordinator)  # what the layers ask
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                             **{cache_kwarg(model): cache}, **(generate_options or {}))
    return out, cache


OPTIONS = {
    "defaults": {},
    "unpinned": dict(protect_prompt=False),
    "sink_window": dict(sink=2, window=4, protect_prompt=False),
    "no_decay_no_prompt_window": dict(scorer=FrequencyScorer(half_life=None, prompt_window=0)),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_first_layer_compaction_keeps_what_layer_by_layer_kept(name: str) -> None:
    model = tiny_model("qwen3", num_hidden_layers=4)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(22, 15, 9))
    expected, reference = _generate(model, True, ids, mask, **OPTIONS[name])
    got, cache = _generate(model, False, ids, mask, **OPTIONS[name])
    assert cache.num_compactions >= 5 and cache.num_compactions == reference.num_compactions
    assert torch.equal(got, expected)
    assert cache.evicted
    for layer in range(model.config.num_hidden_layers):  # all full attention
        assert torch.equal(cache.kept_positions(layer), reference.kept_positions(layer))
        assert torch.equal(cache.layers[layer].keys, reference.layers[layer].keys)  # (transformers' layer keys)


def test_first_layer_compaction_with_a_chunked_prefill_and_a_query_scorer() -> None:
    model = tiny_model("llama", num_hidden_layers=3)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(30, 21))
    options = dict(protect_prompt=False, generate_options=dict(prefill_chunk_size=8))
    expected, reference = _generate(model, True, ids, mask, scorer=SnapKVScorer(), **options)
    got, cache = _generate(model, False, ids, mask, scorer=SnapKVScorer(), **options)
    assert cache.num_compactions >= 5
    assert torch.equal(got, expected)
    assert cache.evicted
    for layer in range(model.config.num_hidden_layers):  # all full attention
        assert torch.equal(cache.kept_positions(layer), reference.kept_positions(layer))
