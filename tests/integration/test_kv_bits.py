"""``kv_bits=8``: the kept keys and values stored as int8 codes with one float32 scale per token and KV head.

Reference: the same model on a ``DynamicCache`` whose full-attention layers store each token's keys and values
quantized and dequantized by the definition (``scale = max|x| / 127``, ``q = round(x / scale)``, written out here),
so what attention reads is known exactly; sliding-window layers stay full precision, as the cache leaves them.
With nothing evicted the cache must give that reference's tokens and logits; with eviction, the reference masked to
the kept tokens (``tests/reference.py``). On the CPU attention reads the codes through sdpa on their dequantized
values; on CUDA, after a layer's first eviction, the decode kernel reads them (``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import cache_kw, padded_batch, tiny_model
from hf_ropekv import RopeKVCache, enable
from hf_ropekv.enable import is_enabled
from reference import FULL, layer_types, run_and_compare


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, S, D]`` through int8 with a scale per (row, head, token), by the definition, float32 math."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
    return (torch.round(xf / scale).clamp(-127, 127) * scale).to(x.dtype)


class Int8FullLayers(DynamicCache):
    """A full cache whose full-attention layers hold int8-round-tripped keys and values."""

    def __init__(self, model) -> None:
        super().__init__()  # no config: every layer keeps every token (the masks do the rest)
        self.full = {i for i, kind in enumerate(layer_types(model)) if kind == FULL}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.full:
            key_states, value_states = round_trip(key_states), round_trip(value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_the_reference_rounds_as_int8_does() -> None:
    """The reference's own check: a round trip is within half a step of the input, and it changes the input."""
    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0))
    y = round_trip(x)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert (y - x).abs().le(step / 2 + 1e-7).all() and not torch.equal(x, y)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_nothing_evicted_equals_the_int8_full_cache(arch: str, static: bool) -> None:
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    want = model.generate(**cache_kw(model, Int8FullLayers(model)), **kw)
    cache = RopeKVCache(model, budget=4096, kv_bits=8, static=static)
    got = model.generate(**cache_kw(model, cache), **kw)
    assert torch.equal(got.sequences, want.sequences)
    plain = model.generate(**cache_kw(model, DynamicCache(config=model.config)), **kw)
    int8_effect = max((a - b).abs().max().item() for a, b in zip(want.logits, plain.logits))
    assert int8_effect > 1e-3, f"int8 storage moved the logits by {int8_effect:.1e} only: a weak reference"
    # Bit for bit on transformers 5.25; 5.17 sums hf_ropekv's attention function and its own sdpa in another order
    # (up to 1.5e-4 after 20 steps of qwen3): at least 10x closer to the int8 reference than int8 is to float32.
    distance = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))
    assert distance <= 0.1 * int8_effect, (distance, int8_effect)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_eviction_matches_the_masked_int8_reference(arch: str, static: bool) -> None:
    """Each full-attention layer attends to exactly the int8 tokens it kept, across compactions, in a padded batch;
    the compaction moves codes and scales together."""
    overrides = {"num_hidden_layers": 3} if arch != "gemma3_text" else {}
    model = tiny_model(arch, **overrides)
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4, kv_bits=8, static=static)
    max_kept = run_and_compare(model, cache, [ids], mask, decode_steps=30, reference=Int8FullLayers(model))
    assert cache.num_compactions >= 5 and cache.evicted and max_kept <= 16 + 4


def test_int8_storage_holds_about_a_third_of_float32() -> None:
    """float32 keys and values of head_dim 16 (128 bytes a token and head) against int8 codes and two float32 scales
    (40 bytes): the same tokens kept, a third of the bytes or less, slot positions included."""
    model = tiny_model("llama")
    ids, mask = padded_batch(model.config.vocab_size)
    held = {}
    for bits in (None, 8):
        cache = RopeKVCache(model, budget=16, compress_every=4, kv_bits=bits)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                       **cache_kw(model, cache))
        held[bits] = (cache.bytes_held, cache.tokens_kept, cache.full_cache_bytes)
    assert held[8][1] == held[None][1] and held[8][2] == held[None][2]
    assert held[8][0] <= held[None][0] / 2 and held[8][0] < held[8][2] / 4


def test_kv_bits_needs_the_model_on_sdpa() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kv_bits=8 needs the model, not its config"):
        RopeKVCache(model.config, budget=16, kv_bits=8)
    eager = tiny_model("llama", attn_implementation="eager")
    with pytest.raises(ValueError, match="kv_bits=8 needs a model on sdpa attention.*'eager'.*kv_bits=None"):
        RopeKVCache(eager, budget=16, kv_bits=8)
    with pytest.raises(ValueError, match="kv_bits=8 needs a model on sdpa attention"):  # at enable, not at generate
        enable(eager, budget=16, kv_bits=8)
    assert not is_enabled(eager)


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_eviction_matches_the_masked_int8_reference_on_cuda(static: bool, deterministic_sdpa) -> None:
    """The decode kernel reads the int8 codes after the first eviction (plain forwards: no graph, no compile); it
    sums in another order than sdpa, so the logits agree to float32 accumulation, not bit for bit."""
    model = tiny_model("llama", head_dim=64, hidden_size=256, num_hidden_layers=3).cuda()
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4, kv_bits=8, static=static)
    run_and_compare(model, cache, [ids.cuda()], mask.cuda(), decode_steps=40, atol=1e-4,
                    reference=Int8FullLayers(model))
    assert cache.num_compactions >= 8
