"""What differs between transformers versions, against the installed transformers itself."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_ropekv import _compat


@pytest.mark.parametrize("n", [0, -3, -10, -30, 4, 10, 40])
def test_crop_target_is_what_dynamic_cache_keeps(n: int) -> None:
    """``crop(n)``: transformers' own DynamicCache of 10 tokens is the reference (negative n removes -n tokens; a
    positive n keeps the first n before 5.20 and is refused from 5.20 on)."""
    reference = DynamicCache()
    k = torch.randn(1, 2, 10, 4)
    reference.update(k, k.clone(), 0)
    try:
        reference.crop(n)
    except ValueError:
        with pytest.raises(ValueError, match="negative int"):
            _compat.crop_target(10, n)
        assert n > 0
        return
    assert _compat.crop_target(10, n) == reference.get_seq_length()
    assert _compat.crop_target(10, torch.tensor(n)) == reference.get_seq_length()  # assisted decoding: 0-d tensors


def test_the_cache_keyword_follows_the_generate_signature() -> None:
    """transformers 5.24 renamed generate's and forward's ``past_key_values`` to ``cache``."""
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    takes_cache = "cache" in inspect.signature(type(model).forward).parameters
    assert _compat.cache_kwarg(model) == ("cache" if takes_cache else "past_key_values")
