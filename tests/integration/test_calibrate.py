"""calibrate(): statistics of the query exactly as RoPE receives it (after q_proj and any query norm, before
rotation), against queries recomputed by hand from each attention's input, on tiny random models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)

from conftest import attention_modules, leftovers, randomize_query_norms, rotary_is_patched
from hf_ropekv.model.geometry import describe
from hf_ropekv.statistics.calibration import calibrate
from hf_ropekv.statistics.frequency_stats import FrequencyStats

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3":  # QK-norm on [B, S, H, D]
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=32))
    elif kind == "gemma3":  # QK-norm on [B, H, S, D]; sliding + full layers
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **SMALL, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
    elif kind == "llama3":  # no q_norm: the q_proj path; llama3-scaled RoPE
        model = LlamaForCausalLM(LlamaConfig(**SMALL, head_dim=16, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    elif kind == "stablelm":  # partial rotary (rotary_dim 8 of head_dim 16), per-head q_layernorm on [B, H, S, D]
        model = StableLmForCausalLM(StableLmConfig(**SMALL, partial_rotary_factor=0.5, qk_layernorm=True))
    else:
        raise ValueError(kind)
    randomize_query_norms(model)
    return model.eval()


def _recompute_queries(
    model: nn.Module, kind: str, input_ids: torch.Tensor, skip_norm: bool = False
) -> list[torch.Tensor]:
    """Per layer, [B, S, H, D] queries recomputed by hand from each attention's input: q_proj -> view -> norm."""
    geometry = describe(model)
    heads, head_dim = geometry.num_q_heads, geometry.head_dim
    hidden: dict[int, torch.Tensor] = {}
    attns = attention_modules(model)
    handles = [
        attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: hidden.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True,
        )
        for i, attn in enumerate(attns)
    ]
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
        for h in handles:
            h.remove()
        out = []
        for i, attn in enumerate(attns):
            q = attn.q_proj(hidden[i]).view(*hidden[i].shape[:2], heads, head_dim)  # [B, S, H, D]
            if not skip_norm and kind == "qwen3":
                q = attn.q_norm(q)
            elif not skip_norm and kind == "gemma3":
                q = attn.q_norm(q.transpose(1, 2)).transpose(1, 2)
            elif not skip_norm and kind == "stablelm":
                q = attn.q_layernorm(q.transpose(1, 2)).transpose(1, 2)
            out.append(q)
    return out


def _hand_stats(per_layer_queries: list[list[torch.Tensor]], pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    means, abs_means = [], []
    for chunks in per_layer_queries:
        q = torch.cat([c.flatten(0, 1) for c in chunks]).double()  # [N, H, D]
        z = torch.complex(q[..., :pairs], q[..., pairs : 2 * pairs])
        means.append(z.mean(0))
        abs_means.append(z.abs().mean(0))
    return torch.stack(means), torch.stack(abs_means)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "llama3", "stablelm"])
