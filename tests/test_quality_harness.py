"""The quality harness (benchmarks/perplexity.py) measures what it claims, on a tiny random-weight Llama (CPU, fp32).

- chunked teacher forcing through the full cache gives the perplexity of one full forward;
- with a budget >= the stream length every policy's logits equal the full cache's exactly;
- chunked teacher forcing with eviction equals token-by-token decoding with eviction (logits and kept
  tokens), including a budget that is not a multiple of compress_every -- and naive aligned chunks do not;
- starting each budget's caches from a copy of the full cache at its first compaction point (the
  default speed-up) gives the same logits as running every policy from token 0.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import perplexity as quality  # noqa: E402
from perplexity import compaction_points, evaluate_sample, make_cache, segment_bounds  # noqa: E402
from quality_tasks import Sample, build_sample  # noqa: E402

from hf_ropekv._compat import cache_kwarg  # noqa: E402
from hf_ropekv.statistics.calibration import calibrate  # noqa: E402

ALL = ("full", "rope-offline", "rope-code", "rope-online", "streaming", "keynorm", "random")
EVICTING = ("rope-offline", "streaming", "keynorm", "random")  # fixed policies (online differs by design)


@pytest.fixture(scope="module")
def model():
    config = AutoConfig.for_model(
        "llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def stats(model):
    gen = torch.Generator().manual_seed(1)
    prose = torch.randint(3, 128, (2, 256), generator=gen)
    code = torch.randint(3, 64, (2, 256), generator=gen)  # a different "domain"
    return {
        "pydoc": calibrate(model, None, prose, max_tokens=512, progress=False),
        "pycode": calibrate(model, None, code, max_tokens=512, progress=False),
    }


def make_sample(length: int, seed: int = 0) -> Sample:
    ids = torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Sample(name="random", ids=ids, doc_span=(4, length - 6), needle_span=(40, 44),
                  answer_span=(length - 4, length), passkey="0", depth=0.5, meta={"document": "random"})


def step(model, cache, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end).unsqueeze(0)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        return model(input_ids=ids[:, start:end], position_ids=pos, use_cache=True, **kw).logits[0]


def kept(cache) -> torch.Tensor:
    return cache.layers[0].storage.live_positions().clone()


# --------------------------------------------------------------------------- the schedule


def test_segment_bounds_cover_every_compaction_point() -> None:
    for budgets in ([256, 512], [200], [37, 40, 100]):
        bounds = segment_bounds(1000, budgets, 128 if budgets[0] > 100 else 16)
        c = 128 if budgets[0] > 100 else 16
        assert bounds[0][0] == 0 and bounds[-1][1] == 1000
        assert all(e - s <= c and e > s for s, e in bounds)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        starts = {s for s, _ in bounds}
        for b in budgets:
            assert set(compaction_points(1000, b, c)) <= starts
    # budgets that are multiples of compress_every need nothing but the multiples of it
    assert segment_bounds(1024, [256, 512], 128) == [(s, s + 128) for s in range(0, 1024, 128)]


# --------------------------------------------------------------------------- full cache


def test_chunked_full_cache_perplexity_equals_single_forward(model) -> None:
    sample = make_sample(300)
    c = 32
    result = evaluate_sample(model, sample, ["full"], [], compress_every=c, collect_logits=True)
    ids = torch.tensor(sample.ids).unsqueeze(0)
    with torch.no_grad():
        single = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    targets = sample.eval_targets(c)
    want_nll = -sum(float(single[t - 1, sample.ids[t]]) for t in targets)
    got = result["full"]
    assert got.count == len(targets)
    assert math.isclose(got.nll, want_nll, rel_tol=1e-5)
    assert math.isclose(math.exp(got.nll / got.count), math.exp(want_nll / len(targets)), rel_tol=1e-6)
    torch.testing.assert_close(result["logits"]["full"], single, atol=2e-5, rtol=0)


def test_budget_at_least_length_every_policy_equals_full_exactly(model, stats) -> None:
    sample = make_sample(200)
    policies = [p for p in ALL if p != "full"]
    for budget in (200, 256):
        result = evaluate_sample(model, sample, policies, [budget], compress_every=16, stats=stats,
                                 share_prefix=False, collect_logits=True)
        full = result["logits"]["full"]
        for policy in policies:
            run = (policy, budget)
            assert torch.equal(result["logits"][run], full), policy
            m = result[run]
            assert m.compactions == 0 and m.kept == len(sample.ids)
            assert m.kl == 0.0 and m.agree == m.count == result["full"].count
            assert m.nll == result["full"].nll and m.answer_logprob == result["full"].answer_logprob


# --------------------------------------------------------------------------- eviction: chunks == decoding


@pytest.mark.parametrize("budget", [40, 37])  # 37: not a multiple of compress_every
@pytest.mark.parametrize("policy", EVICTING)
def test_chunked_equals_token_by_token(model, stats, policy: str, budget: int) -> None:
    c, length = 16, 150
    ids = torch.tensor(make_sample(length, seed=3).ids).unsqueeze(0)

    decoded = make_cache(model, policy, budget, c, stats)
    token_logits, token_kept = [], {}
    for t in range(length):
        token_logits.append(step(model, decoded, ids, t, t + 1))
        token_kept[t + 1] = kept(decoded)
    token_logits = torch.cat(token_logits)

    chunked = make_cache(model, policy, budget, c, stats)
    bounds = segment_bounds(length, [budget], c)
    chunk_logits = []
    for s, e in bounds:
        chunk_logits.append(step(model, chunked, ids, s, e))
        assert torch.equal(kept(chunked), token_kept[e]), f"kept tokens differ after {e} tokens"
    chunk_logits = torch.cat(chunk_logits)
    assert chunked.num_compactions == decoded.num_compactions == len(compaction_points(length, budget, c))
    torch.testing.assert_close(chunk_logits, token_logits, atol=1e-5, rtol=0)

    # The harness itself (lockstep, metrics) produces the same logits.
    result = evaluate_sample(model, make_sample(length, seed=3), [policy], [budget], compress_every=c, stats=stats,
                             share_prefix=False, collect_logits=True)
    torch.testing.assert_close(result["logits"][(policy, budget)], torch.log_softmax(token_logits, -1),
                               atol=1e-5, rtol=0)


def test_aligned_chunks_match_decoding_whatever_the_budget(model) -> None:
    """Decoding compacts on a clock of compress_every steps, so fixed aligned chunks reproduce it for any
    budget (with per-count thresholds they did not when the budget was not a multiple of compress_every)."""
    c, budget, length = 16, 37, 128
    ids = torch.tensor(make_sample(length, seed=3).ids).unsqueeze(0)
    decoded = make_cache(model, "keynorm", budget, c)
    for t in range(64):
        step(model, decoded, ids, t, t + 1)
    aligned = make_cache(model, "keynorm", budget, c)
    for s in range(0, 64, c):
        step(model, aligned, ids, s, s + c)
    # Both compacted before token 48 (the first multiple of 16 past 37) and hold 37 + 16.
    assert decoded.num_compactions == aligned.num_compactions == 1
    assert decoded.tokens_kept == aligned.tokens_kept == budget + c
    assert torch.equal(kept(decoded), kept(aligned))


# --------------------------------------------------------------------------- the prefix-sharing speed-up


def test_shared_prefix_equals_running_every_policy_from_the_start(model, stats) -> None:
    sample = make_sample(160, seed=5)
    policies = [*ALL, "rope-offline-pl"]
    budgets = [32, 45]
    kwargs = dict(compress_every=16, stats=stats, collect_logits=True)
    shared = evaluate_sample(model, sample, policies, budgets, share_prefix=True, **kwargs)
    scratch = evaluate_sample(model, sample, policies, budgets, share_prefix=False, **kwargs)
    for key, logits in scratch["logits"].items():
        torch.testing.assert_close(shared["logits"][key], logits, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
        a, b = shared[key], scratch[key]
        assert (a.compactions, a.kept, a.count, a.count_ev, a.answer_correct) == (
            b.compactions, b.kept, b.count, b.count_ev, b.answer_correct), key
        assert math.isclose(a.nll, b.nll, rel_tol=1e-6) and math.isclose(a.kl + 1, b.kl + 1, rel_tol=1e-6), key
    for budget in budgets:
        assert shared[("keynorm", budget)].compactions == len(compaction_points(160, budget, 16))


# --------------------------------------------------------------------------- samples


class CharTokenizer:
    """One token per character (enough to check the spans of a sample)."""

    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": [ord(ch) for ch in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_sample_spans() -> None:
    tok = CharTokenizer()
    text = "\n\n".join(f"Paragraph {i} about kernel memory management and locking." for i in range(200))
    sample = build_sample(tok, "doc.rst", text, 3000, 0.5, "73918")
    assert len(sample.ids) == 3000
    a0, a1 = sample.answer_span
    assert tok.decode(sample.ids[a0:a1]) == " 73918."
    n0, n1 = sample.needle_span
    assert "The secret passkey is 73918." in tok.decode(sample.ids[n0:n1])
    assert sample.doc_span[0] < n0 < n1 < sample.doc_span[1] < a0
    assert 0.4 < sample.meta["needle_token_depth"] < 0.6
    targets = sample.eval_targets(128)
    assert targets[0] == max(128, sample.doc_span[0]) and not any(n0 <= t < n1 for t in targets) and max(targets) < sample.doc_span[1]
