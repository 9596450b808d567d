"""Perplexity quality of RopeKVCache's eviction policies: teacher-forced, and a decode-conditions proxy.

The perplexity entry point of ``benchmarks/README.md``. Perplexity is a fast regression check, not the verdict:
teacher forcing hides failures that free-running ``generate()`` shows (``task_accuracy.py`` judges policies).

Usage (CPU, fp32; the same command runs on CUDA with ``--device cuda``)::

    python benchmarks/perplexity.py --model smollm2 --doc-tokens 4096 --budgets 256,512,1024,2048 --docs 3
    python benchmarks/perplexity.py --model qwen25-coder --doc-tokens 2048 --budgets 256,512,1024 --docs 1
    python benchmarks/perplexity.py --dry-run --out /tmp/ppl_dry      # tiny random model on the CPU: a code check

writes ``quality_<model>.json|.md|.png`` (see ``benchmarks/quality_report.py``) and ``README.md`` into ``--out``
(default ``benchmarks/results/perplexity_<date>_<device>/``).

Decode-conditions proxy (``--proxy-tokens``, default 512; 0 skips it)
-------------------------------------------------------------------
Chunked teacher forcing scores a chunk while its own recent tokens cannot be evicted, and online statistics see
only multi-token forwards. The proxy runs decoding's conditions on the CPU: a short prompt *unlike* the document
(pinned, ``protect_prompt=True``, as ``generate()`` does), then the first sample's document fed one token per
forward, every policy at ``--proxy-budget``; it reports each policy's perplexity of those tokens next to the full
cache's.

What is measured
----------------
Every sample is one token stream (``quality_tasks.Sample``): a header, ~``doc_tokens`` tokens of the
Linux kernel documentation with a passkey sentence planted at a depth (10/50/90 %), a question and the
answer. For every policy and budget the stream is *teacher-forced through the budgeted cache* and
compared with the same stream through the full cache:

- perplexity of the document tokens after the first chunk (needle sentence excluded), and the same
  restricted to the tokens predicted after the first eviction ("post-eviction"), where policies differ;
- agreement with the full cache on those tokens: top-1 next-token agreement and KL(full || compressed)
  of the next-token distributions, per token, in nats;
- retrieval: log-probability of the passkey answer and exact match. Exact match of greedy decoding is
  read off the teacher-forced logits: greedy decoding emits the answer iff at every answer position the
  argmax, given the correct answer prefix, is the next answer token -- which is exactly what the
  teacher-forced pass computes (the cache state is identical because decoding would have fed the same
  tokens). The greedy prefix (argmaxes up to the first miss) is recorded too.

Why chunked teacher forcing reproduces token-by-token decoding exactly
----------------------------------------------------------------------
Decoding one token at a time, the cache compacts on a clock (``hf_ropekv.eviction.schedule``): before the decoding
steps whose count of earlier steps is a multiple of ``C`` (compress_every), it brings a row holding more
than ``B`` (budget) tokens back to ``B``. Starting from an empty cache with ``protect_prompt=False`` that
happens before the token indices ``kC`` with ``kC > B``. Feeding a *segment* of ``q <= C`` tokens, the
cache compacts at most once, at the start, iff ``K + q > B + C``, to ``B``. Segments of ``C`` tokens
aligned at 0 therefore compact exactly where decoding does: at a multiple of ``C`` the cache holds either
the whole stream so far (``K = kC``, compacting iff ``kC > B``) or ``B + C`` tokens since the previous
compaction. Shorter segments (the stream's tail, or cuts added for another reason) never trigger a
spurious compaction, since between two clock ticks ``K + q <= B + C``. Inside a segment the causal mask
lets token ``j`` see the kept tokens plus the segment's tokens ``<= j`` -- exactly what it sees when
decoded alone -- and the scorer sees the same keys at the same ``t = tokens seen``.
(:func:`segment_bounds` still adds every budget's compaction points, which are now multiples of ``C``; the
test ``tests/test_quality_harness.py::test_chunked_equals_token_by_token`` checks logits and kept tokens
against true token-by-token decoding, with a budget that is not a multiple of ``C``.)

The policies run in lockstep: each segment goes through the full cache once, then through every
(policy, budget) cache, and the per-token metrics are taken against that segment's full-cache logits
(no full-vocabulary logits are stored). Until a budget's first compaction point (the first multiple of ``C``
past ``B``) every policy
of that budget holds exactly the full cache's tokens, so by default (``share_prefix``) its caches are
created there from a copy of the full cache's keys and values, and the logits before it are the
full cache's (the test checks this equals running every policy from token 0).

Online statistics (``rope-online``): the cache gathers the pre-RoPE queries of every multi-token
forward it sees, so here they are the statistics of the document read so far (each segment is a
multi-token forward; a segment's queries count once its forward has finished), i.e. what the cache
does with a long prompt prefilled in chunks. In plain token-by-token decoding after a short prompt
they would be the prompt's statistics only; that case is not what the online column measures.

Offline statistics are calibrated (``hf_ropekv.calibrate``) on text disjoint from the evaluation
documents: the Python documentation (``rope-offline``: prose) and the Python standard library source
(``rope-code``: the cross-domain case, calibrated on code and evaluated on prose). They are cached under
``--stats-dir``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from hf_ropekv import FrequencyStats, KeyNormScorer, RandomScorer, RecencyScorer, RopeKVCache  # noqa: E402
from hf_ropekv._compat import cache_kwarg  # noqa: E402

from quality_tasks import CALIBRATION_SOURCES, Sample, passkey_samples  # noqa: E402

#: policy name -> (description, calibration source of its statistics or None)
POLICIES: dict[str, tuple[str, str | None]] = {
    "full": ("full cache, no eviction", None),
    "rope-offline": ("RoPE scoring, statistics calibrated offline on the Python documentation", "pydoc"),
    "rope-code": ("RoPE scoring, statistics calibrated on Python stdlib code (cross-domain)", "pycode"),
    "rope-online": ("RoPE scoring, online statistics from the document's own queries", None),
    "streaming": ("StreamingLLM: 4 sink tokens + the most recent tokens", None),
    "keynorm": ("key norm: keep the keys with the smallest L2 norm", None),
    "random": ("uniform random eviction (seeded)", None),
    # Not in the default set: the same offline statistics with selection="per_layer" (each layer ranks its own keys).
    "rope-offline-pl": ("RoPE scoring, offline statistics (Python docs), per-layer selection", "pydoc"),
    # Diagnostic upper bound, not attention-free: keeps the keys the full model's *actual* future queries attend
    # to most (mean softmax weight over all remaining queries of the stream), each layer ranking its own keys.
    "oracle-pl": ("oracle: actual future attention of the full run's queries, per-layer selection", None),
}
DIAGNOSTIC_POLICIES = ("rope-offline-pl", "oracle-pl")
DEFAULT_POLICIES = tuple(p for p in POLICIES if p not in DIAGNOSTIC_POLICIES)
STREAMING_SINK = 4
MODELS = ("smollm2", "qwen25-coder")


# =========================================================================== schedule


def compaction_points(length: int, budget: int | None, compress_every: int) -> list[int]:
    """Token indices before which token-by-token decoding compacts (empty cache, nothing pinned): the
    multiples of ``compress_every`` past the budget (``hf_ropekv.eviction.schedule``'s decoding clock)."""
    if budget is None:
        return []
    first = (budget // compress_every + 1) * compress_every
    return list(range(first, length, compress_every))


def segment_bounds(length: int, budgets: Iterable[int | None], compress_every: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` segments of at most ``compress_every`` tokens whose starts include every budget's
    compaction points: feeding them reproduces token-by-token decoding for every budget (module docstring)."""
    cuts = set(range(0, length, compress_every))
    for budget in budgets:
        cuts.update(compaction_points(length, budget, compress_every))
    starts = sorted(cuts)
    return list(zip(starts, starts[1:] + [length]))


# =========================================================================== policies


def make_cache(
    model: nn.Module,
    policy: str,
    budget: int | None,
    compress_every: int,
    stats: dict[str, FrequencyStats] | None = None,
    seed: int = 0,
    future_queries: list[torch.Tensor] | None = None,
    protect_prompt: bool = False,
) -> RopeKVCache:
    """A fresh cache of ``policy`` (see :data:`POLICIES`); nothing is pinned unless ``protect_prompt``."""
    # The paper's operating point, pinned so that these regression figures keep their meaning when the
    # library's defaults move (selection="global" below unless the policy says per-layer).
    common = dict(compress_every=compress_every, protect_prompt=protect_prompt, seed=seed, window=0,
                  stats_half_life=None, stats_head_shrink=0)
    if policy == "full" or budget is None:
        return RopeKVCache(model, None, **common)
    if policy in ("rope-offline", "rope-code", "rope-offline-pl"):
        source = POLICIES[policy][1]
        if not stats or source not in stats:
            raise ValueError(f"policy {policy} needs statistics calibrated on {source!r}")
        selection = "per_layer" if policy.endswith("-pl") else "global"
        return RopeKVCache(model, budget, stats=stats[source], selection=selection, **common)
    if policy == "rope-online":
        return RopeKVCache(model, budget, selection="global", **common)  # stats=None + the model: gathered online
    if policy == "streaming":
        return RopeKVCache(model, budget, scorer=RecencyScorer(), sink=STREAMING_SINK, selection="global", **common)
    if policy == "keynorm":
        return RopeKVCache(model, budget, scorer=KeyNormScorer(), selection="global", **common)
    if policy == "random":
        return RopeKVCache(model, budget, scorer=RandomScorer(seed), selection="global", **common)
    if policy == "oracle-pl":
        if future_queries is None:
            raise ValueError("the oracle policy needs the stream's future queries (evaluate_sample computes them)")
        return RopeKVCache(model, budget, scorer=FutureAttentionOracle(future_queries), selection="per_layer", **common)
    raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")


@dataclass
class FutureAttentionOracle:
    """Diagnostic scorer: mean softmax weight the full run's real future queries put on each kept key.

    ``queries[layer]``: float32 ``[H_q, T, D]`` post-RoPE queries of the whole stream, already scaled by the
    attention scaling. At a compaction with ``t`` tokens seen, queries ``t..T-1`` attend (softmax over the kept
    keys) and the weights are averaged over queries, then max-ed over the query heads of each KV head.
    Not attention-free and not causal: an upper bound for what key scoring can achieve.
    """

    queries: list

    def score(self, keys: torch.Tensor, ctx) -> torch.Tensor:
        batch, kv_heads, slots, _ = keys.shape
        q = self.queries[ctx.layer_idx][:, ctx.tokens_seen:].to(keys.device)
        if q.shape[1] == 0:
            return torch.zeros(batch, kv_heads, slots, device=keys.device)
        group = q.shape[0] // kv_heads
        k = keys[0].float().repeat_interleave(group, dim=0)  # [H_q, S, D]
        weights = torch.softmax(q @ k.transpose(1, 2), dim=-1).mean(1)  # [H_q, S]
        return weights.view(kv_heads, group, slots).amax(1).unsqueeze(0).expand(batch, -1, -1)


def future_queries(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Post-RoPE, scaled queries ``[H_q, T, D]`` per layer of one full forward over ``ids`` ``[1, T]``."""
    from hf_ropekv.model.capture import QueryCapture
    from hf_ropekv.model.geometry import describe

    geometry = describe(model)
    captured: dict[int, torch.Tensor] = {}

    def keep(layer_idx: int, q: torch.Tensor) -> None:
        captured[layer_idx] = q[0].detach().float().transpose(0, 1).contiguous()  # [H, T, D] pre-RoPE

    with torch.no_grad(), QueryCapture(model, geometry, keep):
        model(input_ids=ids, use_cache=False)
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary(captured[0].unsqueeze(0), positions)
    cos, sin = cos[0].float(), sin[0].float()  # [T, rotary_dim]
    rd = cos.shape[-1]
    scale = geometry.head_dim ** -0.5
    out = []
    for layer_idx in range(geometry.num_layers):
        q = captured.pop(layer_idx)
        rot, rest = q[..., :rd], q[..., rd:]
        half = rd // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)  # HF rotate_half
        out.append(torch.cat((rot * cos + rotated * sin, rest), dim=-1) * scale)
    return out


def _copy_prefix(source: RopeKVCache, target: RopeKVCache, online_sums: Any | None) -> None:
    """Give the fresh ``target`` the tokens ``source`` (a never-evicting cache) holds, as the model would.

    Keys and values go through the public ``Cache.update``, one call per layer, exactly like one
    multi-token forward. An online-statistics cache also gets the query sums of those tokens
    (``online_sums``: the accumulator the harness filled during the full cache's forwards, with the
    cache's own rule -- multi-token forwards only), which its hooks would have gathered.
    """
    for idx, layer in enumerate(source.layers):
        storage = getattr(layer, "storage", None)
        if storage is None:
            raise NotImplementedError("share_prefix needs every layer to be a full-attention layer")
        n = storage.length
        target.update(storage.keys[:, :, :n].clone(), storage.values[:, :, :n].clone(), idx)
    if getattr(target, "_online", None) is not None:
        if online_sums is None:
            raise RuntimeError("an online-statistics cache needs the query sums of the shared prefix")
        # No public setter exists: give the cache's statistics (the object its hooks feed) the state the prefix's
        # forwards gathered.
        target._online.__dict__.update(copy.deepcopy(online_sums).__dict__)


# =========================================================================== metrics


@dataclass
class RunMetrics:
    """Sums over one sample; ``*_ev`` only over tokens predicted after the first compaction."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    count: int = 0
    nll_ev: float = 0.0
    kl_ev: float = 0.0
    agree_ev: int = 0
    count_ev: int = 0
    answer_logprob: float = 0.0
    answer_tokens: int = 0
    answer_correct: list = field(default_factory=list)  # per answer token: argmax == answer token
    answer_argmax: list = field(default_factory=list)
    compactions: int = 0
    kept: int = 0

    @property
    def answer_exact(self) -> bool:
        return bool(self.answer_correct) and all(self.answer_correct)


class _Targets:
    """Which rows of a segment's logits are scored, precomputed once per sample (on the model's device)."""

    def __init__(self, sample: Sample, first_target: int, device: torch.device) -> None:
        n = len(sample.ids)
        self.ids = torch.tensor(sample.ids, dtype=torch.long, device=device)
        evaluated = torch.zeros(n + 1, dtype=torch.bool)
        evaluated[sample.eval_targets(first_target)] = True
        self.evaluated = evaluated.to(device)
        a0, a1 = sample.answer_span
        self.answer = (a0, a1)

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, targets)``: logits rows of segment [start, end) whose next token is evaluated."""
        pos = torch.arange(start, end, device=self.ids.device)
        target = pos + 1
        ok = self.evaluated[target.clamp_max(len(self.ids))] & (target < len(self.ids))
        return (pos[ok] - start), target[ok]


def _score_segment(
    metrics: RunMetrics,
    logprobs: torch.Tensor,
    full_logprobs: torch.Tensor | None,
    targets: _Targets,
    start: int,
    end: int,
    evicted_from: int | None,
) -> None:
    rows, tgt = targets.rows(start, end)
    if rows.numel():
        lp = logprobs[rows]
        nll = -lp.gather(1, targets.ids[tgt].unsqueeze(1)).squeeze(1)
        if full_logprobs is None:
            kl = torch.zeros_like(nll)
            agree = torch.ones_like(nll, dtype=torch.bool)
        else:
            ref = full_logprobs[rows]
            kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0.0)
            agree = lp.argmax(-1) == ref.argmax(-1)
        metrics.nll += float(nll.sum())
        metrics.kl += float(kl.sum())
        metrics.agree += int(agree.sum())
        metrics.count += int(rows.numel())
        if evicted_from is not None:
            after = (rows + start) >= evicted_from
            metrics.nll_ev += float(nll[after].sum())
            metrics.kl_ev += float(kl[after].sum())
            metrics.agree_ev += int(agree[after].sum())
            metrics.count_ev += int(after.sum())
    a0, a1 = targets.answer
    for pos in range(max(start, a0 - 1), min(end, a1 - 1)):
        token = int(targets.ids[pos + 1])
        row = logprobs[pos - start]
        metrics.answer_logprob += float(row[token])
        metrics.answer_tokens += 1
        best = int(row.argmax())
        metrics.answer_argmax.append(best)
        metrics.answer_correct.append(best == token)


# =========================================================================== one sample, all runs


def evaluate_sample(
    model: nn.Module,
    sample: Sample,
    policies: Sequence[str],
    budgets: Sequence[int],
    compress_every: int = 128,
    stats: dict[str, FrequencyStats] | None = None,
    *,
    share_prefix: bool = True,
    first_target: int | None = None,
    seed: int = 0,
    collect_logits: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Teacher-force ``sample`` through the full cache and every (policy, budget) cache in lockstep.

    Returns ``{"full": RunMetrics, (policy, budget): RunMetrics, ..., "seconds": float}``; with
    ``collect_logits`` also ``"logits": {run: [L, V] float32 CPU logits of every position}`` (tests).
    """
    device = next(model.parameters()).device
    first_target = compress_every if first_target is None else first_target
    targets = _Targets(sample, first_target, device)
    length = len(sample.ids)
    ids = targets.ids.unsqueeze(0)
    cache_kw = cache_kwarg(model)
    runs = [(p, b) for b in budgets for p in policies if p != "full"]
    segments = segment_bounds(length, budgets, compress_every)
    first_compaction = {run: (run[1] // compress_every + 1) * compress_every for run in runs}
    start_of = {run: (first_compaction[run] if share_prefix else 0) for run in runs}
    evicted_from = first_compaction

    oracle_queries = future_queries(model, ids) if any(p.startswith("oracle") for p in policies) else None
    full = make_cache(model, "full", None, compress_every)
    caches: dict[tuple[str, int], RopeKVCache] = {}
    # ("full", B): the full cache scored with budget B's post-eviction region (no extra forward).
    full_views = [("full", b) for b in budgets]
    results: dict[Any, RunMetrics] = {"full": RunMetrics(), **{k: RunMetrics() for k in full_views + runs}}
    logits_log: dict[Any, list[torch.Tensor]] = {k: [] for k in ["full", *runs]} if collect_logits else {}

    need_sums = share_prefix and "rope-online" in policies
    online_sums = None
    capture = None
    collecting = {"on": False}
    if need_sums:
        from hf_ropekv.model.capture import QueryCapture
        from hf_ropekv.statistics.online import OnlineStatistics

        online_sums = OnlineStatistics(full.geometry)

        def on_query(layer_idx: int, queries: torch.Tensor) -> None:
            if collecting["on"]:
                online_sums.add(layer_idx, queries)

        capture = QueryCapture(model, full.geometry, on_query).attach()

    def forward(cache: RopeKVCache, start: int, end: int) -> torch.Tensor:
        position_ids = torch.arange(start, end, device=device).unsqueeze(0)
        out = model(input_ids=ids[:, start:end], position_ids=position_ids, use_cache=True, **{cache_kw: cache})
        return torch.log_softmax(out.logits[0].float(), dim=-1)

    began = time.perf_counter()
    try:
        with torch.no_grad():
            for start, end in segments:
                for run in runs:
                    if run not in caches and start >= start_of[run]:
                        cache = make_cache(model, run[0], run[1], compress_every, stats, seed, oracle_queries)
                        if start > 0:
                            _copy_prefix(full, cache, online_sums)
                        caches[run] = cache
                # The cache gathers online statistics from every forward, counted once it has finished.
                collecting["on"] = need_sums
                if need_sums:
                    online_sums.begin_forward(None, end - start)
                full_lp = forward(full, start, end)
                if need_sums:
                    online_sums.end_forward()
                collecting["on"] = False
                _score_segment(results["full"], full_lp, None, targets, start, end, None)
                for view in full_views:
                    _score_segment(results[view], full_lp, None, targets, start, end, (view[1] // compress_every + 1) * compress_every)
                if collect_logits:
                    logits_log["full"].append(full_lp.cpu())
                for run in runs:
                    cache = caches.get(run)
                    lp = full_lp if cache is None else forward(cache, start, end)
                    _score_segment(results[run], lp, None if cache is None else full_lp, targets, start, end,
                                   evicted_from[run])
                    if collect_logits:
                        logits_log[run].append(lp.cpu())
                if progress is not None:
                    progress(f"{sample.name}: {end}/{length} tokens, {time.perf_counter() - began:.0f}s")
        for run, cache in caches.items():
            results[run].compactions = cache.num_compactions
            results[run].kept = cache.tokens_kept
        results["full"].kept = full.tokens_kept
    finally:
        if capture is not None:
            capture.detach()
        caches.clear()
        del full
        gc.collect()  # each cache's hooks on the model go with it
    out: dict[Any, Any] = dict(results)
    out["seconds"] = time.perf_counter() - began
    if collect_logits:
        out["logits"] = {k: torch.cat(v) for k, v in logits_log.items()}
    return out


# =========================================================================== decode-conditions proxy


def decode_proxy(
    model: nn.Module,
    prompt: Sequence[int],
    document: Sequence[int],
    policies: Sequence[str],
    budget: int,
    compress_every: int,
    stats: dict[str, FrequencyStats] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Perplexity of ``document`` fed one token per forward after ``prompt`` (one forward, pinned), per policy.

    Returns ``{policy: {"ppl", "nll", "tokens", "kept", "compactions"}}``; ``"full"`` is the unbudgeted cache.
    What decoding does to a cache, unlike chunked teacher forcing (module docstring).
    """
    from hf_ropekv._compat import cache_kwarg

    device = next(model.parameters()).device
    kwarg = cache_kwarg(model)
    ids = torch.tensor([list(prompt) + list(document)], dtype=torch.long, device=device)
    out: dict[str, dict[str, float]] = {}
    for policy in ["full"] + [p for p in policies if p != "full" and p != "oracle-pl"]:
        cache = make_cache(model, policy, None if policy == "full" else budget, compress_every, stats, seed,
                           protect_prompt=True)
        nll = 0.0
        with torch.no_grad():
            logits = model(input_ids=ids[:, : len(prompt)], use_cache=True, **{kwarg: cache}).logits[0, -1]
            for i in range(len(prompt), ids.shape[1]):
                nll -= float(torch.log_softmax(logits.float(), -1)[ids[0, i]])
                if i + 1 < ids.shape[1]:  # the last token predicts nothing scored
                    logits = model(input_ids=ids[:, i : i + 1], use_cache=True, **{kwarg: cache}).logits[0, -1]
        tokens = ids.shape[1] - len(prompt)
        out[policy] = dict(ppl=math.exp(nll / tokens), nll=nll, tokens=tokens, kept=int(cache.tokens_kept),
                           compactions=int(cache.num_compactions))
    return out


def render_decode_proxy(proxy: dict[str, Any]) -> str:
    """The proxy's Markdown section: one row per policy, perplexity and its ratio to the full cache's."""
    full = proxy["runs"]["full"]["ppl"]
    lines = ["", "## Decode-conditions proxy", "",
             f"Prompt of {proxy['prompt_tokens']} tokens unlike the document (pinned), then {proxy['tokens']} "
             f"document tokens one per forward; budget {proxy['budget']}, compress_every {proxy['compress_every']}.",
             "", "| policy | perplexity | / full | kept | compactions |", "|---|---:|---:|---:|---:|"]
    for policy, run in proxy["runs"].items():
        lines.append(f"| {policy} | {run['ppl']:.3f} | {run['ppl'] / full:.3f} | {run['kept']} | "
                     f"{run['compactions']} |")
    return "\n".join(lines) + "\n"


# =========================================================================== models, statistics


def load_model(name: str, dtype: torch.dtype, device: str, gguf: str | None = None):
    """``(model, tokenizer)`` from the offline packages (``offline_assets``), or from ``gguf`` (a file path)."""
    if gguf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(gguf)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        return model.to(device).eval(), tokenizer
    from common import offline_assets

    assets = offline_assets()
    loader = {"smollm2": assets.load_smollm2, "qwen25-coder": assets.load_qwen25_coder}[name]
    return loader(dtype=dtype, device=device, hub_fallback=None)


def load_or_calibrate(
    model: nn.Module, tokenizer: Any, model_name: str, source: str, tokens: int, stats_dir: Path, log: Callable
) -> tuple[FrequencyStats, Path, float]:
    """Statistics of ``model`` on calibration ``source`` (see ``quality_tasks.CALIBRATION_SOURCES``), cached."""
    from hf_ropekv.statistics.calibration import calibrate

    path = stats_dir / f"{model_name}_{source}_{tokens}.safetensors"
    if path.is_file():
        log(f"statistics: reusing {path}")
        return FrequencyStats.load(path), path, 0.0
    description, texts_fn = CALIBRATION_SOURCES[source]
    log(f"statistics: calibrating {model_name} on {description}, {tokens} tokens")
    began = time.perf_counter()
    stats = calibrate(model, tokenizer, texts_fn(), max_tokens=tokens, chunk_tokens=2048,
                      source=f"{description}, {tokens} tokens", progress=False)
    seconds = time.perf_counter() - began
    stats.save(path)
    log(f"statistics: wrote {path} ({path.stat().st_size / 1024:.0f} KiB) in {seconds:.0f}s")
    return stats, path, seconds


# =========================================================================== environment record


def environment(device: str) -> dict[str, Any]:
    import transformers

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dirty = git("status", "--porcelain", "--", "hf_ropekv", "benchmarks/perplexity.py", "benchmarks/quality_tasks.py",
                "kernels")
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
        + (f", GPU {torch.cuda.get_device_name()}" if device.startswith("cuda") and torch.cuda.is_available() else ""),
        "commit": git("rev-parse", "HEAD") + (" (+ uncommitted changes in hf_ropekv/benchmarks)" if dirty else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(
            [f"{k}={os.environ[k]}" for k in ("HF_ROPEKV_CACHE", "CUDA_VISIBLE_DEVICES") if os.environ.get(k)]
            + [Path(sys.executable).name, *sys.argv]
        ),
    }


# =========================================================================== command line


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default=None, help="required unless --dry-run")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny random-weight Llama and random token streams on the CPU (seconds): a code check")
    p.add_argument("--proxy-tokens", type=int, default=512,
                   help="document tokens of the decode-conditions proxy (0: skip it)")
    p.add_argument("--proxy-budget", type=int, default=None, help="the proxy's budget (default: the smallest)")
    p.add_argument("--gguf", default=None, help="load this GGUF file instead of the offline package")
    p.add_argument("--doc-tokens", type=int, default=4096, help="tokens per sample stream")
    p.add_argument("--budgets", default="256,512,1024,2048", help="comma list; budgets >= doc-tokens are dropped")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--docs", type=int, default=3, help="documents (samples)")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths; document i gets depths[i %% n]")
    p.add_argument("--all-depths", action="store_true", help="every document at every depth")
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--calib-tokens", type=int, default=32768)
    p.add_argument("--stats-dir", default=str(HERE / "results" / "stats"))
    p.add_argument("--out", default=None, help="default: benchmarks/results/perplexity_<date>_<device>/")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-share-prefix", action="store_true", help="run every policy from token 0 (slower, same result)")
    p.add_argument("--resume", action="store_true", help="keep samples already in the output JSON")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.doc_tokens, args.budgets, args.docs = "tiny", 160, "48", 1
        args.compress_every, args.calib_tokens, args.proxy_tokens = 16, 256, min(args.proxy_tokens, 64)
        args.policies = "rope-offline,rope-online,streaming,keynorm"
        args.stats_dir = None
    elif args.model is None:
        p.error(f"--model is required (one of {', '.join(MODELS)}), or pass --dry-run")
    if args.proxy_tokens < 0:
        p.error(f"--proxy-tokens must be >= 0 (0 skips the proxy), got {args.proxy_tokens}")
    return args


def tiny_model_and_samples(args: argparse.Namespace) -> tuple[nn.Module, list[Sample], dict[str, FrequencyStats]]:
    """The dry run's stand-ins: a 2-layer random Llama, random token streams and statistics calibrated on random
    tokens (one source per calibration name the policies use)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_ropekv.statistics.calibration import calibrate

    config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(args.seed)
    n = args.doc_tokens
    samples = []
    for i in range(args.docs):
        ids = torch.randint(3, 128, (n,), generator=gen).tolist()
        samples.append(Sample(name=f"random{i}", ids=ids, doc_span=(4, n - 6), needle_span=(n // 2, n // 2 + 4),
                              answer_span=(n - 4, n), passkey="0", depth=0.5, meta={"document": f"random{i}"}))
    calibration = torch.randint(3, 128, (2, args.calib_tokens), generator=gen)
    stats = {source: calibrate(model, None, calibration, max_tokens=args.calib_tokens, progress=False)
             for source in {POLICIES[p][1] for p in POLICIES if POLICIES[p][1]}}
    return model, samples, stats


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    from common import results_dir, run_metadata, write_run_readme

    out_dir = results_dir("perplexity", args.out, torch.device(args.device))
    stem = f"quality_{args.model}{args.tag}"
    json_path = out_dir / f"{stem}.json"
    log_path = out_dir / f"{stem}.log"

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with log_path.open("a") as f:
            f.write(line + "\n")

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    requested = [int(b) for b in args.budgets.split(",") if b.strip()]
    budgets = [b for b in requested if b + args.compress_every < args.doc_tokens]
    if len(budgets) < len(requested):
        log(f"budgets {sorted(set(requested) - set(budgets))} dropped: no eviction before the end of a "
            f"{args.doc_tokens}-token stream (budget + compress_every >= doc tokens), identical to the full cache")
    depths = [float(d) for d in args.depths.split(",")]
    dtype = getattr(torch, args.dtype)

    env = environment(args.device)
    log(f"loading {args.model} ({args.dtype}, {args.device})")
    began = time.perf_counter()
    stats: dict[str, FrequencyStats] = {}
    stats_info: dict[str, Any] = {}
    if args.dry_run:
        model, samples, stats = tiny_model_and_samples(args)
        model, tokenizer = model.to(args.device, dtype), None
    else:
        model, tokenizer = load_model(args.model, dtype, args.device, args.gguf)
    log(f"loaded in {time.perf_counter() - began:.0f}s: {type(model).__name__}")
    for policy in policies if not args.dry_run else ():
        source = POLICIES[policy][1]
        if source and source not in stats:
            st, path, seconds = load_or_calibrate(model, tokenizer, args.model, source, args.calib_tokens,
                                                  Path(args.stats_dir), log)
            stats[source] = st
            stats_info[source] = {"file": os.path.relpath(path, HERE.parent), "tokens": st.tokens,
                                  "source": st.metadata.get("source"), "seconds": round(seconds, 1),
                                  "bytes": path.stat().st_size}

    if not args.dry_run:
        samples = passkey_samples(tokenizer, args.docs, args.doc_tokens, depths, seed=args.seed,
                                  all_depths=args.all_depths)
    config = {
        "model": args.model, "model_class": type(model).__name__, "dtype": args.dtype, "device": args.device,
        "doc_tokens": args.doc_tokens, "budgets": budgets, "policies": policies, "docs": args.docs,
        "depths": depths, "compress_every": args.compress_every, "calib_tokens": args.calib_tokens,
        "first_target": args.compress_every, "seed": args.seed, "share_prefix": not args.no_share_prefix,
        "policy_descriptions": {p: POLICIES[p][0] for p in policies}, "statistics": stats_info,
        "streaming_sink": STREAMING_SINK,
    }
    done: dict[str, Any] = {}
    if args.resume and json_path.is_file():
        previous = json.loads(json_path.read_text())
        same = {k: previous["config"].get(k) for k in ("model", "doc_tokens", "budgets", "policies", "dtype")}
        if same == {k: config[k] for k in same}:
            done = {s["name"]: s for s in previous.get("samples", [])}
            log(f"resuming: {len(done)} samples already done")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))

    records = []
    for i, sample in enumerate(samples):
        previous_record = done.get(sample.name)
        if previous_record and (previous_record["passkey"], previous_record["tokens"]) == (sample.passkey, len(sample.ids)):
            records.append(previous_record)
            continue
        log(f"sample {i + 1}/{len(samples)}: {sample.name}, {len(sample.ids)} tokens, passkey {sample.passkey}")
        last = {"t": 0.0}

        def progress(msg: str) -> None:
            now = time.perf_counter()
            if now - last["t"] > 60:
                last["t"] = now
                log("  " + msg)

        result = evaluate_sample(model, sample, policies, budgets, args.compress_every, stats,
                                 share_prefix=not args.no_share_prefix, seed=args.seed, progress=progress)
        record = {
            "name": sample.name, "document": sample.meta["document"], "depth": sample.depth,
            "passkey": sample.passkey, "tokens": len(sample.ids), "seconds": round(result["seconds"], 1),
            "answer_text": decode(sample.ids[sample.answer_span[0]:sample.answer_span[1]]),
            "runs": {},
        }
        for key, metrics in result.items():
            if key in ("seconds",):
                continue
            name = "full" if key == "full" else f"{key[0]}@{key[1]}"
            entry = asdict(metrics)
            entry["answer_exact"] = metrics.answer_exact
            entry["answer_greedy_text"] = decode(_greedy_prefix(metrics))
            record["runs"][name] = entry
        records.append(record)
        full = record["runs"]["full"]
        log(f"  done in {result['seconds']:.0f}s: full ppl {math.exp(full['nll'] / full['count']):.3f}, "
            f"answer exact {full['answer_exact']} ({full['answer_logprob']:.2f} nats)")
        _write(json_path, env, config, records)
    _write(json_path, env, config, records)

    from quality_report import write_report

    md, png = write_report(json_path)
    if args.proxy_tokens:
        proxy = run_decode_proxy(args, model, tokenizer, samples[0], policies, budgets, stats, log)
        data = json.loads(json_path.read_text())
        data["decode_proxy"] = proxy
        json_path.write_text(json.dumps(data, indent=1))
        md.write_text(md.read_text() + render_decode_proxy(proxy))
    write_run_readme(out_dir, {**run_metadata(torch.device(args.device), None, list(argv or sys.argv[1:])),
                               "commit": env["commit"]}, "perplexity.py",
                     f"Perplexity quality: {args.model}, teacher-forced and decode-conditions proxy")
    log(f"wrote {json_path}, {md}, {png}")
    return 0


def run_decode_proxy(args: argparse.Namespace, model: nn.Module, tokenizer: Any, sample: Sample,
                     policies: Sequence[str], budgets: Sequence[int], stats: dict[str, FrequencyStats],
                     log: Callable[[str], None]) -> dict[str, Any]:
    """The decode-conditions proxy on ``sample``'s document after a short chat-like prompt (module docstring)."""
    if tokenizer is not None:
        prompt = tokenizer.encode("User: write a short poem about the sea.\nAssistant:", add_special_tokens=False)
    else:  # the dry run's random streams use ids 3..127: a prompt of ids 0..2 is unlike them
        prompt = [1, 2, 0, 2, 1, 0, 2, 2]
    budget = args.proxy_budget or min(budgets)
    start = sample.doc_span[0]
    document = sample.ids[start : start + args.proxy_tokens]
    log(f"decode-conditions proxy: prompt {len(prompt)}, {len(document)} tokens one by one, budget {budget}")
    runs = decode_proxy(model, prompt, document, policies, budget, args.compress_every, stats, args.seed)
    return dict(prompt_tokens=len(prompt), tokens=len(document), budget=budget, compress_every=args.compress_every,
                runs=runs)


def _greedy_prefix(metrics: RunMetrics) -> list[int]:
    """Tokens greedy decoding would emit, up to and including the first wrong one."""
    out = []
    for token, ok in zip(metrics.answer_argmax, metrics.answer_correct):
        out.append(token)
        if not ok:
            break
    return out


def _write(path: Path, env: dict, config: dict, records: list) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"environment": env, "config": config, "samples": records}, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
