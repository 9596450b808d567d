#!/usr/bin/env python
"""Markdown tables and PNG plots from the suite's ``results.json``; merges several runs into one report.

    python benchmarks/report.py out1/results.json out2/results.json --out merged

(used by ``suite.py`` at the end of a run; run it by hand to merge the two halves of a split run, or to redraw
the plots on a machine that has matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MIB = 2**20
GIB = 2**30

METHOD_A = (
    "Batch 1, a pinned prompt of `prompt` random tokens and one decode step, then the generation is emulated in "
    "steady state: random tokens go through the model in chunks of `compress_every` (128) tokens (512 for "
    "DynamicCache, whose footprint does not depend on how tokens arrive), which is what 128 decode steps do to "
    "a cache: a budgeted cache compacts once per chunk, exactly when decoding would, and its arena never holds "
    "more than budget + 128 slots. At each checkpoint T the cache's bytes and the allocator's readings are "
    "taken, then `mem_decode_steps` real single-token decode steps run and their peak is read. 'peak growth' is "
    "`max_memory_allocated` minus what was allocated before the cache existed (the weights), over the whole "
    "generation so far (chunk forwards included); 'decode peak' is the same over the decode steps at T only."
)
METHOD_B = (
    "Steady-state decode timing. The cache gets the pinned prompt and one decode step through the model, then "
    "random K/V for the remaining context is written through `cache.update(k, v, layer)` layer by layer (the "
    "call a forward makes; 128 tokens per pass for budgeted caches, so they compact exactly as in decoding; "
    "4096 per pass for DynamicCache). Decode steps are then timed one by one with CUDA events (median). For "
    "budgeted caches the plain steps are timed between compactions and the compaction step separately (cache "
    "topped up to budget + 128 first); tokens/s uses the amortised step ((127 x plain + compaction) / 128). "
    "Capacity: under `torch.cuda.set_per_process_memory_fraction(cap / total)`, the largest batch whose fill "
    "and decode (with a compaction for budgeted caches) raise no out-of-memory error; DynamicCache is probed at "
    "the full context, budgeted caches with a short fill (prompt + budget + 3 x 128: their footprint no longer "
    "grows) and the batch found is then filled to the full context and timed (fewer rows if it does not fit). "
    "Host ms: median time until the forward returned on the host, close to the step time when launching "
    "kernels is the bottleneck; cudaMalloc / step: the caching allocator's device allocations per timed step."
)
METHOD_C = (
    "Qwen3-32B shape, random bf16 weights quantized to int4 with optimum-quanto (quantize + freeze, layer by "
    "layer as the model is built; embeddings and lm_head stay bf16). The process's allocator is capped at 24 GiB "
    "before the model is built. DynamicCache: after the pinned prompt, random tokens go through the model in "
    "chunks of 512 until a forward runs out of memory; the cache is cut back to the last good length and the "
    "search continues with chunks of 64: the reported count is the last length that fit (a 64-token chunk "
    "needs a few MiB of activations more than a decode step, so decoding would fail within about 64 tokens of "
    "it; single-token steps past that point are too slow on quanto's int4 path to run here). RopeKVCache(budget=2048): chunks of 128 through the model up to 32K tokens (one "
    "compaction per chunk, as in decoding), then real decode steps; peak is `max_memory_allocated`."
)
METHOD_D = (
    "From the budget-2048 runs of part b at the longest context: the compaction step minus a plain step, once "
    "per 128 steps, as a share of 128 amortised steps. The breakdown times the cache's selection (scoring every "
    "layer + top-k) and in-place compaction calls with synchronisation around each (an instrumented run)."
)
METHOD_E = (
    "A smaller shape in float16 (the T4 path: no bf16 there): the Triton scoring and compaction kernels against "
    "their PyTorch references on fp16 keys in a strided arena view, greedy generate() with budget=None against "
    "DynamicCache, generate() with eviction, and steady-state decode timing."
)


# ============================================================================================== helpers
def _mib(value: Any) -> str:
    return "n/a" if value is None else f"{value / MIB:,.1f}"


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{100 * value:.2f} %"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def merge(results_list: list[dict]) -> dict:
    """One results dict from several runs (later runs' parts replace earlier ones of the same name)."""
    merged: dict[str, Any] = {"meta": dict(results_list[0]["meta"]), "settings": results_list[0].get("settings", {})}
    merged["parts"] = {}
    runs = []
    for res in results_list:
        merged["parts"].update(res.get("parts", {}))
        runs.append({k: res["meta"].get(k) for k in ("date", "commit", "device", "argv", "elapsed_s")})
    if len(results_list) > 1:
        merged["meta"]["runs"] = runs
    return merged


# ============================================================================================== headline
def headline(results: dict) -> list[list[Any]]:
    parts = results.get("parts", {})
    settings = results.get("settings", {})
    budget = settings.get("budget", 2048)
    rows: list[list[Any]] = []

    rec = parts.get("a", {}).get("reclamation")
    if rec:
        limit = rec["limit_bytes"]
        peak = rec.get("max_peak_growth_bytes")
        decode_peak = rec.get("max_decode_peak_growth_bytes")
        # A real generation feeds one token per step, so the decode-step peak is the faithful reading; the
        # whole-run peak also holds the activations of the 128-token chunks used to reach T quickly.
        judged = decode_peak if decode_peak is not None else peak
        ok = rec["max_cache_bytes"] <= limit and (judged is None or judged <= limit)
        rows.append(
            [
                f"real reclamation ({rec['tokens']:,} tokens, budget {rec['budget']})",
                f"cache bytes and peak growth <= {_mib(limit)} MiB",
                f"cache {_mib(rec['max_cache_bytes'])} MiB, decode-step peak growth {_mib(decode_peak)} MiB "
                f"(whole run incl. 128-token fill chunks: {_mib(peak)} MiB; gather-and-rebind: cache "
                f"{_mib(rec.get('gather_max_cache_bytes'))} MiB, peak growth "
                f"{_mib(rec.get('gather_max_peak_growth_bytes'))} MiB)",
                "yes" if ok else "NO",
            ]
        )

    cap = parts.get("b", {}).get("capacity", {})
    rope_cap = next((r for r in cap.get("rows", []) if r["kind"] == "ropekv"), None)
    dyn_cap = next((r for r in cap.get("rows", []) if r["kind"] == "dynamic"), None)
    if rope_cap and dyn_cap:
        br, tr = rope_cap.get("batch_ratio"), rope_cap.get("tokens_per_s_ratio")
        rows.append(
            [
                f"capacity at {cap['context']:,} tokens, cap {cap['cap_bytes'] / GIB:g} GiB",
                "max batch >= 8x, total tok/s >= 5x DynamicCache",
                f"batch {rope_cap['max_batch']} vs {dyn_cap['max_batch']} ({_f(br)}x); "
                f"{_f(rope_cap.get('tokens_per_s'), 1)} vs {_f(dyn_cap.get('tokens_per_s'), 1)} tok/s ({_f(tr)}x)",
                "yes" if (br or 0) >= 8 and (tr or 0) >= 5 else "NO",
            ]
        )

    b_rows = parts.get("b", {}).get("rows", [])
    if b_rows:
        context = max(r["context"] for r in b_rows)
        for batch, goal in ((max(r["batch"] for r in b_rows), 1.7), (min(r["batch"] for r in b_rows), 0.97)):
            row = next(
                (
                    r
                    for r in b_rows
                    if r["kind"] == "ropekv" and r["batch"] == batch and r["context"] == context and r["budget"] == budget
                ),
                None,
            )
            if row and row.get("ratio_to_dynamic") is not None:
                rows.append(
                    [
                        f"decode speed, batch {batch}, {context:,} tokens",
                        f">= {goal}x DynamicCache tok/s",
                        f"{row['tokens_per_s']:.1f} tok/s = {row['ratio_to_dynamic']:.2f}x",
                        "yes" if row["ratio_to_dynamic"] >= goal else "NO",
                    ]
                )

    d_rows = parts.get("d", {}).get("rows", [])
    if d_rows:
        worst = max(r["share_step_delta"] for r in d_rows)
        rows.append(
            [
                f"overhead at budget {budget}",
                "scoring + compaction <= 3 % of decode time",
                ", ".join(f"batch {r['batch']}: {_pct(r['share_step_delta'])}" for r in d_rows),
                "yes" if worst <= 0.03 else "NO",
            ]
        )

    c = parts.get("c", {})
    if c.get("dynamic") and c.get("ropekv"):
        dyn, rope = c["dynamic"], c["ropekv"]
        rows.append(
            [
                f"{c.get('cap_bytes', 0) / GIB:g} GiB scenario ({c.get('shape', {}).get('name', '')} int4)",
                "DynamicCache fails, RopeKVCache completes",
                f"DynamicCache: {'completed' if dyn['completed'] else 'out of memory after ' + format(dyn['tokens_reached'], ',') + ' tokens'}; "
                f"RopeKVCache: {rope['tokens_reached']:,} tokens, peak {_f((rope.get('peak_bytes') or 0) / GIB)} GiB",
                "yes" if (not dyn["completed"] and rope["completed"]) else "NO",
            ]
        )
    return rows


# ============================================================================================== markdown
def render_markdown(results: dict) -> str:
    meta, parts, settings = results.get("meta", {}), results.get("parts", {}), results.get("settings", {})
    out: list[str] = ["# hf_ropekv benchmark results", ""]
    dry = settings.get("dry_run")
    if dry:
        out += ["**DRY RUN** (tiny shapes: a check of the code paths, not a measurement).", ""]
    out.append(
        f"- date {meta.get('date')}, commit `{meta.get('commit')}`\n"
        f"- device: {meta.get('device')}"
        + (f" ({meta.get('device_total_memory_gib')} GiB)" if meta.get("device_total_memory_gib") else "")
        + f"\n- torch {meta.get('torch')} (CUDA {meta.get('cuda')}), transformers {meta.get('transformers')}, "
        f"triton {meta.get('triton')}, optimum-quanto {meta.get('optimum_quanto')}, Python {meta.get('python')}\n"
        f"- weights {settings.get('dtype')} (part e: float16), random; attention sdpa "
        f"(backends enabled: {', '.join(meta.get('sdpa_backends') or ['not recorded'])}); RopeKVCache "
        f"compress_every={settings.get('compress_every')}, page_size={settings.get('page_size')}, "
        f"pinned prompt {settings.get('prompt')} tokens; scorer: {_scorer_text(settings.get('scorer'))}"
    )
    for run in meta.get("runs", []):
        out.append(f"- run: {run}")
    out.append("")

    rows = headline(results)
    if rows:
        out += ["## Headline (issue 4 targets)", "", _table(["target", "goal", "measured", "met"], rows), ""]

    a = parts.get("a")
    if a:
        out += _part_header("a. Memory over a long generation", a, METHOD_A)
        out.append(
            _table(
                ["cache", "tokens", "kept", "cache MiB", "full-cache MiB", "resident MiB", "peak growth MiB",
                 "decode peak MiB", "reserved MiB", "step ms"],
                [
                    [r["cache"], f"{r['tokens']:,}", f"{r['kept']:,}", _mib(r["cache_bytes"]),
                     _mib(r["full_cache_bytes"]), _mib(r["resident_bytes"]), _mib(r["peak_so_far_bytes"]),
                     _mib(r["decode_peak_bytes"]), _mib(r["reserved_bytes"]), _f(r["step_ms"])]
                    for r in a.get("rows", [])
                ],
            )
        )
        out += _part_footer(a)

    b = parts.get("b")
    if b:
        out += _part_header("b. Decode throughput", b, METHOD_B)
        out.append(
            _table(
                ["batch", "context", "cache", "plain step ms", "compaction step ms", "amortised ms", "tok/s",
                 "x DynamicCache", "peak growth MiB", "host ms", "cudaMalloc / step"],
                [
                    [r["batch"], f"{r['seen']:,}", r["cache"], _f(r["plain_step_ms"]), _f(r["compaction_step_ms"]),
                     _f(r["amortized_step_ms"]), _f(r["tokens_per_s"], 1), _f(r.get("ratio_to_dynamic")),
                     _mib(r["peak_growth_bytes"]), _f(r.get("plain_host_ms")), _f(r.get("device_allocs_per_step"), 1)]
                    for r in b.get("rows", [])
                ],
            )
        )
        cap = b.get("capacity")
        if cap and cap.get("rows"):
            out += [
                "",
                f"### Largest batch at {cap['context']:,} tokens under a {cap['cap_bytes'] / GIB:g} GiB cap",
                "",
                _table(
                    ["cache", "max batch", "x DynamicCache", "total tok/s", "x DynamicCache", "step ms",
                     "peak growth MiB", "probes"],
                    [
                        [r["cache"], r["max_batch"], _f(r.get("batch_ratio")), _f(r.get("tokens_per_s"), 1),
                         _f(r.get("tokens_per_s_ratio")), _f(r.get("amortized_step_ms")),
                         _mib(r.get("peak_growth_bytes")), len(r.get("search", {}).get("probes", []))]
                        for r in cap["rows"]
                    ],
                ),
            ]
        out += _part_footer(b)

    c = parts.get("c")
    if c:
        out += _part_header("c. The 24 GB scenario", c, METHOD_C)
        if c.get("dynamic") or c.get("ropekv"):
            rows = []
            for name, entry in (("DynamicCache", c.get("dynamic")), (f"RopeKVCache(budget={settings.get('budget')})", c.get("ropekv"))):
                if entry:
                    rows.append(
                        [name, "yes" if entry["completed"] else "no (out of memory)", f"{entry['tokens_reached']:,}",
                         _mib(entry.get("cache_bytes")), _f((entry.get("peak_bytes") or 0) / GIB),
                         _f(entry.get("decode_step_ms")), _f(entry.get("seconds"), 0)]
                    )
            out.append(
                f"Weights {_f((c.get('weights_bytes') or 0) / GIB)} GiB ({c.get('weight_tensor')}, int4 grouping "
                f"{c.get('int4_grouping')}), "
                f"cap {(c.get('cap_bytes') or 0) / GIB:g} GiB, KV {(c.get('bytes_per_token') or 0) / 1024:.0f} KiB per token."
            )
            out.append("")
            out.append(
                _table(["cache", f"completed {settings.get('c_target', 32768):,} tokens", "tokens reached", "cache MiB", "peak GiB", "decode step ms", "s"], rows)
            )
        out += _part_footer(c)

    d = parts.get("d")
    if d:
        out += _part_header("d. Overhead of scoring and compaction", d, METHOD_D)
        out.append(
            _table(
                ["batch", "context", "plain step ms", "compaction step ms", "share (step delta)",
                 "scoring+selection ms", "compaction ms", "share (instrumented)"],
                [
                    [r["batch"], f"{r['context']:,}", _f(r["plain_step_ms"]), _f(r["compaction_step_ms"]),
                     _pct(r["share_step_delta"]), _f(r.get("select_ms")), _f(r.get("compact_ms")),
                     _pct(r.get("share_instrumented"))]
                    for r in d.get("rows", [])
                ],
            )
        )
        out += _part_footer(d)

    e = parts.get("e")
    if e:
        out += _part_header("e. fp16 path", e, METHOD_E)
        for key in ("shape", "kernels", "exact", "eviction"):
            if key in e:
                out.append(f"- {key}: {e[key]}")
        if e.get("decode"):
            out += [
                "",
                _table(
                    ["cache", "batch", "context", "plain step ms", "amortised ms", "tok/s"],
                    [
                        [r["cache"], r["batch"], f"{r['seen']:,}", _f(r["plain_step_ms"]), _f(r["amortized_step_ms"]),
                         _f(r["tokens_per_s"], 1)]
                        for r in e["decode"]
                    ],
                ),
            ]
        out += _part_footer(e)

    plots = meta.get("plots")
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(out) + "\n"


def _scorer_text(name: Any) -> str:
    return {
        "frequency": "FrequencyScorer (the default) with random query statistics (the weights are random too)",
        "online": "FrequencyScorer with statistics gathered online from the prompt",
        "recency": "RecencyScorer",
    }.get(name, str(name))


def _part_header(title: str, part: dict, method: str) -> list[str]:
    lines = ["", f"## {title}", ""]
    shape = part.get("shape")
    if shape:
        lines.append(f"Shape: {shape}" + (f"; weights {_f((part.get('weights_bytes') or 0) / GIB)} GiB" if part.get("weights_bytes") else "")
                     + (f"; KV {part['bytes_per_token'] / 1024:.0f} KiB per token" if part.get("bytes_per_token") else ""))
        lines.append("")
    lines += [f"*Method.* {part.get('method') or method}", ""]
    return lines


def _part_footer(part: dict) -> list[str]:
    lines = [""]
    for key, title in (("notes", "Notes"), ("skipped", "Skipped"), ("errors", "Errors")):
        for item in part.get(key, []):
            lines.append(f"- {title}: {item}")
    return lines + [""] if len(lines) > 1 else lines


# ============================================================================================== plots
def make_plots(results: dict, out_dir: Path) -> list[str]:
    """PNG plots of whatever parts are present; returns the file names written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (python benchmarks/report.py results.json --out DIR later)")
        return []
    out_dir = Path(out_dir)
    parts = results.get("parts", {})
    settings = results.get("settings", {})
    device = results.get("meta", {}).get("device", "")
    written: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)

    a = parts.get("a", {})
    if a.get("rows"):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for label in dict.fromkeys(r["cache"] for r in a["rows"]):
            rows = [r for r in a["rows"] if r["cache"] == label]
            x = [r["tokens"] for r in rows]
            axes[0].plot(x, [r["cache_bytes"] / MIB for r in rows], marker="o", label=label)
            if rows[0]["peak_so_far_bytes"] is not None:
                axes[1].plot(x, [r["peak_so_far_bytes"] / MIB for r in rows], marker="o", label=label)
        rec = a.get("reclamation")
        for ax, title in zip(axes, ("cache bytes", "peak allocated beyond weights (whole generation so far)")):
            if rec:
                ax.axhline(rec["limit_bytes"] / MIB, color="gray", ls="--", lw=1,
                           label=f"1.1 x (budget {rec['budget']} + {rec.get('compress_every', 128)}) x bytes/token")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens generated (seen)")
            ax.set_ylabel("MiB")
            ax.set_title(title, fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"a. memory over a long generation, batch 1 ({a.get('shape', {}).get('name')}, {device})", fontsize=10)
        save(fig, "memory.png")

    b = parts.get("b", {})
    if b.get("rows"):
        batches = sorted({r["batch"] for r in b["rows"]})
        fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            for label in dict.fromkeys(r["cache"] for r in b["rows"]):
                rows = sorted((r for r in b["rows"] if r["cache"] == label and r["batch"] == batch), key=lambda r: r["seen"])
                if rows:
                    ax.plot([r["seen"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=label)
                    for r in rows:
                        if r.get("ratio_to_dynamic") and r["kind"] != "dynamic":
                            ax.annotate(f"{r['ratio_to_dynamic']:.2f}x", (r["seen"], r["tokens_per_s"]), fontsize=7,
                                        textcoords="offset points", xytext=(3, 4))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode tokens/s")
            ax.set_title(f"batch {batch}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"b. decode throughput ({b.get('shape', {}).get('name')}, {device})", fontsize=10)
        save(fig, "throughput.png")
    cap = b.get("capacity", {})
    if cap.get("rows"):
        rows = cap["rows"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["cache"] for r in rows]
        axes[0].bar(names, [r["max_batch"] for r in rows], color="tab:blue")
        axes[0].set_ylabel(f"largest batch at {cap['context']:,} tokens")
        axes[1].bar(names, [r.get("tokens_per_s") or 0 for r in rows], color="tab:green")
        axes[1].set_ylabel("total decode tokens/s at that batch")
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7, rotation=15)
            ax.grid(True, axis="y", alpha=0.3)
        fig.suptitle(f"b. capacity under a {cap['cap_bytes'] / GIB:g} GiB cap ({device})", fontsize=10)
        save(fig, "capacity.png")

    c = parts.get("c", {})
    if c.get("dynamic_trace") or c.get("ropekv_trace"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        traces = {key: c.get(key, []) for key in ("dynamic_trace", "ropekv_trace")}
        # GPU: allocator readings; CPU dry run (no allocator): the caches' own bytes.
        field = "allocated" if any(t.get("allocated") is not None for v in traces.values() for t in v) else "cache"
        for name, key in (("DynamicCache", "dynamic_trace"), (f"RopeKVCache(budget={settings.get('budget')})", "ropekv_trace")):
            trace = [t for t in traces[key] if t.get(field) is not None]
            if trace:
                ax.plot([t["tokens"] for t in trace], [t[field] / GIB for t in trace], label=name)
        if c.get("dynamic", {}).get("oom_after_tokens"):
            ax.axvline(c["dynamic"]["oom_after_tokens"], color="tab:red", ls=":", lw=1, label="DynamicCache out of memory")
        if c.get("cap_bytes") and field == "allocated":
            ax.axhline(c["cap_bytes"] / GIB, color="gray", ls="--", lw=1, label="cap")
        ax.set_xlabel("tokens generated (seen)")
        ax.set_ylabel("allocated GiB" if field == "allocated" else "cache GiB (no allocator on CPU)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"c. {c.get('shape', {}).get('name')} int4 under a {(c.get('cap_bytes') or 0) / GIB:g} GiB cap ({device})",
                     fontsize=10)
        save(fig, "scenario_24gb.png")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.json files (later ones' parts win)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    merged = merge([json.loads(Path(f).read_text()) for f in args.results])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    merged["meta"]["plots"] = make_plots(merged, out)
    (out / "results.json").write_text(json.dumps(merged, indent=1, default=str))
    (out / "results.md").write_text(render_markdown(merged))
    print(render_markdown(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
