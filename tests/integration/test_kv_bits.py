"""``kv_bits=8``: the kept keys and values stored as int8 codes with one float32 scale per token and KV head, keys
divided first by a per-row channel balance fixed at the first forward.

Reference: the same model on a ``DynamicCache`` whose full-attention layers store each token's keys and values
quantized and dequantized by the definition (``scale = max|x| / 127``, ``q = round(x / scale)``; for keys ``x`` is
the key over its balance: each channel's largest ``|key|`` over the row's real first-forward tokens, the same for
both channels of a rotary pair, over the head's largest, at least 1e-3; all written out here), so what attention
reads is known exactly; sliding-window layers stay full precision, as the cache leaves them.
With nothing evicted the cache must give that reference's tokens and logits; with eviction, the reference masked to
the kept tokens (``tests/reference.py``). On the CPU attention reads the codes through sdpa on their dequantized
values; on CUDA, after a layer's first eviction, the decode kernel reads them (``gpu``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

from conftest import FAMILIES, FAMILY_NAMES, attention_modules, cache_kw, family_model, padded_batch, tiny_model
from hf_ropekv import RopeKVCache, enable
from hf_ropekv.enable import is_enabled
from hf_ropekv.kernels.quantize import channel_balance
from reference import FULL, layer_types, run_and_compare


def round_trip(x: torch.Tensor, balance: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, H, S, D]`` (over ``balance [B, H, 1, D]``) through int8 with a scale per (row, head, token), by the
    definition, float32 math."""
    xf = x.float() if balance is None else x.float() / balance
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
    y = torch.round(xf / scale).clamp(-127, 127) * scale
    return (y if balance is None else y * balance).to(x.dtype)


