"""The per-step host path: what a decoding step costs on the host, and that the shortcuts taken change nothing.

A decoding step of a large model at batch 1 is bound by the host launching its kernels, so the cache keeps its
own per-step work small: reused arena views (``storage._StepViews``), one fold of all layers' queries
(``OnlineStatistics.end_forward``), and no per-step op on generate's full-length mask or positions once the
padding is known (``RopeKVCache._appends_real_token``). These tests count the ops (deterministic, unlike
times) and check each shortcut against the plain computation.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg
from hf_ropekv.model.geometry import describe
from hf_ropekv.statistics.online import OnlineStatistics
from hf_ropekv.storage.paged import PagedKV


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


def _plain_append(storage: PagedKV, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    end = storage.length + keys.shape[2]
    storage._reserve(keys, values, end)
    storage.keys[:, :, storage.length : end] = keys
    storage.values[:, :, storage.length : end] = values
    storage.length = end
    return storage.keys[:, :, :end], storage.values[:, :, :end]


def test_step_views_write_what_slicing_writes_and_follow_the_arena() -> None:
    gen = torch.Generator().manual_seed(0)
    fast, slow = PagedKV(4, capacity_hint=12), PagedKV(4, capacity_hint=12)
    for storage in (fast, slow):
        storage.append(torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen), 0)
    slow.keys.copy_(fast.keys)
    slow.values.copy_(fast.values)
    with torch.no_grad():
        for step in range(20):
            if fast.length == 11:  # come back to an earlier length, as a compaction does
                fast.length = slow.length = 7
            k, v = torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen)
            got = fast.append(k, v, first_position=fast.length)
            want = _plain_append(slow, k, v)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert got[0].data_ptr() == fast.keys.data_ptr()  # a view of the arena, never a copy
    assert len(fast._step_views.by_length) == 4  # lengths 7..10, each sliced once
    fast.select_batch(torch.tensor([0]))  # a new arena: the views of the old one must not be written
    with torch.no_grad():
        got = fast.append(k, v, first_position=fast.length)
    assert torch.equal(fast.keys[:, :, fast.length - 1 : fast.length], k) and got[0]._base is fast.keys


def test_step_views_are_not_shared_by_a_deep_copy_nor_used_with_autograd() -> None:
    storage = PagedKV(4, capacity_hint=8)
    storage.append(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), 0)
    with torch.no_grad():
        storage.append(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 3)
    twin = copy.deepcopy(storage)
    storage.length = twin.length = 3
    with torch.no_grad():
        twin.append(torch.full((1, 1, 1, 4), 7.0), torch.full((1, 1, 1, 4), 7.0), 3)
    assert float(storage.keys[0, 0, 3, 0]) == 1.0 and float(twin.keys[0, 0, 3, 0]) == 7.0
    # With autograd on (views cut under no_grad must not be written then) the plain slicing runs.
    storage.length = 3
    k = torch.randn(1, 1, 1, 4, requires_grad=True)
    keys, _ = storage.append(k, k.detach(), 3)
    keys.sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))


def _reference_sums(queries: list[list[torch.Tensor]], pairs: int, factor: float) -> list[torch.Tensor]:
    """Per layer: sums = sums * factor + [real, imag, modulus] of each step's query, in float64, step by step."""
    out = []
    for per_step in queries:
        sums = None
        for q in per_step:  # [B, 1, H, D]
            q = q[:, 0].float()
            real, imag = q[..., :pairs], q[..., pairs : 2 * pairs]
            parts = torch.stack((real, imag, torch.hypot(real, imag)), dim=-3).double()
            sums = parts if sums is None else sums * factor + parts
        out.append(sums)
    return out


@pytest.mark.parametrize("order", ["in_order", "reversed"])
def test_online_fold_of_decoding_steps_is_the_step_by_step_sum(order: str) -> None:
    """One fold of all layers per step (one concatenation, one add) gives the float64 sums bit for bit."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    geometry = describe(model)
    stats = OnlineStatistics(geometry, half_life=16)
    gen = torch.Generator().manual_seed(3)
    layers = list(range(geometry.num_layers))
    if order == "reversed":
        layers.reverse()  # layer order differs from the sums' rows: the index_add path
    steps = [[torch.randn(2, 1, geometry.num_q_heads, geometry.head_dim, generator=gen) for _ in layers]
             for _ in range(5)]
    for step in steps:
        stats.begin_forward(None, 1)
        for layer_idx, q in zip(layers, step):
            stats.add(layer_idx, q)
        stats.end_forward()
    per_layer = [[step[layers.index(layer)] for step in steps] for layer in range(geometry.num_layers)]
    want = _reference_sums(per_layer, geometry.rotary_dim // 2, 0.5 ** (1 / 16))
    device = next(iter(stats._sums))
    for layer in range(geometry.num_layers):
        got = stats._sums[device][stats._slot[layer][1]]
        assert torch.equal(got, want[layer]), layer
    count = 0.0
    for _ in steps:
        count = count * 0.5 ** (1 / 16) + 1.0
    assert torch.equal(stats._counts[device], torch.full((2,), count, dtype=torch.float64))


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
    original = cache._forward_starts

    def spy(attention_mask, new, batch, device, input_ids=None):
        kept_per_row.append(cache.tokens_kept_per_row)
        out = original(attention_mask, new, batch, device, input_ids)
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
