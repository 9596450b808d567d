"""The per-step host path: what a decoding step costs on the host, and that the shortcuts taken change nothing.

A decoding step of a large model at batch 1 is bound by the host launching its kernels, so the cache keeps its
own per-step work small: reused arena views, one fold of all layers' queries, and no per-step op on generate's
full-length mask or positions once the padding is known. These tests count the ops (deterministic, unlike times)
and check that the shortcuts change nothing (the views and the fold against plain tensors: tests/unit).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Steps(LogitsProcessor):
    """Op counts at every step's logits, and the cache's compaction count."""

    def __init__(self, counter: _Ops, cache) -> None:
        self.counter, self.cache, self.counts, self.compactions = counter, cache, [], []

    def __call__(self, input_ids, scores):
        self.counts.append(Counter(self.counter.ops))
        self.compactions.append(getattr(self.cache, "num_compactions", 0))
        return scores


def _ops_per_plain_step(model, cache, ids, steps: int, warm: int) -> tuple[float, dict[str, float]]:
    """Mean ATen ops per decoding step without compaction after the first ``warm``, and their mix by op."""
    counter = _Ops()
    recorder = _Steps(counter, cache)
    with counter, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, do_sample=False,
                       logits_processor=LogitsProcessorList([recorder]), **{cache_kwarg(model): cache})
    plain = [recorder.counts[i + 1] - recorder.counts[i] for i in range(warm, steps)
             if recorder.compactions[i + 1] == recorder.compactions[i]]
    total: Counter = Counter()
    for step in plain:
        total.update(step)
    return sum(total.values()) / len(plain), {name: count / len(plain) for name, count in total.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_decoding_step_adds_few_ops_over_dynamic_cache(arch: str) -> None:
    """Steady state (second compaction cycle), batch 1, online statistics: a fixed handful of ops per step plus
    one per layer (the capture's view of the query), whatever the depth and the context. Before the host path
    was trimmed it was ~8.5 per layer plus ~20 (views of the arena, per-layer query copies, the mask)."""
    model = tiny_model(arch, num_hidden_layers=6)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(0))
    dynamic, dynamic_mix = _ops_per_plain_step(model, DynamicCache(config=model.config), ids, steps=30, warm=16)
    cache = RopeKVCache(model, budget=64, compress_every=16, protect_prompt=False)
    rope, mix = _ops_per_plain_step(model, cache, ids, steps=30, warm=16)
    assert cache.num_compactions >= 2
    layers = model.config.num_hidden_layers
    assert rope - dynamic <= layers + 16, (rope - dynamic, mix)
    # No sync of the cache's own; on transformers 5.17 one fewer than DynamicCache's: a decoding step with no slot to
    # hide hands the model no mask, so transformers has no mask's all() to check (5.24's generate drops it itself).
    assert mix.get("_local_scalar_dense", 0) <= dynamic_mix.get("_local_scalar_dense", 0)
    assert "nonzero" not in mix and "lift_fresh" not in mix  # nothing built from host values per step


@pytest.mark.parametrize("padded", [False, True])
def test_decoding_steps_hand_the_model_generates_own_mask_or_none(padded: bool) -> None:
    """A padded batch whose rows compact alike: generate's mask already hides exactly each row's holes after a
    compaction, so the cache hands it on instead of rebuilding it every step. Batch 1 without padding: decoding
    steps have nothing to hide, and the model gets no mask at all (no per-step gather of the kept columns)."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    batch = 2 if padded else 1
    ids = torch.randint(3, 128, (batch, 20), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0  # row 1 keeps fewer tokens than row 0 for a while: holes after the first compaction
    cache = RopeKVCache(model, budget=16, compress_every=4, protect_prompt=False)
    replaced, dropped, kept_per_row = [], [], []
    original = cache._forward_starts  # private: what the model's pre-hook hands the forward is the mechanism here

    def spy(attention_mask, new, batch, device):
        kept_per_row.append(cache.tokens_kept_per_row)
        out = original(attention_mask, new, batch, device)
        replaced.append(out is not None and out is not attention_mask)
        if attention_mask is not None:  # transformers >= 5.2x's generate drops an all-ones mask itself
            dropped.append(out is None)
        return out

    cache._forward_starts = spy
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                       **{cache_kwarg(model): cache})
    del cache._forward_starts  # the spy holds the cache (a cycle): its hooks would outlive the test until a collection
    assert cache.num_compactions >= 3
    assert not any(replaced)
    if dropped:  # a mask reached the cache: the prompt keeps it, later steps have none to hide unless a row is padded
        assert dropped == [False] + [not padded] * (len(dropped) - 1)
    else:  # generate dropped an all-ones mask itself; a padded batch always has one
        assert not padded
    if padded:  # row 1 held fewer tokens than row 0 (behind holes) for a while, then caught up
        assert any(row1 < row0 for row0, row1 in kept_per_row[1:]), kept_per_row
        assert cache.tokens_kept_per_row[1] == cache.tokens_kept


def test_a_decoding_step_without_holes_reaches_the_model_without_a_mask() -> None:
    """What the model's forward receives (a pre-hook registered after the cache's): no mask in batch-1 decoding
    steps, generate's mask for the prompt; and the tokens are DynamicCache's (nothing evicted)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    cache = RopeKVCache(model, budget=64, compress_every=8)
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, **{cache_kwarg(model): cache})
    handle.remove()  # registered after the cache's hooks: runs after them and sees what they handed on
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, **{cache_kwarg(model): DynamicCache(config=model.config)})
    assert torch.equal(out, ref)
    assert len(seen) == 8 and all(mask is None for mask in seen[1:])
    # The prompt: generate's all-ones mask as given (5.17), or none where generate dropped it itself (5.24).
    assert seen[0] is None or torch.equal(seen[0], torch.ones_like(ids))