def rotary_partner(layout: str, rotary_dim: int, head_dim: int) -> torch.Tensor:
    """The other channel of each channel's rotary pair: ``i`` and ``i + rotary_dim / 2`` (rotate-half) or ``2i`` and
    ``2i + 1`` (interleaved), for the first ``rotary_dim`` channels; the channels RoPE leaves alone are their own."""
    partner = list(range(head_dim))
    for i in range(rotary_dim // 2):
        a, b = (i, i + rotary_dim // 2) if layout == "rotate_half" else (2 * i, 2 * i + 1)
        partner[a], partner[b] = b, a
    return torch.tensor(partner)


def balance_by_definition(keys: torch.Tensor, pads: list[int], partner: torch.Tensor | None = None) -> torch.Tensor:
    """Each channel's largest |key| over row b's tokens from ``pads[b]`` on, the two channels of a rotary pair tied
    (``partner``; default: rotate-half over the whole head), over the head's largest, floored at 1e-3."""
    largest = torch.stack([keys[b, :, pad:].float().abs().amax(dim=1) for b, pad in enumerate(pads)])[:, :, None]
    if partner is None:
        partner = rotary_partner("rotate_half", keys.shape[-1], keys.shape[-1])
    largest = torch.maximum(largest, largest[..., partner])
    return (largest / largest.amax(dim=-1, keepdim=True)).clamp_min(1e-3)


class Int8FullLayers(DynamicCache):
    """A full cache whose full-attention layers hold int8-round-tripped keys (balanced from the first update, the
    rows' left padding ``(mask == 0).sum(-1)`` left out) and values."""

    def __init__(self, model, mask: torch.Tensor, partner: torch.Tensor | None = None) -> None:
        super().__init__()  # no config: every layer keeps every token (the masks do the rest)
        self.full = {i for i, kind in enumerate(layer_types(model)) if kind == FULL}
        self.pads = (mask == 0).sum(-1).tolist()
        self.partner = partner
        self.balance: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.full:
            if layer_idx not in self.balance:
                self.balance[layer_idx] = balance_by_definition(key_states, self.pads, self.partner)
            key_states = round_trip(key_states, self.balance[layer_idx])
            value_states = round_trip(value_states)
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
    want = model.generate(**cache_kw(model, Int8FullLayers(model, mask)), **kw)
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
    max_kept = run_and_compare(model, cache, [ids], mask, decode_steps=30, reference=Int8FullLayers(model, mask))
    assert cache.num_compactions >= 5 and cache.evicted and max_kept <= 16 + 4


def keys_head_dim(model) -> int:
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_rope_family_evicts_through_int8(name: str, static: bool) -> None:
    """Every RoPE family of ``conftest.FAMILIES`` (fused QKV, partial rotary, interleaved pairs, sinks, ...) attends
    to exactly the int8 tokens it kept; the families that run on eager attention only, or whose attention calls sdpa
    itself (Falcon on transformers 5.17), get the clear error."""
    model = family_model(name)
    if model.config._attn_implementation != "sdpa":
        with pytest.raises(ValueError, match="kv_bits=8 needs a model on sdpa attention"):
            RopeKVCache(model, budget=16, kv_bits=8, static=static)
        return
    attention_forward = type(attention_modules(model)[0]).forward
    if "ALL_ATTENTION_FUNCTIONS" not in inspect.getsource(attention_forward):  # Falcon on transformers 5.17
        with pytest.raises(ValueError, match="kv_bits=8 needs attention that transformers looks up by name.*Falcon"):
            RopeKVCache(model, budget=16, kv_bits=8, static=static)
        return
    _, _, layout, rotary_dim = FAMILIES[name]
    ids, mask = padded_batch(model.config.vocab_size)
    partner = rotary_partner(layout, rotary_dim, keys_head_dim(model))
    cache = RopeKVCache(model, budget=16, compress_every=4, kv_bits=8, static=static)
    max_kept = run_and_compare(model, cache, [ids], mask, decode_steps=20,
                               reference=Int8FullLayers(model, mask, partner))
    assert cache.num_compactions >= 2 and cache.evicted and max_kept <= 16 + 4


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_each_row_is_balanced_by_its_own_real_tokens(static: bool) -> None:
    """The balance of a padded batch's row leaves its padding out (so its codes do not depend on its batch): it is
    the definition's, computed from a DynamicCache's float keys of the same prompt (the full-attention tests above
    check every layer against the reference)."""
    model = tiny_model("llama")
    with torch.no_grad():  # the pad token's embedding is zeros (padding_idx), which would give zero keys
        model.get_input_embeddings().weight[0].normal_()
    ids, mask = padded_batch(model.config.vocab_size, lengths=(12, 3))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
    cache, full = RopeKVCache(model, budget=4096, kv_bits=8, static=static), DynamicCache(config=model.config)
    model.generate(**cache_kw(model, cache), **kw)
    model.generate(**cache_kw(model, full), **kw)
    pads = (mask == 0).sum(-1).tolist()
    keys = full.layers[0].keys  # the first layer's: later ones read int8 keys in the cache, float ones in `full`
    want = balance_by_definition(keys, pads)
    assert torch.equal(cache.layers[0].storage.balance, want)
    assert not torch.equal(balance_by_definition(keys, [0, 0])[1], want[1])  # the padding would count


def test_balanced_int8_keys_keep_the_logits_of_a_head_with_an_outlier_pair() -> None:
    """Keys with one rotary pair 40x the others (a key bias, turned by RoPE): per-token int8 leaves the other
    channels a handful of levels; balanced, the attention logits err at least 3x less (4.2x to 6.6x over 20 seeds)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    keys = torch.randn(1, 2, 64, 32, generator=g)
    angle = 0.01 * torch.arange(64.0)
    keys[..., 3], keys[..., 19] = 40 * torch.cos(angle), 40 * torch.sin(angle)  # the pair (3, 3 + 16)
    queries = torch.randn(1, 2, 8, 32, generator=g)
    partner = torch.cat([torch.arange(16, 32), torch.arange(16)])
    balance = channel_balance(keys, torch.zeros(1, dtype=torch.long), partner)
    assert torch.equal(balance, balance_by_definition(keys, [0]))

    def logit_error(approx: torch.Tensor) -> float:
        return (queries @ (approx - keys).transpose(-1, -2)).abs().mean().item()

    assert logit_error(round_trip(keys, balance)) < logit_error(round_trip(keys)) / 3


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
    sums in another order than sdpa (and multiplies the query, not the keys, by the balance), so the logits agree to
    float32 accumulation, not bit for bit (1.006e-4 at most on an H100 at 0003bc9)."""
    model = tiny_model("llama", head_dim=64, hidden_size=256, num_hidden_layers=3).cuda()
    ids, mask = padded_batch(model.config.vocab_size)
    cache = RopeKVCache(model, budget=16, compress_every=4, kv_bits=8, static=static)
    run_and_compare(model, cache, [ids.cuda()], mask.cuda(), decode_steps=40, atol=2e-4,
                    reference=Int8FullLayers(model, mask))
    assert cache.num_compactions >= 8
