"""static="auto", the default: settled once, when the cache is built. Static (a fixed arena whose decode steps replay
CUDA graphs) where graphs can run: the model on one CUDA device and one rank, a budget, a scorer that needs no
query window and a quantization transformers would compile; growing everywhere else, so always on the CPU.

The CPU stands in for one CUDA device by answering the capturability question in the cache's checks
(``hf_ropekv.cache.model_checks.not_capturable``) with None: "auto" then goes static, and its steps run eagerly
here. The reference for tokens is the growing cache (``static=False``).
"""

from __future__ import annotations

import pytest
import torch

from conftest import generate_new, padded_batch, tiny_model
from hf_ropekv import FrequencyScorer, RopeKVCache
from hf_ropekv.cache import model_checks
from hf_ropekv.scorers import H2OScorer, RecencyScorer, SnapKVScorer

BUDGET, EVERY = 16, 4


@pytest.fixture
def one_gpu(monkeypatch):
    """The model counts as on one CUDA device for static="auto"."""
    monkeypatch.setattr(model_checks, "not_capturable", lambda model, device: None)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_on_the_cpu_auto_is_growing(arch: str) -> None:
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
    assert cache.options.static == "auto" and cache.static is False and not cache.is_compileable
    out = generate_new(model, cache, ids, mask, 40)
    assert cache.static is False and cache.summary().static is False and cache.num_compactions >= 5
    expected = generate_new(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False), ids, mask, 40)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2_sliding"])
def test_where_graphs_can_run_auto_is_static_from_construction(arch: str, one_gpu) -> None:
    """Static before any forward and after generate (settled once, never rebuilt inside generate), on full-attention
    and hybrid sliding-window models; the growing cache's tokens."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=(11, 6, 3))
    expected = generate_new(model, RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False), ids, mask,
                            40)
    cache = RopeKVCache(model, budget=BUDGET, compress_every=EVERY)
    assert cache.static is True and cache.is_compileable
    torch.testing.assert_close(generate_new(model, cache, ids, mask, 40), expected, atol=0, rtol=0)
    assert cache.static is True and cache.summary().static is True and cache.num_compactions >= 5


@pytest.mark.parametrize("case", ["no budget", "config", "snapkv", "h2o", "quanto"])
def test_what_a_static_cache_cannot_run_stays_growing_where_graphs_could(case: str, one_gpu) -> None:
    """No budget (no arena size), a config (no hooks to prepare the steps), a scorer recomputing attention from a
    query window, or a quantization transformers will not compile: "auto" stays growing, with no error."""
    model = tiny_model("llama")
    if case == "no budget":
        cache = RopeKVCache(model)
    elif case == "config":
        cache = RopeKVCache(model.config, budget=BUDGET, scorer=RecencyScorer())
    elif case == "snapkv":
        cache = RopeKVCache(model, budget=BUDGET, scorer=SnapKVScorer(window=4))
    elif case == "h2o":
        cache = RopeKVCache(model, budget=BUDGET, scorer=H2OScorer())
    else:
        quanto = pytest.importorskip("optimum.quanto")
        from transformers import AutoModelForCausalLM, QuantoConfig

        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=QuantoConfig(weights="int8"),
                                                         dtype=torch.float32).eval()
        assert isinstance(model.model.layers[0].self_attn.q_proj, quanto.QModuleMixin)
        if getattr(model.hf_quantizer, "is_compileable", False):
            pytest.skip("this transformers compiles quanto models")
        cache = RopeKVCache(model, budget=BUDGET)
    assert cache.static is False
    assert RopeKVCache(tiny_model("llama"), budget=BUDGET).static is True  # the same rule says yes otherwise


def test_static_true_and_false_hold_anywhere() -> None:
    """static=True forces the fixed arena on the CPU too (its steps run eagerly there); static=False grows."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(9, 5))
    forced = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=True, scorer=FrequencyScorer(half_life=8))
    growing = RopeKVCache(model, budget=BUDGET, compress_every=EVERY, static=False, scorer=FrequencyScorer(half_life=8))
    assert forced.static and not growing.static
    torch.testing.assert_close(generate_new(model, forced, ids, mask, 30), generate_new(model, growing, ids, mask, 30),
                               atol=0, rtol=0)
    assert forced.num_compactions == growing.num_compactions >= 5