def test_calibrate_equals_statistics_of_hand_recomputed_queries(kind):
    model = _build(kind)
    geometry = describe(model)
    pairs = geometry.rotary_dim // 2
    gen = torch.Generator().manual_seed(7)
    lengths = [20, 9, 5, 11, 30]
    sequences = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]
    # chunk_tokens=24: the 30-token text splits into 24 + 6; the short pieces share right-padded batches.
    stats = calibrate(model, None, sequences, max_tokens=1000, chunk_tokens=24, progress=False)

    pieces = [s[i : i + 24] for s in sequences for i in range(0, len(s), 24)]
    recomputed = {False: [[] for _ in range(geometry.num_layers)], True: [[] for _ in range(geometry.num_layers)]}
    for piece in pieces:  # each piece alone, no padding
        for skip in (False, True):
            for layer, q in enumerate(_recompute_queries(model, kind, torch.tensor([piece]), skip_norm=skip)):
                recomputed[skip][layer].append(q)
    mean, abs_mean = _hand_stats(recomputed[False], pairs)

    assert stats.q_mean.shape == (geometry.num_layers, geometry.num_q_heads, pairs)
    assert stats.tokens == sum(lengths)
    torch.testing.assert_close(stats.q_mean, mean.to(torch.complex64), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.q_abs_mean, abs_mean.float(), rtol=1e-4, atol=1e-5)
    stats.check_compatible(geometry)
    assert stats.metadata["inv_freq"] == geometry.inv_freq.tolist()

    if kind in ("qwen3", "gemma3", "stablelm"):  # statistics that skipped the query norm would be detected
        skipped_mean, skipped_abs = _hand_stats(recomputed[True], pairs)
        assert (stats.q_abs_mean - skipped_abs.float()).abs().max() > 0.05
        assert (stats.q_mean - skipped_mean.to(torch.complex64)).abs().max() > 0.05
    if kind == "llama3":  # the model's own scaled frequencies, not theta^(-2i/d)
        default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        assert geometry.rope_type == "llama3" and not torch.allclose(geometry.inv_freq, default)
        assert stats.metadata["rope_type"] == "llama3"
    if kind == "stablelm":
        assert (geometry.rotary_dim, geometry.head_dim) == (8, 16)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "stablelm"])
def test_sequence_length_equal_to_the_head_count(kind):
    """S == H makes [B, S, H, D] and [B, H, S, D] the same shape: the statistics must still be per head, not per
    token position."""
    model = _build(kind)
    geometry = describe(model)
    ids = torch.randint(0, 128, (1, geometry.num_q_heads), generator=torch.Generator().manual_seed(3))
    stats = calibrate(model, None, ids, progress=False)
    mean, abs_mean = _hand_stats([[q] for q in _recompute_queries(model, kind, ids)], geometry.rotary_dim // 2)
    torch.testing.assert_close(stats.q_mean, mean.to(torch.complex64), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.q_abs_mean, abs_mean.float(), rtol=1e-4, atol=1e-5)


def test_calibration_leaves_nothing_on_the_model():
    """No hook, wrapper or patched rotary function after calibrate(), and the model's outputs are unchanged."""
    import importlib

    model = _build("qwen3")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    calibrate(model, None, ids, progress=False)
    assert leftovers(model) == []
    assert not rotary_is_patched(importlib.import_module(type(model).__module__))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, want, atol=0, rtol=0)


def _tiny_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


def test_text_through_a_tokenizer_and_the_saved_file(tmp_path):
    """calibrate(model, tokenizer, text) equals calibrate of the text's token ids, and the file .save() writes reads
    back as the same statistics, checked against the model. (The command line went: ``calibrate(...).save(path)`` is
    the one way to make a statistics file.)"""
    words = "the cache keeps long generations inside a fixed memory budget by scoring keys from rope".split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(90))
    model = _build("qwen3")
    tokenizer = _tiny_tokenizer(sorted(set(words)))
    from_text = calibrate(model, tokenizer, text, max_tokens=64, chunk_tokens=32, progress=False)
    ids = tokenizer(text)["input_ids"][:64]
    direct = calibrate(model, None, torch.tensor(ids), chunk_tokens=32, progress=False)
    assert from_text.tokens == direct.tokens == 64
    torch.testing.assert_close(from_text.q_mean, direct.q_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(from_text.q_abs_mean, direct.q_abs_mean, rtol=1e-5, atol=1e-6)
    out = tmp_path / "qwen3.safetensors"
    from_text.save(out)
    stats = FrequencyStats.resolve(out, describe(model))
    assert torch.equal(stats.q_mean, from_text.q_mean) and torch.equal(stats.q_abs_mean, from_text.q_abs_mean)
    assert stats.tokens == 64


def test_the_documented_entry_point():
    import hf_ropekv

    assert hf_ropekv.calibrate is calibrate
