"""Misuse that the cache refuses when it is built (no forward needed): the error names the problem and the fix."""

from __future__ import annotations

import warnings

import pytest
import transformers
from transformers import GPT2Config, LlamaConfig, T5Config

from conftest import tiny_model
from hf_ropekv import HfRopeKVWarning, RopeKVCache, enable
from hf_ropekv.scorers import KeyNormScorer, RecencyScorer, SnapKVScorer

_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
             pad_token_id=0, bos_token_id=None, eos_token_id=None)


@pytest.mark.parametrize(
    "config, message",
    [
        (GPT2Config(n_layer=2, n_embd=32, n_head=2), "no rotary position embedding.*whatever the scorer.*DynamicCache"),
        (T5Config(num_layers=2, d_model=32, num_heads=2), "encoder-decoder"),
        (LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, add_cross_attention=True),
         "cross-attention"),
        (transformers.FalconConfig(**{**_BASE, "alibi": True}), "ALiBi"),
        (transformers.DeepseekV3Config(**{**_BASE, "num_key_value_heads": 4, "intermediate_size": 128,
                                          "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                                          "qk_nope_head_dim": 8, "v_head_dim": 16}), "multi-head latent attention"),
    ],
    ids=["gpt2", "t5", "cross-attention", "alibi-falcon", "deepseek-mla"],
)
def test_unsupported_model_families_are_refused_with_the_reason(config, message: str) -> None:
    for budget in (None, 64):
        with pytest.raises(ValueError, match=message):
            RopeKVCache(config, budget=budget, scorer=RecencyScorer())


def test_an_alibi_model_is_refused_like_its_config() -> None:
    config = transformers.FalconConfig(**{**_BASE, "alibi": True})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="ALiBi"):
        RopeKVCache(model, budget=64)


def test_nope_full_attention_layers_refuse_the_rope_scorer_only() -> None:
    """Cohere2 rotates only in its sliding layers: its full-attention keys carry no phase to score, so the default
    scorer is refused, naming a scorer that works; other scorers and no budget are accepted."""
    config = transformers.Cohere2Config(**{**_BASE, "num_key_value_heads": 2, "intermediate_size": 128,
                                           "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="NoPE.*RecencyScorer"):
        RopeKVCache(model, budget=20)
    RopeKVCache(model, budget=20, scorer=RecencyScorer())
    RopeKVCache(model, budget=None)


@pytest.mark.parametrize("thing", ["meta-llama/Llama-3.2-1B", 3, None])
def test_not_a_model_is_a_type_error(thing) -> None:
    with pytest.raises(TypeError, match="PreTrainedModel or PretrainedConfig"):
        RopeKVCache(thing, budget=64)


def test_a_config_needs_calibrated_statistics_for_the_default_scorer() -> None:
    """Online statistics need the model's queries: from a config, the default scorer is refused, naming the three
    ways out; a query-free scorer, or no budget (nothing is ever scored), is fine."""
    config = tiny_model("llama").config
    with pytest.raises(ValueError, match=r"pass the model.*FrequencyScorer\(stats=path\).*another scorer"):
        RopeKVCache(config, budget=64)
    RopeKVCache(config, budget=64, scorer=KeyNormScorer())
    RopeKVCache(config)


def test_attention_scorers_need_the_model() -> None:
    with pytest.raises(ValueError, match="recomputes attention from the model's queries.*not from its config"):
        RopeKVCache(tiny_model("llama").config, budget=64, scorer=SnapKVScorer(window=4))


def test_a_budget_below_the_sliding_window_is_refused() -> None:
    """Full layers must keep at least a window's worth: Gemma 3's sliding window is 8 here."""
    model = tiny_model("gemma3_text")
    with pytest.raises(ValueError, match=r"budget=6 is smaller than the sliding window \(8\).*budget >= 8"):
        RopeKVCache(model, budget=6, scorer=RecencyScorer())
    with pytest.raises(ValueError, match=r"budget=6 is smaller than the sliding window"):  # enable checks as the cache
        enable(model, budget=6, scorer=RecencyScorer())
    RopeKVCache(model, budget=8, scorer=RecencyScorer())


def test_a_budget_on_a_model_of_sliding_windows_only_warns_that_it_evicts_nothing() -> None:
    model = tiny_model("mistral_sliding")
    with pytest.warns(HfRopeKVWarning, match="evicts nothing.*bounded by their window \\(8 tokens\\)"):
        RopeKVCache(model, budget=16, compress_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RopeKVCache(model)  # no budget: nothing to warn about


@pytest.mark.parametrize("case, message", [
    ("no budget", "static=True needs a budget"),
    ("config", "needs the model, not its config"),
    ("snapkv", r"static=True cannot run SnapKVScorer.*attention weights.*static=False"),
])
def test_static_true_refuses_what_a_fixed_arena_cannot_hold(case: str, message: str) -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        if case == "no budget":
            RopeKVCache(model, static=True)
        elif case == "config":
            RopeKVCache(model.config, budget=16, scorer=RecencyScorer(), static=True)
        else:
            RopeKVCache(model, budget=16, scorer=SnapKVScorer(window=4), static=True)


def test_repr_and_the_transformers_contract() -> None:
    """No ``.to()`` (accelerate's send_to_device would call it and move the cache); ``get_max_length()`` is -1."""
    cache = RopeKVCache(tiny_model("llama"), budget=32, scorer=KeyNormScorer())
    assert not hasattr(cache, "to")
    assert cache.get_max_length() == -1
    assert cache.get_seq_length() == 0 and cache.tokens_kept == 0 and not cache.evicted
    text = repr(cache)
    assert "budget=32" in text and "scorer=KeyNormScorer" in text and "model_type='llama'" in text
    with pytest.raises(IndexError, match=r"layer_idx must be in \[0, 2\)"):
        cache.kept_positions(2)
