"""Markdown table and plot of a ``benchmarks/perplexity.py`` result file.

    python benchmarks/quality_report.py benchmarks/results/quality_smollm2.json

writes ``quality_smollm2.md`` and ``quality_smollm2.png`` next to the JSON.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

POLICY_ORDER = ("full", "oracle-pl", "rope-offline", "rope-offline-pl", "rope-code", "rope-online", "streaming", "keynorm",
                "random")
STYLE = {
    "full": dict(color="black", linestyle="--"),
    "rope-offline": dict(color="tab:red", marker="o"),
    "rope-offline-pl": dict(color="tab:pink", marker="o", linestyle=":"),
    "oracle-pl": dict(color="gold", marker="*", linestyle=":"),
    "rope-code": dict(color="tab:orange", marker="s"),
    "rope-online": dict(color="tab:purple", marker="^"),
    "streaming": dict(color="tab:blue", marker="v"),
    "keynorm": dict(color="tab:green", marker="D"),
    "random": dict(color="tab:gray", marker="x"),
}


def aggregate(data: dict) -> dict[str, dict[Any, dict[str, float]]]:
    """``{policy: {budget or None: metrics}}`` pooled over samples (token-weighted)."""
    config = data["config"]
    out: dict[str, dict[Any, dict[str, float]]] = {}
    for policy in config["policies"]:
        keys = [(f"{policy}@{b}", b) for b in config["budgets"]]
        if policy == "full":  # "full@B": the full cache scored on budget B's post-eviction region too
            keys = [("full", None)] + keys
        for key, budget in keys:
            runs = [s["runs"][key] for s in data["samples"] if key in s["runs"]]
            if not runs:
                continue
            s = {f: sum(r[f] for r in runs) for f in ("nll", "kl", "agree", "count", "nll_ev", "kl_ev", "agree_ev",
                                                      "count_ev", "answer_logprob")}
            n = len(runs)
            m = {
                "ppl": math.exp(s["nll"] / s["count"]),
                "kl": s["kl"] / s["count"],
                "top1": s["agree"] / s["count"],
                "ppl_ev": math.exp(s["nll_ev"] / s["count_ev"]) if s["count_ev"] else float("nan"),
                "kl_ev": s["kl_ev"] / s["count_ev"] if s["count_ev"] else float("nan"),
                "top1_ev": s["agree_ev"] / s["count_ev"] if s["count_ev"] else float("nan"),
                "exact": sum(bool(r["answer_exact"]) for r in runs),
                "answer_logprob": s["answer_logprob"] / n,
                "samples": n,
                "tokens": s["count"],
                "tokens_ev": s["count_ev"],
            }
            out.setdefault(policy, {})[budget] = m
    return out


def _fmt(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _table(agg: dict, budgets: list, metric: str, spec: str, full_value: bool = True, pct_vs_full: bool = False) -> str:
    head = "| policy | " + " | ".join(f"B={b}" for b in budgets) + " |"
    sep = "|---|" + "---:|" * len(budgets)
    rows = [head, sep]
    full = agg.get("full", {}).get(None)
    for policy in POLICY_ORDER:
        if policy not in agg:
            continue
        if policy == "full" and not metric.endswith("_ev"):
            if not full_value or full is None:
                continue
            cells = [_fmt(full[metric], spec)] * len(budgets)
        elif policy == "full" and not full_value:
            continue
        else:
            cells = []
            for b in budgets:
                m = agg[policy].get(b)
                if m is None:
                    cells.append("—")
                    continue
                cell = _fmt(m[metric], spec)
                ref = agg.get("full", {}).get(b if metric.endswith("_ev") else None)
                if pct_vs_full and policy != "full" and ref is not None and ref[metric] > 0:
                    cell += f" ({100 * (m[metric] / ref[metric] - 1):+.1f} %)"
                cells.append(cell)
        rows.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _best_attention_free(agg: dict, budgets: list, metric: str, higher: bool) -> list[str]:
    winners = []
    for b in budgets:
        cands = {p: agg[p][b][metric] for p in agg if p not in ("full", "oracle-pl") and b in agg[p] and not math.isnan(agg[p][b][metric])}
        if cands:
            best = (max if higher else min)(cands, key=cands.get)
            winners.append(f"B={b}: {best}")
    return winners


def write_report(json_path: str | Path) -> tuple[Path, Path]:
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    env, config = data["environment"], data["config"]
    agg = aggregate(data)
    budgets = config["budgets"]
    n = len(data["samples"])
    md_path, png_path = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    doc_tokens = config["doc_tokens"]
    full = agg.get("full", {}).get(None)

    lines = [
        f"# Eviction quality: {config['model']} ({config['model_class']}, {config['dtype']}, {config['device']})",
        "",
        f"- date: {env['date']}",
        f"- machine: {env['machine']}",
        f"- commit: {env['commit']}",
        f"- software: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}",
        f"- command: `{env['command']}`",
        f"- samples: {n} linux-doc-6.1 streams of {doc_tokens} tokens (header, document with a passkey at depth "
        f"{', '.join(f'{d:.0%}' for d in config['depths'])}, question, answer); compress_every={config['compress_every']}, "
        f"nothing pinned (protect_prompt=False); metrics over the document tokens after the first "
        f"{config['first_target']} (needle excluded): {full['tokens'] if full else '?'} tokens in all.",
        f"- wall time: {sum(s['seconds'] for s in data['samples']) / 60:.0f} min for all samples "
        f"({', '.join(format(s['seconds'] / 60, '.0f') for s in data['samples'])} min each; all policies and "
        "budgets in lockstep)",
        "",
        "Policies: " + "; ".join(f"**{p}**: {d}" for p, d in config["policy_descriptions"].items()) + ".",
        "",
    ]
    if config.get("statistics"):
        lines.append("Calibration statistics: " + "; ".join(
            f"`{info['file']}` ({info['source']}; {info['bytes'] / 1024:.0f} KiB)" for info in config["statistics"].values()
        ) + ".")
        lines.append("")
    lines += [
        "Budget B = tokens kept per layer and KV head after a compaction (the cache holds at most B + 128). "
        f"Retention at the end of the stream: B / {doc_tokens}.",
        "",
        "## Perplexity (all evaluated tokens; change vs the full cache)",
        "",
        _table(agg, budgets, "ppl", ".3f", pct_vs_full=True),
        "",
        "## Perplexity after the first eviction (tokens predicted once the cache has compacted: positions > B + 128)",
        "",
        _table(agg, budgets, "ppl_ev", ".3f", pct_vs_full=True),
        "",
        "(The full row is the full cache on the same tokens: each budget's post-eviction region differs.)",
        "",
        "## KL(full ‖ compressed) per token, nats (all evaluated tokens / post-eviction)",
        "",
        _table(agg, budgets, "kl", ".4f", full_value=False),
        "",
        _table(agg, budgets, "kl_ev", ".4f", full_value=False),
        "",
        "## Top-1 agreement with the full cache (all evaluated tokens / post-eviction)",
        "",
        _table(agg, budgets, "top1", ".3f", full_value=False),
        "",
        _table(agg, budgets, "top1_ev", ".3f", full_value=False),
        "",
        f"## Passkey retrieval: exact matches out of {n} (greedy answer == passkey)",
        "",
        _table(agg, budgets, "exact", "d"),
        "",
        "## Passkey retrieval: mean log-probability of the answer (nats, summed over its tokens)",
        "",
        _table(agg, budgets, "answer_logprob", ".2f"),
        "",
        "Per sample (depth, passkey, full-cache greedy answer): "
        + "; ".join(
            f"{s['name']} {s['passkey']} → `{s['runs']['full']['answer_greedy_text'].strip()}`" for s in data["samples"]
        )
        + ".",
        "",
        "Best attention-free policy per budget — by KL: " + ", ".join(_best_attention_free(agg, budgets, "kl", False))
        + "; by perplexity: " + ", ".join(_best_attention_free(agg, budgets, "ppl", False))
        + "; by answer log-prob: " + ", ".join(_best_attention_free(agg, budgets, "answer_logprob", True)) + ".",
        "",
        f"![metrics against budget]({png_path.name})",
        "",
    ]
    md_path.write_text("\n".join(lines))
    _plot(agg, budgets, config, png_path, n)
    return md_path, png_path


def _plot(agg: dict, budgets: list, config: dict, png_path: Path, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("ppl", "perplexity (all evaluated tokens)", False),
        ("kl", "KL(full ‖ compressed), nats/token", True),
        ("top1", "top-1 agreement with full cache", False),
        ("ppl_ev", "perplexity after first eviction", False),
        ("answer_logprob", "passkey answer log-prob (nats)", False),
        ("exact", f"passkey exact matches (of {n})", False),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (metric, title, logy) in zip(axes.flat, panels):
        for policy in POLICY_ORDER:
            if policy not in agg:
                continue
            style = STYLE.get(policy, {})
            if policy == "full":
                value = agg["full"][None].get(metric)
                if metric in ("kl",) or value is None or (isinstance(value, float) and math.isnan(value)):
                    continue
                if metric == "ppl_ev":
                    xs = [b for b in budgets if b in agg["full"]]
                    ax.plot(xs, [agg["full"][b][metric] for b in xs], label="full (same tokens)", **style)
                    continue
                ax.axhline(value, label="full", **style)
                continue
            xs = [b for b in budgets if b in agg[policy]]
            ys = [agg[policy][b][metric] for b in xs]
            ax.plot(xs, ys, label=policy, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
        if logy:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("budget (tokens kept)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{config['model']}: {config['doc_tokens']}-token linux-doc streams, {n} samples, "
                 f"compress_every={config['compress_every']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        md, png = write_report(arg)
        print(md, png)
