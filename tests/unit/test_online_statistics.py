"""Online query statistics (``hf_ropekv.statistics.online.OnlineStatistics``) against their definition, written out.

A forward of ``n`` tokens (padding columns included) first decays everything counted before by ``f ** n`` with
``f = 0.5 ** (1 / half_life)``, then adds each row's real queries with weight 1. A row's statistics are its weighted
means of ``q_f`` and ``|q_f|``, each query head then pulled toward its layer's head average by ``head_shrink``
pseudo-queries. The ways queries arrive (a multi-token forward, an eager decoding step per layer or all layers at
once, deferred and folded later, a static cache's step folded in place into leased buffers) must all give that.
Read through ``snapshot()`` only, the statistics the scorer gets.
"""

from __future__ import annotations

import pytest
import torch

from conftest import head_shrunk, query_pairs, tiny_config
from hf_ropekv.model.geometry import describe
from hf_ropekv.statistics.online import DEFER_STEPS, OnlineStatistics

B = 2


def geometry_of(arch: str = "llama", **overrides):
    return describe(tiny_config(arch, num_hidden_layers=3, **overrides))


def random_queries(geometry, tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    """One ``[B, tokens, H, D]`` query tensor per layer, off-centre so means and moduli differ."""
    return [torch.randn(B, tokens, geometry.num_q_heads, geometry.head_dim, generator=gen) * 1.5 + 0.7
            for _ in range(geometry.num_layers)]


def expected(geometry, forwards: list[tuple[list[torch.Tensor], torch.Tensor | None]], half_life, shrink, layer):
    """Per-row ``(q_mean, q_abs_mean, tokens)`` of ``layer`` after ``forwards`` (each: per-layer queries and a
    ``[B, S]`` mask or None), from the definition in the module docstring, float64."""
    f = 1.0 if half_life is None else 0.5 ** (1 / half_life)
    pairs = geometry.rotary_dim // 2
    sums = torch.zeros(B, geometry.num_q_heads, pairs, dtype=torch.complex128)
    moduli = torch.zeros(B, geometry.num_q_heads, pairs, dtype=torch.float64)
    count = torch.zeros(B, dtype=torch.float64)
    for queries, mask in forwards:
        q = query_pairs(queries[layer], geometry.rotary_layout, pairs)  # [B, S, H, F]
        real = torch.ones(q.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        decay = f ** q.shape[1]
        q = torch.where(real[..., None, None], q, 0)  # (where, not a product: padding may hold NaN)
        sums = sums * decay + q.sum(1)
        moduli = moduli * decay + q.abs().sum(1)
        count = count * decay + real.sum(1)
    mean, abs_mean = sums / count.view(-1, 1, 1), moduli / count.view(-1, 1, 1)
    return head_shrunk(mean, count, shrink), head_shrunk(abs_mean, count, shrink), count


def assert_matches(stats: OnlineStatistics, geometry, forwards, half_life, shrink) -> None:
    snap = stats.snapshot()
    for layer in range(geometry.num_layers):
        want_mean, want_abs, want_count = expected(geometry, forwards, half_life, shrink, layer)
        got_mean, got_abs = snap.for_layer(layer)
        assert got_mean.dtype == torch.complex64 and got_abs.dtype == torch.float32
        torch.testing.assert_close(got_mean.to(torch.complex128), want_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_abs.double(), want_abs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(snap.tokens, want_count, rtol=1e-12, atol=1e-12)


def run_forward(stats: OnlineStatistics, queries: list[torch.Tensor], mask: torch.Tensor | None = None,
                order=None) -> None:
    stats.begin_forward(mask, queries[0].shape[1])
    layers = list(range(len(queries))) if order is None else order
    for layer in layers:
        stats.add(layer, queries[layer])
    stats.end_forward()


@pytest.mark.parametrize("half_life, shrink", [(None, 0.0), (5.0, 0.0), (None, 3.0), (7.0, 256.0)])
def test_prompts_with_padding_are_each_rows_real_queries(half_life, shrink) -> None:
    """Two prompt chunks with left padding (NaN under it: padding must not leak in) and a second turn."""
    geometry = geometry_of()
    gen = torch.Generator().manual_seed(1)
    stats = OnlineStatistics(geometry, half_life=half_life, head_shrink=shrink)
    first, second, turn = (random_queries(geometry, n, gen) for n in (6, 4, 3))
    pad = torch.ones(B, 6, dtype=torch.bool)
    pad[1, :4] = False
    for q in first:
        q[1, :4] = float("nan")
    forwards = [(first, pad), (second, None), (turn, None)]
    for queries, mask in forwards:
        run_forward(stats, queries, mask)
    assert_matches(stats, geometry, forwards, half_life, shrink)
    assert stats.snapshot().tokens.tolist() == pytest.approx(
        expected(geometry, forwards, half_life, shrink, 0)[2].tolist())


@pytest.mark.parametrize("half_life", [None, 5.0])
@pytest.mark.parametrize("delivery", ["per layer", "all layers at once"])
def test_decoding_steps_however_they_arrive_are_the_sequential_decayed_sum(half_life, delivery: str) -> None:
    """A prompt, then more decoding steps than are deferred at once (the last ones still deferred when read): the
    means of folding each step on its own."""
    geometry = geometry_of()
    gen = torch.Generator().manual_seed(3)
    stats = OnlineStatistics(geometry, half_life=half_life, head_shrink=2.0)
    prompt = random_queries(geometry, 5, gen)
    forwards = [(prompt, None)]
    run_forward(stats, prompt)
    layers = tuple(range(geometry.num_layers))
    for _ in range(DEFER_STEPS + 5):
        step = random_queries(geometry, 1, gen)
        forwards.append((step, None))
        stats.begin_forward(None, 1)
        if delivery == "per layer":
            for layer in layers:
                stats.add(layer, step[layer])
        else:
            stats.add_step(layers, step)  # [B, 1, H, D] each
        stats.end_forward()
    assert_matches(stats, geometry, forwards, half_life, 2.0)


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_a_static_step_folds_in_place_into_its_leased_buffers(order: str) -> None:
    """A static cache moves the sums into leased buffers; its decoding steps then fold into them in place (at the
    last layer, or layer by layer when the layers come in another order), giving the same means."""
    geometry = geometry_of()
    gen = torch.Generator().manual_seed(4)
    stats = OnlineStatistics(geometry, half_life=3.0, head_shrink=1.0)
    prompt = random_queries(geometry, 5, gen)
    forwards = [(prompt, None)]
    run_forward(stats, prompt)
    leased: list[torch.Tensor] = []

    def take(purpose, shape, dtype, make):
        leased.append(make())
        assert tuple(leased[-1].shape) == tuple(shape) and leased[-1].dtype == dtype
        return leased[-1]

    stats.move_to_buffers(take)
    assert stats.on_buffers and {id(t) for t in stats.buffers()} == {id(t) for t in leased}
    layers = list(range(geometry.num_layers))
    for _ in range(6):
        step = random_queries(geometry, 1, gen)
        forwards.append((step, None))
        run_forward(stats, step, order=layers if order == "in order" else layers[::-1])
    assert {id(t) for t in stats.buffers()} == {id(t) for t in leased}  # folded in place, never replaced
    assert_matches(stats, geometry, forwards, 3.0, 1.0)


def test_interleaved_pairs_follow_the_models_layout() -> None:
    """Cohere pairs dims (2f, 2f + 1): the statistics must too (``query_pairs`` builds them by index)."""
    from transformers import CohereConfig

    geometry = describe(CohereConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
    assert geometry.rotary_layout == "interleaved"
    gen = torch.Generator().manual_seed(5)
    stats = OnlineStatistics(geometry, half_life=None)
    forwards = [(random_queries(geometry, 7, gen), None), (random_queries(geometry, 1, gen), None)]
    for queries, mask in forwards:
        run_forward(stats, queries, mask)
    assert_matches(stats, geometry, forwards, None, 0.0)


def test_a_forward_that_never_finished_counts_nothing() -> None:
    """A forward that raised (no ``end_forward``) leaves no query behind: the next forward starts clean."""
    geometry = geometry_of()
    gen = torch.Generator().manual_seed(6)
    stats = OnlineStatistics(geometry, half_life=4.0)
    prompt, broken, step = (random_queries(geometry, n, gen) for n in (4, 3, 1))
    run_forward(stats, prompt)
    stats.begin_forward(None, 3)
    stats.add(0, broken[0])  # the forward raises in layer 1
    run_forward(stats, step)
    assert_matches(stats, geometry, [(prompt, None), (step, None)], 4.0, 0.0)


def test_rows_follow_a_beam_reorder() -> None:
    geometry = geometry_of()
    gen = torch.Generator().manual_seed(7)
    stats = OnlineStatistics(geometry, half_life=None)
    prompt = random_queries(geometry, 4, gen)
    run_forward(stats, prompt)
    before = stats.snapshot()
    stats.select_batch(torch.tensor([1, 1, 0]))
    after = stats.snapshot()
    for layer in range(geometry.num_layers):
        for got, want in zip(after.for_layer(layer), before.for_layer(layer)):
            assert torch.equal(got, want[[1, 1, 0]])
    assert after.tokens.tolist() == [4.0, 4.0, 4.0]


def test_no_statistics_before_a_prompt_and_queries_of_another_shape() -> None:
    geometry = geometry_of()
    stats = OnlineStatistics(geometry)
    with pytest.raises(RuntimeError, match="no query statistics.*calibrate"):
        stats.snapshot()
    stats.begin_forward(None, 3)
    with pytest.raises(ValueError, match=r"Expected pre-RoPE queries \[batch, seq, 4 heads, 16\]"):
        stats.add(0, torch.randn(B, 3, 3, geometry.head_dim))
    with pytest.raises(ValueError, match="new-token mask"):
        stats.begin_forward(torch.ones(B, 2, dtype=torch.bool), 2)
        stats.add(0, torch.randn(B, 3, geometry.num_q_heads, geometry.head_dim))
