"""The default scorer's online statistics are those of the model's own pre-RoPE queries, on every RoPE family.

Reference: each layer's query recomputed by hand from its attention module's input (``conftest.PreRopeQueries``:
the projection, fused or not, the head split, the query norm), independent of how hf_ropekv captures queries. At
every compaction the scorer must score with, per batch row, the weighted means of that row's real queries of every
forward finished before it (prompt, prefill chunks, later turns, each decoding step): a forward of ``n`` tokens
first decays what came before by ``0.5 ** (n / half_life)``, and each query head is pulled toward its layer's head
average by ``head_shrink`` pseudo-queries (``tests/unit/test_online_statistics.py`` checks that arithmetic alone).

What the scorer scores with is recorded by a ``FrequencyScorer`` subclass (the cache works on a copy of the scorer
it is given, of the same class): ``self.stats`` at each compaction, the scorer's public input.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (FAMILIES, FAMILY_NAMES, PreRopeQueries, cache_kw, family_model, head_shrunk, padded_batch,
                      query_pairs, tiny_model)
from hf_ropekv import FrequencyScorer, RopeKVCache


def recording_scorer(**settings):
    """A FrequencyScorer that keeps a copy of the statistics it is handed at every compaction, with the number of
    forwards started by then (``seen.forwards``, set to the test's :class:`Forwards`, counts them)."""

    class Seen(list):
        forwards: "Forwards | None" = None

    seen = Seen()

    class Recording(FrequencyScorer):
        def _remember(self) -> None:
            stats = self.stats
            seen.append((tuple(None if t is None else t.clone() for t in stats.q_mean),
                         tuple(None if t is None else t.clone() for t in stats.q_abs_mean), stats.tokens.clone(),
                         len(seen.forwards.forwards)))

        def score(self, keys, ctx):
            self._remember()
            return super().score(keys, ctx)

        def score_layers(self, keys, contexts):
            self._remember()
            return super().score_layers(keys, contexts)

    return Recording(**settings), seen


class Forwards(PreRopeQueries):
    """The reference queries of every forward, and which of its tokens are real: the forwards cover the token
    stream in order, so forward ``j``'s are the columns ``[start_j, start_j + n_j)`` of ``stream_mask`` (the padding
    mask of every token ever fed, generate's prompt mask followed by ones)."""

    def __init__(self, model, stream_mask: torch.Tensor) -> None:
        super().__init__(model)
        self.stream_mask = stream_mask.bool()

    @property
    def real(self) -> list[torch.Tensor]:
        out, start = [], 0
        for queries in self.forwards:
            new = queries[0].shape[1]
            out.append(self.stream_mask[:, start : start + new])
            start += new
        return out


def reference(forwards: Forwards, upto: int, layer: int, layout: str, pairs: int, half_life, shrink):
    """Per-row ``(q_mean, q_abs_mean, count)`` of ``layer`` over the first ``upto`` forwards (float64)."""
    f = 1.0 if half_life is None else 0.5 ** (1 / half_life)
    total = moduli = count = None
    for queries, real in zip(forwards.forwards[:upto], forwards.real[:upto]):
        q = query_pairs(queries[layer], layout, pairs)  # [B, S, H, F]
        q = torch.where(real[..., None, None], q, 0)
        decay = f ** q.shape[1]
        if total is None:
            total, moduli, count = q.sum(1), q.abs().sum(1), real.sum(1).double()
        else:
            total, moduli = total * decay + q.sum(1), moduli * decay + q.abs().sum(1)
            count = count * decay + real.sum(1)
    mean, abs_mean = total / count.view(-1, 1, 1), moduli / count.view(-1, 1, 1)
    return head_shrunk(mean, count, shrink), head_shrunk(abs_mean, count, shrink), count


def check_every_compaction(model, forwards: Forwards, seen: list, layout: str, half_life, shrink) -> None:
    """Each recorded snapshot equals the reference over the forwards finished before its compaction's forward: the
    ``started`` forwards when it ran, less the one it runs in (growing caches compact at the first layer), or all of
    them (static caches compact before the forward, while generate prepares its inputs)."""
    pairs = model_pairs(model)
    layers = len(forwards.forwards[0])
    assert len(seen) >= 3, f"{len(seen)} compactions: too few to follow the statistics through decoding"
    for q_mean, q_abs, tokens, started in seen:
        finished = [k for k in (started - 1, started) if k >= 1 and all(len(f) == layers for f in forwards.forwards[:k])
                    and torch.allclose(reference(forwards, k, 0, layout, pairs, half_life, shrink)[2], tokens,
                                       rtol=1e-9, atol=1e-9)]
        assert finished, f"counts {tokens.tolist()} are not those of the forwards finished before the compaction"
        for layer in range(layers):
            want_mean, want_abs, _ = reference(forwards, finished[0], layer, layout, pairs, half_life, shrink)
            torch.testing.assert_close(q_mean[layer].to(torch.complex128), want_mean, rtol=2e-5, atol=2e-6)
            torch.testing.assert_close(q_abs[layer].double(), want_abs, rtol=2e-5, atol=2e-6)
    assert seen[-1][3] > 3, "no compaction saw a decoding step's queries"


def stream_mask(prompt_mask: torch.Tensor, more: int) -> torch.Tensor:
    """The prompt's padding mask, then ``more`` real tokens per row."""
    return torch.cat([prompt_mask, torch.ones(prompt_mask.shape[0], more, dtype=prompt_mask.dtype)], dim=1)


def model_pairs(model) -> int:
    return RopeKVCache(model).geometry.rotary_dim // 2


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_online_statistics_are_the_models_own_queries_on_every_family(name: str) -> None:
    """A left-padded batch, the default scorer settings (half-life 128, head shrinkage 256), 30 decoding steps."""
    model = family_model(name)
    ids, mask = padded_batch(128, lengths=(12, 9, 6))
    scorer, seen = recording_scorer()
    cache = RopeKVCache(model, budget=16, compress_every=4, scorer=scorer)
    with Forwards(model, stream_mask(mask, 30)) as forwards, torch.no_grad():
        seen.forwards = forwards
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                       **cache_kw(model, cache))
    check_every_compaction(model, forwards, seen, FAMILIES[name][2], 128, 256)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("half_life, shrink", [(None, 0.0), (16.0, 4.0)])
def test_prefill_chunks_and_later_turns_count_like_any_forward(static: bool, half_life, shrink) -> None:
    """Qwen3 (its query norm randomised): a chunked prefill, then a second turn continuing the same cache; the
    static cache folds its decoding steps in place, the growing one defers them."""
    model = tiny_model("qwen3")
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight") and module.weight.numel() == 32:
            module.weight.data = torch.rand(32, generator=torch.Generator().manual_seed(9)) + 0.5  # q_norm, k_norm
    ids, mask = padded_batch(128, lengths=(20, 13))
    scorer, seen = recording_scorer(half_life=half_life, head_shrink=shrink)
    cache = RopeKVCache(model, budget=16, compress_every=4, scorer=scorer, protect_prompt=False, static=static)
    kw = dict(do_sample=False, pad_token_id=0, **cache_kw(model, cache))
    with Forwards(model, stream_mask(mask, 100)) as forwards, torch.no_grad():
        seen.forwards = forwards
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, prefill_chunk_size=8, **kw)
        turn = torch.cat([out, torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))], 1)
        turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        model.generate(input_ids=turn, attention_mask=turn_mask, max_new_tokens=12, **kw)
    assert cache.static is static
    check_every_compaction(model, forwards, seen, "rotate_half", half_life, shrink)
