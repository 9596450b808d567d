"""Suite part d: the share of decode time spent scoring and compacting (budget 2048, the longest context).

Reuses part b's instrumented rows when part b ran in the same call, else measures its own decode points.
"""

from __future__ import annotations

import traceback

from suite_harness import ROPE, Bench, decode_point


def part_d(bench: Bench, out: dict, b_rows: list[dict] | None) -> None:
    s, log = bench.s, bench.log
    context = max(s.contexts)
    rows: list[dict] = []
    out["rows"] = rows
    for batch in s.batches:
        row = None
        if b_rows:
            row = next(
                (
                    r
                    for r in b_rows
                    if r["kind"] == ROPE and r["budget"] == s.budget and r["batch"] == batch and r["context"] == context
                ),
                None,
            )
        if row is None or row.get("breakdown") is None:
            if log.out_of_time():
                out["skipped"].append(f"batch {batch}: --max-minutes reached")
                continue
            try:
                row = decode_point(bench, ROPE, s.budget, batch, context, instrument=True)
            except Exception as err:  # noqa: BLE001
                out["errors"].append(f"batch {batch}: {type(err).__name__}: {err}")
                traceback.print_exc()
                continue
        ce = s.compress_every
        per_cycle = ce * row["amortized_step_ms"]
        extra = max(0.0, row["compaction_step_ms"] - row["plain_step_ms"])
        entry = dict(
            batch=batch,
            context=context,
            budget=s.budget,
            compress_every=ce,
            plain_step_ms=row["plain_step_ms"],
            compaction_step_ms=row["compaction_step_ms"],
            amortized_step_ms=row["amortized_step_ms"],
            share_step_delta=extra / per_cycle,
        )
        if row.get("breakdown"):
            bd = row["breakdown"]
            entry.update(
                select_ms=bd["select_ms"],
                compact_ms=bd["compact_ms"],
                share_select=bd["select_ms"] / per_cycle,
                share_compact=bd["compact_ms"] / per_cycle,
                share_instrumented=(bd["select_ms"] + bd["compact_ms"]) / per_cycle,
            )
        rows.append(entry)
        log(
            f"[d] batch {batch} T={context}: compaction adds {extra:.2f} ms once per {ce} steps of "
            f"{row['plain_step_ms']:.2f} ms -> {100 * entry['share_step_delta']:.2f} % of decode time"
            + (
                f" (instrumented: scoring+selection {entry['select_ms']:.2f} ms, compaction {entry['compact_ms']:.2f} ms)"
                if "select_ms" in entry
                else ""
            )
        )
