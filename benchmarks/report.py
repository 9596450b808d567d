#!/usr/bin/env python
"""Tables in the docs, generated from the result files: nothing in them is written by hand.

    python benchmarks/report.py            # rewrite every generated block in README.md and docs/*.md
    python benchmarks/report.py --check    # exit 1 if a block is stale (what a test or CI runs)

A block is the text between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; NAME is one of
``BLOCKS``: quality_matrix (the default, the peers, int8), quality_variants (the default's variants),
quality_summary (the default against full), quality_vs_peers, speed, speed_summary, speed_int8, memory, runs. A
NAME with no result files says "no results yet". Result files are ``benchmarks/results/*.json``, each with
``name``, ``date``, ``device``, ``commit`` and ``command``; quality rows of several files are merged (for one cell
and device the newest run wins); memory and speed_int8 come from the newest file of their name, speed from the
newest run and the other runs of its library code and device, point by point. Pure Python: no torch needed.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NO_RESULTS = "no results yet"
MIB = 2**20


# ---------------------------------------------------------------------------------------------- quality rows
#: The policies from other work that the default is held against (the other names are the default's variants).
PEERS = ("recency", "sink_recent", "snapkv", "h2o", "rkv")
#: The matrix's columns beside the peers: the library's own options. Every other policy is a variant of the default
#: (a mechanism switched off, an earlier rule), shown in the variants table.
OPTIONS = ("int8", "int8_2x")


def _cell_key(row: dict[str, Any]) -> tuple:
    """The matrix line a row belongs to: task, model, device, setting, param."""
    return row["task"], row["model"], row.get("device", ""), row["setting"], row["param"]


def _ref(row: dict[str, Any]) -> tuple:
    """What a row is compared with: the full cache's row of the same task, model, setting, device (greedy decoding
    differs between GPUs, so a fraction of full pairs runs of one device) and prompt length."""
    return row["task"], row["model"], row["setting"], row.get("device", ""), row["extra"].get("length")


def device_label(device: str) -> str:
    """A result's device in short: the GPU model (``H100``, ``H200``), else ``CPU``, else the text as it is."""
    gpu = re.search(r"\b([A-Z]\d{2,4})\b", device)
    return gpu.group(1) if gpu else ("CPU" if device.upper().startswith("CPU") else device)


