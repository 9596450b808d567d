"""Statistics remember the weights they were calibrated on; statistics of other weights get a warning.

Two tiny models of one config and different seeds stand for a model and its fine-tune: same geometry, every
shape check passes, only the fingerprint tells them apart.
"""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
from conftest import tiny_model

import hf_ropekv
from hf_ropekv import FrequencyScorer, FrequencyStats, HfRopeKVWarning, RopeKVCache
from hf_ropekv.statistics import fingerprint
from hf_ropekv.model.geometry import describe

TEXT = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def warned():
    """The HfRopeKVWarnings issued during the test (the fingerprint check's once-per-pair memory cleared)."""
    fingerprint._warned.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", HfRopeKVWarning)
        yield record


def calibrated(model) -> FrequencyStats:
    return hf_ropekv.calibrate(model, None, TEXT, progress=False)


def reference_fingerprint(model) -> str:
    """The documented recipe, written out independently of the module."""
    layers = model.model.layers
    digest = hashlib.sha256()
    for layer in (layers[0], layers[len(layers) // 2], layers[-1]):
        weight = layer.self_attn.q_proj.weight.detach()
        rows = [round(i * (weight.shape[0] - 1) / 7) for i in range(8)]
        cols = [round(i * (weight.shape[1] - 1) / 7) for i in range(8)]
        sample = weight[rows][:, cols].to(torch.bfloat16)
        sample[sample.abs() < 2.0**-13] = 0
        digest.update(repr(tuple(weight.shape)).encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:12]


def test_fingerprint_follows_the_documented_recipe() -> None:
    model = tiny_model("llama", num_hidden_layers=3)
    assert fingerprint.weights_fingerprint(model) == reference_fingerprint(model)
    other = tiny_model("llama", num_hidden_layers=3, seed=1)
    assert fingerprint.weights_fingerprint(other) != fingerprint.weights_fingerprint(model)


def test_fingerprint_survives_dtype_changes_and_tracks_in_place_updates() -> None:
    model = tiny_model("qwen2")  # attention biases: only the weights count
    with torch.no_grad():  # a bfloat16 checkpoint loaded in float32, as most are
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    before = fingerprint.weights_fingerprint(model)
    assert fingerprint.weights_fingerprint(tiny_model("qwen2").to(torch.bfloat16)) == before
    assert fingerprint.weights_fingerprint(model.to(torch.float16)) == before
    model.float()
    with torch.no_grad():  # an optimizer step: the cached fingerprint must not be reused
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    assert fingerprint.weights_fingerprint(model) != before


def test_calibrate_records_the_fingerprint(tmp_path) -> None:
    model = tiny_model("llama")
    stats = calibrated(model)
    assert stats.metadata["weights_fingerprint"] == fingerprint.weights_fingerprint(model)
    assert stats.metadata["weights_source"] == fingerprint.model_source(model)
    stats.save(tmp_path / "s.safetensors")
    assert FrequencyStats.load(tmp_path / "s.safetensors").metadata["weights_fingerprint"] == (
        stats.metadata["weights_fingerprint"]
    )


def test_statistics_of_other_weights_warn_naming_both(tmp_path, warned) -> None:
    model, finetune = tiny_model("llama"), tiny_model("llama", seed=1)
    path = tmp_path / "finetune.safetensors"
    calibrated(finetune).save(path)
    ours, theirs = fingerprint.weights_fingerprint(model), fingerprint.weights_fingerprint(finetune)

    # The geometry fits: it still loads.
    cache = RopeKVCache(model, budget=16, compress_every=4, scorer=FrequencyScorer(stats=path))
    assert len(warned) == 1
    message = str(warned[0].message)
    assert ours in message and theirs in message and str(path) in message
    assert "input_ids" in message  # the statistics' source (calibration text)
    assert cache.scorer.stats.metadata["weights_fingerprint"] == theirs

    RopeKVCache(model, budget=16, compress_every=4, scorer=FrequencyScorer(stats=path))  # once per pair, not per cache
    assert [str(w.message) for w in warned if "fingerprint" in str(w.message)] == [message]


def test_enable_with_statistics_of_other_weights_warns_once(tmp_path, warned) -> None:
    model, finetune = tiny_model("llama"), tiny_model("llama", seed=1)
    path = tmp_path / "finetune.safetensors"
    calibrated(finetune).save(path)
    hf_ropekv.enable(model, budget=64, scorer=FrequencyScorer(stats=path))
    hf_ropekv.enable(model, budget=64, scorer=FrequencyScorer(stats=path))
    hf_ropekv.disable(model)
    assert len([w for w in warned if "fingerprint" in str(w.message)]) == 1


def test_other_weights_warning_is_an_hf_ropekv_warning_at_the_users_line(tmp_path) -> None:
    """A warnings filter or pytest.warns catches it, and it points here, not inside hf_ropekv or transformers."""
    fingerprint._warned.clear()
    model = tiny_model("llama")
    stats = calibrated(tiny_model("llama", seed=1))
    with pytest.warns(HfRopeKVWarning, match="other weights") as record:
        RopeKVCache(model, budget=16, compress_every=4, scorer=FrequencyScorer(stats=stats))
    assert [w.filename for w in record if issubclass(w.category, HfRopeKVWarning)] == [__file__]


def test_matching_and_unfingerprinted_statistics_load_silently(tmp_path, warned) -> None:
    model = tiny_model("llama")
    stats = calibrated(model)
    RopeKVCache(model, budget=16, scorer=FrequencyScorer(stats=stats))
    RopeKVCache(tiny_model("llama"), budget=16, scorer=FrequencyScorer(stats=stats))  # the same weights loaded again

    older = calibrated(tiny_model("llama", seed=1))
    for key in ("weights_fingerprint", "weights_source"):
        del older.metadata[key]
    older.save(tmp_path / "older.safetensors")  # a file written before fingerprints existed
    RopeKVCache(model, budget=16, scorer=FrequencyScorer(stats=tmp_path / "older.safetensors"))
    FrequencyStats.resolve(calibrated(tiny_model("llama", seed=1)), describe(model))  # no model: nothing to compare
    assert warned == []


def test_models_without_readable_weights_have_no_fingerprint(warned) -> None:
    model = tiny_model("llama")
    stats = calibrated(tiny_model("llama", seed=1))
    with torch.device("meta"):
        offloaded = tiny_model("llama")
    assert fingerprint.weights_fingerprint(offloaded) is None
    assert not fingerprint.warn_if_other_weights(stats.metadata, offloaded)
    assert fingerprint.warn_if_other_weights(stats.metadata, model)


def test_quantized_weights_are_read_dequantized(warned) -> None:
    """optimum-quanto int8: sampled through dequantization, so a fingerprint of its own (documented)."""
    quanto = pytest.importorskip("optimum.quanto")
    model, original = tiny_model("llama"), tiny_model("llama")
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    projection = model.model.layers[0].self_attn.q_proj
    dense = fingerprint._dense_weight(projection)
    want = original.model.layers[0].self_attn.q_proj.weight
    assert type(dense) is torch.Tensor and dense.shape == want.shape
    assert 0 < (dense - want).abs().max() < 0.01 * want.abs().max()  # int8 rounding, no more
    ours = fingerprint.weights_fingerprint(model)
    assert ours is not None and ours != fingerprint.weights_fingerprint(original)
    assert fingerprint.warn_if_other_weights(calibrated(original).metadata, model)
    assert "quantized copy" in str(warned[0].message)
