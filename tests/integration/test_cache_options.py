"""What the options promise once the cache runs: a cache is bound to its model, the memory it holds never exceeds a
``DynamicCache``'s by more than a page, and small budgets hold less. The reference for bytes is transformers' own
``DynamicCache`` after the same generate() call, its tensors summed here (``dynamic_cache_bytes``)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import cache_kw, dynamic_cache_bytes, padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv.cache.options import PAGE_SIZE
from hf_ropekv.scorers import RecencyScorer


def _generate(model, cache, ids, mask=None, new=4):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=new,
                          do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("other_arch", ["qwen3", "llama"])
def test_a_cache_is_bound_to_its_model(other_arch) -> None:
    """Another model's forward is refused, naming both, before anything is stored: a fresh cache, and a used one
    continued elsewhere (another instance of the same class included)."""
    model, other = tiny_model("llama"), tiny_model(other_arch)
    ids = torch.randint(3, 100, (1, 6))
    fresh = RopeKVCache(model, budget=16, compress_every=4)
    with pytest.raises(ValueError, match=f"built for a LlamaForCausalLM.*{type(other).__name__}"):
        _generate(other, fresh, ids)
    assert fresh.tokens_seen == 0
    used = RopeKVCache(model, budget=16, compress_every=4)
    out = _generate(model, used, ids)
    with pytest.raises(ValueError, match="bound to it"), torch.no_grad():
        other(input_ids=ids[:, :1], **cache_kw(other, used))
    assert used.tokens_seen == 6 + 3  # refused before anything was stored
    _generate(model, used, torch.cat([out, ids[:, :3]], dim=1))  # its own model continues it


def test_a_cache_refuses_a_model_with_more_layers() -> None:
    model, deeper = tiny_model("llama"), tiny_model("llama", num_hidden_layers=4)
    cache = RopeKVCache(model.config, budget=16, compress_every=4, scorer=RecencyScorer())  # a config: no hooks
    with pytest.raises(ValueError, match="holds 2 layers .* updates layer 2.*bound to its model"), torch.no_grad():
        deeper(input_ids=torch.randint(3, 100, (1, 6)), **cache_kw(deeper, cache))


def page_bytes(model, batch: int) -> int:
    """Bytes of one page of keys and values, all full-attention layers of ``model`` (float32)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * batch * config.num_key_value_heads * PAGE_SIZE * head_dim * 4 * config.num_hidden_layers


@pytest.mark.parametrize("budget, static", [(None, False), (4096, False), (4096, True)],
                         ids=["no budget", "growing", "static"])
@pytest.mark.parametrize("arch, lengths, new", [("llama", (12, 9, 6), 40), ("llama", (10,), 150),
                                                 ("gemma3_text", (12, 9), 40)])
def test_nothing_evicted_holds_at_most_a_dynamic_cache_plus_a_page(arch, lengths, new, budget, static) -> None:
    """Issue 44, item 8: a cache that evicts nothing holds at most what a DynamicCache holds plus one page, whatever
    the budget (a static arena is sized for the generate() call), batches included; and its summary says what a
    DynamicCache would hold, exactly."""
    model = tiny_model(arch)
    ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
    reference = DynamicCache(config=model.config)
    _generate(model, reference, ids, mask, new)
    cache = RopeKVCache(model, budget=budget, static=static)
    _generate(model, cache, ids, mask, new)
    assert not cache.evicted and cache.tokens_seen == reference.get_seq_length()
    full = dynamic_cache_bytes(reference)
    assert cache.full_cache_bytes == full
    assert cache.bytes_held <= full + page_bytes(model, len(lengths)), (cache.bytes_held, full)


@pytest.mark.parametrize("budget, every", [(8, 4), (24, 16), (40, 8)])
def test_a_small_budget_holds_less_than_dynamic_cache(budget, every) -> None:
    """Budgets far below a page: the arena stops at budget + compress_every (not rounded up to a page)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 6))
    cache = RopeKVCache(model, budget=budget, compress_every=every, window=0)
    _generate(model, cache, ids, new=80)
    reference = DynamicCache(config=model.config)
    _generate(model, reference, ids, new=80)
    assert cache.num_compactions > 0 and cache.tokens_kept <= budget + every
    config = model.config
    arena = 2 * (budget + every) * config.num_key_value_heads * config.head_dim * 4 * config.num_hidden_layers
    positions = (budget + every) * config.num_key_value_heads * 8 * config.num_hidden_layers
    assert cache.bytes_held == arena + positions < dynamic_cache_bytes(reference)