def finalize_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``vs_full`` to every row (accuracy: the fraction of full's; perplexity: the relative increase) and, where
    both rows hold per-problem outcomes (``extra.bits``), ``lost`` / ``gained`` against full. In place; returned."""
    full = {_ref(r): r for r in rows if r["policy"] == "full"}
    for r in rows:
        f = full.get(_ref(r))
        r["vs_full"] = r.get("vs_full") if f is None or r is f else None
        if f is not None and r is not f and f["score"]:
            r["vs_full"] = r["score"] / f["score"] - 1 if r["task"] == "doc_ppl" else r["score"] / f["score"]
        bits, full_bits = r["extra"].get("bits"), (f or {}).get("extra", {}).get("bits")
        if bits and full_bits and r is not f and len(bits) == len(full_bits):
            r["lost"] = sum(a == "1" and b == "0" for a, b in zip(full_bits, bits))
            r["gained"] = sum(a == "0" and b == "1" for a, b in zip(full_bits, bits))
    return rows


def merge_rows(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of several quality results, the newest run's row for each (task, model, policy, param, setting,
    device); each row remembers its run (``run``: date and commit) and its device (:func:`device_label`)."""
    merged: dict[tuple, dict[str, Any]] = {}
    for result in sorted(results, key=lambda r: r["date"]):
        device = device_label(result["device"])
        for row in result["rows"]:
            key = (row["task"], row["model"], row["policy"], row["param"], row["setting"], device)
            merged[key] = {**row, "device": device, "run": f"{result['date'][:10]} {result['commit'][:7]}"}
    return finalize_rows(list(merged.values()))


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if row["task"] == "doc_ppl":
        text = f"{row['score']:.2f}"
        return text + ("" if row.get("vs_full") is None else f" ({100 * row['vs_full']:+.1f} %)")
    text = f"{row['extra']['correct']}/{row['n']}" if "correct" in row["extra"] else f"{row['score']:.3f}"
    return text + ("" if row.get("vs_full") is None else f" ({row['vs_full']:.2f})")


def peer_of(policy: str) -> str | None:
    """The peer a policy runs (``snapkv_fullroom``: SnapKV under an earlier window rule), else None."""
    return policy if policy in PEERS else next((p for p in PEERS if policy.startswith(p + "_")), None)


def _column_order(policy: str) -> tuple[int, str]:
    """The default first, the peers next in their order (each with its earlier windows), then the rest by name."""
    if policy == "default":
        return 0, ""
    peer = peer_of(policy)
    return (1 + PEERS.index(peer), policy) if peer else (1 + len(PEERS), policy)


def is_variant(policy: str) -> bool:
    """A variant of the default (not the default, full, a peer or a library option)."""
    return policy not in ("default", "full", *OPTIONS) and peer_of(policy) is None


def quality_table(rows: list[dict[str, Any]], variants: bool = False) -> str:
    """The matrix: one line per cell (task, model, setting, param), one column per policy; full's score in its
    own column; accuracy cells show correct / n (fraction of full), perplexity cells ppl (+% over full). The
    default, the peers and the library's options; with ``variants``, the default and its variants instead (cells
    where one ran), one table per task (retrieval: per question seen and unseen), each with its own columns."""
    if not rows:
        return NO_RESULTS
    finalize_rows(rows)
    if not variants:
        return _policy_table([r for r in rows if not is_variant(r["policy"])])
    cells_run = {_cell_key(r) for r in rows if is_variant(r["policy"])}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        shown = _cell_key(r) in cells_run and (r["policy"] == "default" or is_variant(r["policy"]))
        if r["policy"] == "full" or shown:
            groups.setdefault(_variant_group(r), []).append(r)
    return "\n\n".join(f"**{name}**\n\n{_policy_table(group)}" for name, group in groups.items()
                       if any(r["policy"] != "full" for r in group))


def _variant_group(row: dict[str, Any]) -> str:
    if row["task"] != "retrieval":
        return row["task"]
    return "retrieval, question " + ("unseen" if "unseen" in row["setting"] else "seen")


def _policy_table(rows: list[dict[str, Any]]) -> str:
    """One table of ``rows`` (full's rows give the full column): a line per cell, a column per other policy."""
    names = sorted(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"), key=_column_order)
    full = {_ref(r): r for r in rows if r["policy"] == "full"}
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["policy"] != "full":
            cells.setdefault(_cell_key(r), {})[r["policy"]] = r
    lines = ["| task | model | device | setting | cell | full | " + " | ".join(names) + " |",
             "|" + "---|" * (6 + len(names))]
    for (task, model, device, setting, param), by_policy in cells.items():
        any_row = next(iter(by_policy.values()))
        lines.append(f"| {task} | {model} | {device} | {setting} | {param} | {_cell(full.get(_ref(any_row)))} | "
                     + " | ".join(_cell(by_policy.get(n)) for n in names) + " |")
    if len(cells) == 0:  # only full rows
        lines += [f"| {r['task']} | {r['model']} | {r.get('device', '')} | {r['setting']} | {r['param']} | "
                  f"{_cell(r)} |" for r in rows]
    return "\n".join(lines)


def quality_vs_peers(rows: list[dict[str, Any]]) -> str:
    """Per cell: the default against full, the best peer, and whether the default beats every peer there."""
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in finalize_rows(rows):
        if (r["policy"] == "default" or peer_of(r["policy"])) and r.get("vs_full") is not None:
            cells.setdefault(_cell_key(r), {})[r["policy"]] = r
    lines = ["| task | model | device | setting | cell | default vs full | best peer (vs full) | default above every "
             "peer |", "|---|---|---|---|---|---|---|---|"]
    for (task, model, device, setting, param), by_policy in cells.items():
        default = by_policy.get("default")
        if default is None:
            continue
        better = (lambda a, b: a < b) if task == "doc_ppl" else (lambda a, b: a > b)
        peers = [r for p, r in by_policy.items() if p != "default"]
        best = min(peers, key=lambda r: r["vs_full"]) if task == "doc_ppl" else max(peers, key=lambda r: r["vs_full"],
                                                                                     default=None)
        if task == "doc_ppl" and not peers:
            best = None
        fmt = (lambda v: f"{100 * v:+.1f} %") if task == "doc_ppl" else (lambda v: f"{v:.2f}")
        above = "" if not peers else ("yes" if all(better(default["vs_full"], r["vs_full"]) for r in peers) else "no")
        best_text = "" if best is None else f"{best['policy']} ({fmt(best['vs_full'])})"
        lines.append(f"| {task} | {model} | {device} | {setting} | {param} | {fmt(default['vs_full'])} | {best_text} | "
                     f"{above} |")
    return "\n".join(lines) if len(lines) > 2 else NO_RESULTS


def _natural(param: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", param))


def _vs_full(task: str, value: float) -> str:
    return f"{100 * value:+.1f} %" if task == "doc_ppl" else f"{value:.2f}"


def quality_summary(rows: list[dict[str, Any]]) -> str:
    """The default's score against the full cache's (tune runs left out), one line per task, setting and device, one
    column per model (accuracy: a fraction of full; perplexity: the increase over full); the cells' params in the
    first column."""
    table: dict[tuple, dict[str, dict[str, str]]] = {}
    for r in finalize_rows(rows):
        if r["policy"] == "default" and r.get("vs_full") is not None and r["setting"].split(", ")[-1] != "tune":
            group = (r["task"], f"{r['setting']}, {r['device']}" if r.get("device") else r["setting"])
            table.setdefault(group, {}).setdefault(r["model"], {})[r["param"]] = _vs_full(r["task"], r["vs_full"])
    if not table:
        return NO_RESULTS
    order = ("gsm8k_cot", "gsm8k_pot", "doc_ppl", "retrieval")
    groups = sorted(table, key=lambda g: (order.index(g[0]) if g[0] in order else len(order), g[1]))
    models = list(dict.fromkeys(m for g in groups for m in table[g]))
    lines = ["| default vs full | " + " | ".join(models) + " |", "|" + "---|" * (len(models) + 1)]
    for task, setting in groups:
        by_model = table[(task, setting)]
        params = sorted({p for cells in by_model.values() for p in cells}, key=_natural)
        values = [" / ".join(by_model[m].get(p, "–") for p in params) if m in by_model else "" for m in models]
        lines.append(f"| {task}, {setting} ({' / '.join(params)}) | " + " | ".join(values) + " |")
    return "\n".join(lines)


def speed_summary(result: dict[str, Any]) -> str:
    """The default cache's decode step against DynamicCache's at each point, and end to end."""
    steps = {(r["point"], r["cache"]): r.get("decode_p50_ms") for r in result["rows"]}
    lines = ["| batch x prompt | DynamicCache step | default RopeKVCache step | speed-up |", "|---|---|---|---|"]
    for point in dict.fromkeys(r["point"] for r in result["rows"]):
        dyn, rope = steps.get((point, "dynamic")), steps.get((point, "ropekv"))
        if dyn and rope:
            lines.append(f"| {point} | {dyn:.1f} ms | {rope:.1f} ms | {dyn / rope:.2f}x |")
    e2e = {_e2e_key(e) + (e["cache"],): e for e in result.get("e2e", []) if e.get("total_s")}
    longest = {}  # per point the longest run: a short one (a first-token check) is mostly the graph's recording
    for point, tokens, _ in e2e:
        longest[point] = max(longest.get(point, 0), tokens)
    for (point, tokens, cache), e in e2e.items():
        dyn = e2e.get((point, tokens, "dynamic"))
        if cache == "ropekv" and dyn and tokens == longest[point]:
            lines.append(f"| {point}, {tokens} tokens end to end | {dyn['total_s']:.1f} s | "
                         f"{e['total_s']:.1f} s | {dyn['total_s'] / e['total_s']:.2f}x |")
    return "\n".join(lines) if len(lines) > 2 else NO_RESULTS


# ---------------------------------------------------------------------------------------------- speed, memory
def _num(value: Any, spec: str = ".2f") -> str:
    return "" if value is None else format(value, spec)


def _e2e_key(entry: dict[str, Any]) -> tuple[str, int]:
    """An end-to-end run's point and length: a 2,000-token run and a 32-token first-token run are both shown."""
    return entry["point"], entry.get("new_tokens", 0)


def speed_table(result: dict[str, Any]) -> str:
    e2e = {_e2e_key(e) + (e["cache"],): e for e in result.get("e2e", [])}  # the last round of each
    base = {r["point"]: r.get("decode_p50_ms") for r in result["rows"] if r["cache"] == "dynamic"}
    head = ("| point | cache | step p50 ms | p90 ms | prefill ms | GPU attention / matmul / other ms | host ms | "
            "vs DynamicCache | TTFT s | end to end s (last round) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        gpu = r.get("gpu_ms") or {}
        gpu_text = " / ".join(_num(gpu.get(k)) for k in ("attention", "matmul", "other")) if gpu else ""
        ref, p50 = base.get(r["point"]), r.get("decode_p50_ms")
        lines.append(f"| {r['point']} | {r.get('label', r['cache'])} | {_num(p50)} | {_num(r.get('decode_p90_ms'))} | "
                     f"{_num(r.get('prefill_ms'), '.0f')} | {gpu_text} | {_num(r.get('host_ms'))} | "
                     f"{'' if not ref or not p50 else f'{ref / p50:.2f}x'} |  |  |")
    for (point, tokens, cache), e in e2e.items():  # fresh processes: a row of their own per length
        lines.append(f"| {point}, {tokens} tokens | {e.get('label', cache)} |  |  |  |  |  |  | "
                     f"{_num(e.get('ttft_s'))} | {_num(e.get('total_s'), '.1f')} |")
    return "\n".join(lines)


def memory_table(result: dict[str, Any]) -> str:
    full = {r["tokens"]: r["cache_bytes"] for r in result["rows"] if r.get("kind") == "dynamic"}
    lines = ["| cache | tokens | kept | cache MiB | x DynamicCache | peak growth MiB | of it, held at start MiB | "
             "step ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ref, peak, start = full.get(r["tokens"]), r.get("peak_bytes"), r.get("leftover_bytes")
        ratio = "" if not ref else f"{r['cache_bytes'] / ref:.3f}"
        lines.append(f"| {r['cache']} | {r['tokens']} | {_num(r.get('kept'), 'd')} | {r['cache_bytes'] / MIB:.1f} | "
                     f"{ratio} | {'' if peak is None else f'{peak / MIB:.1f}'} | "
                     f"{'' if start is None else f'{start / MIB:.1f}'} | {_num(r.get('step_ms'))} |")
    return "\n".join(lines)


def precision_table(result: dict[str, Any]) -> str:
    """Each storage's mean NLL and its perplexity against unquantized storage."""
    lines = ["| storage | mean NLL | perplexity against unquantized |", "|---|---|---|"]
    lines += [f"| {r['storage']} | {r['mean_nll']:.4f} | {r['perplexity_vs_unquantized']:.4f}x |"
              for r in result["rows"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- blocks
def load_results(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every result file of ``folder`` (top level only), each with its file name as ``file``."""
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and {"name", "date"} <= data.keys():
            out.append({**data, "file": path.name})
    return out


def _source(results: list[dict[str, Any]]) -> str:
    return "Source: " + "; ".join(f"`{r['file']}` ({r['date'][:10]}, {r['device']}, commit `{r['commit'][:7]}`)"
                                  for r in results) + "."


def _brief_source(results: list[dict[str, Any]]) -> str:
    """The README's source line: dates and devices only (the runs table in docs/benchmarks.md names files and
    commits)."""
    dates = sorted({r["date"][:10] for r in results})
    devices = sorted({r["device"] for r in results})
    return (f"Measured {', '.join(dates)} on {', '.join(devices)}; every run's command and code version: "
            "[docs/benchmarks.md](docs/benchmarks.md#runs).")


def _newest(results: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    of_name = [r for r in results if r["name"] == name]
    return max(of_name, key=lambda r: r["date"]) if of_name else None


def _quality(results: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str],
             source: Callable[[list[dict[str, Any]]], str] = _source) -> str:
    runs = [r for r in results if r["name"] == "quality" and r.get("rows")]
    return NO_RESULTS if not runs else render(merge_rows(runs)) + "\n\n" + source(runs)


def _single(results: list[dict[str, Any]], name: str, render: Callable[[dict[str, Any]], str],
            source: Callable[[list[dict[str, Any]]], str] = _source) -> str:
    newest = _newest(results, name)
    return NO_RESULTS if newest is None or not newest.get("rows") else render(newest) + "\n\n" + source([newest])


def newest_speed(results: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The newest speed run, with the points of other runs of the same library code and device (one device call
    may not fit every point; a commit that changed only benchmarks or docs keeps the code): each point's step rows
    come whole from the newest run that has them, and so do its end-to-end entries of each length, so every ratio
    stays one run's. The merged result and the files it was taken from, newest first."""
    speed = [r for r in results if r["name"] == "speed" and (r.get("rows") or r.get("e2e"))]
    newest = _newest(speed, "speed")
    if newest is None:
        return None
    code = _library_code(newest["commit"])
    same = sorted((r for r in speed if r["device"] == newest["device"] and _library_code(r["commit"]) == code),
                  key=lambda r: r["date"], reverse=True)
    rows: list[dict[str, Any]] = []
    e2e: list[dict[str, Any]] = []
    used: list[dict[str, Any]] = []
    for run in same:
        points = {r["point"] for r in run.get("rows", [])} - {r["point"] for r in rows}
        e2e_points = {_e2e_key(e) for e in run.get("e2e", [])} - {_e2e_key(e) for e in e2e}
        rows += [r for r in run.get("rows", []) if r["point"] in points]
        e2e += [e for e in run.get("e2e", []) if _e2e_key(e) in e2e_points]
        if points or e2e_points:
            used.append(run)
    rows.sort(key=lambda r: _natural(r["point"]))  # stable: each point's caches keep their run's order
    return {**newest, "rows": rows, "e2e": e2e}, used


@functools.lru_cache(maxsize=None)
def _library_code(commit: str) -> str:
    """The git trees of ``hf_ropekv/`` and ``kernels/`` at ``commit``; the commit itself where git cannot say."""
    try:
        out = subprocess.run(["git", "rev-parse", f"{commit}:hf_ropekv", f"{commit}:kernels"], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return commit
    return out.stdout.replace("\n", " ").strip() if out.returncode == 0 else commit


def _speed(results: list[dict[str, Any]], render: Callable[[dict[str, Any]], str],
           source: Callable[[list[dict[str, Any]]], str] = _source) -> str:
    found = newest_speed(results)
    return NO_RESULTS if found is None else render(found[0]) + "\n\n" + source(found[1])


def runs_table(results: list[dict[str, Any]]) -> str:
    lines = ["| file | date | device | commit | command |", "|---|---|---|---|---|"]
    lines += [f"| `{r['file']}` | {r['date'][:10]} | {r['device']} | `{r['commit'][:7]}` | `{r['command']}` |"
              for r in sorted(results, key=lambda r: r["date"], reverse=True)]
    return "\n".join(lines) if results else NO_RESULTS


BLOCKS: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "quality_matrix": lambda results: _quality(results, quality_table),
    "quality_variants": lambda results: _quality(results, functools.partial(quality_table, variants=True)),
    "quality_summary": lambda results: _quality(results, quality_summary, _brief_source),
    "quality_vs_peers": lambda results: _quality(results, quality_vs_peers),
    "speed": lambda results: _speed(results, speed_table),
    "speed_summary": lambda results: _speed(results, speed_summary, _brief_source),
    "speed_int8": lambda results: _single(results, "speed_int8", speed_table),
    "memory": lambda results: _single(results, "memory", memory_table),
    "kv_precision": lambda results: _single(results, "kv_precision", precision_table),
    "runs": runs_table,
}
# A marker is a line of its own: the same text inside prose (`<!-- generated:NAME -->` in backquotes) is no block.
_BLOCK = re.compile(r"^(<!-- generated:([\w-]+) -->\n)(.*?)(^<!-- /generated:\2 -->)$", re.DOTALL | re.MULTILINE)


def rewrite(text: str, results: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """``text`` with every known block regenerated, and the names of the blocks that changed."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in BLOCKS:
            print(f"unknown generated block {name!r}: left as it is (known: {', '.join(BLOCKS)})", file=sys.stderr)
            return match.group(0)
        body = f"{BLOCKS[name](results)}\n"
        if body != match.group(3):
            changed.append(name)
        return match.group(1) + body + match.group(4)

    return _BLOCK.sub(replace, text), changed


def doc_files(repo: Path = REPO) -> list[Path]:
    return [p for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))] if p.is_file()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    p.add_argument("--results", default=str(RESULTS), help="folder of result JSON files")
    p.add_argument("files", nargs="*", help="Markdown files (default: README.md and docs/*.md)")
    args = p.parse_args(argv)
    results = load_results(Path(args.results))
    stale = []
    for path in [Path(f) for f in args.files] or doc_files():
        text = path.read_text()
        new, changed = rewrite(text, results)
        if changed and args.check:
            stale.append(f"{path}: {', '.join(changed)}")
        elif changed:
            path.write_text(new)
            print(f"{path}: rewrote {', '.join(changed)}")
    if stale:
        print("stale generated blocks (run python benchmarks/report.py):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
