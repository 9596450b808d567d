"""The GPU benchmark scripts still run: their ``--dry-run`` paths on the CPU, tiny shapes, in a subprocess each.

They are run on the H200 only a few times a session, so a broken import or a renamed cache attribute would
otherwise surface there, costing device time. The checks read what the scripts wrote, not just their exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, *args: str, timeout: int = 600) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), "--dry-run", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_suite_dry_run_measures_every_part(tmp_path: Path) -> None:
    run_script("suite.py", "--out", str(tmp_path), "--no-cudnn-sdpa")
    result = json.loads((tmp_path / "results.json").read_text())
    assert "cudnn" not in result["meta"]["sdpa_backends"] and "math" in result["meta"]["sdpa_backends"]
    parts = result["parts"]
    assert sorted(parts) == ["a", "b", "c", "d", "e"]
    assert all(not p["errors"] and not p["skipped"] for p in parts.values()), {k: p["errors"] for k, p in parts.items()}
    settings = result["settings"]
    for row in parts["b"]["rows"]:
        assert row["plain_step_ms"] > 0 and row["tokens_per_s"] > 0
        if row["kind"] == "ropekv":  # the budgeted cache kept its bound while the context grew past it
            assert row["kept"] <= row["budget"] + settings["compress_every"] < row["seen"]
    assert (tmp_path / "results.md").read_text().startswith("# hf_ropekv benchmark results")


def test_profile_decode_dry_run_profiles_and_pairs(tmp_path: Path) -> None:
    run_script("profile_decode.py", "--out", str(tmp_path), "--paired-steps", "4")
    result = json.loads((tmp_path / "profile.json").read_text())
    budget = result["budget"]
    points, pairs = result["points"], result["pairs"]
    # 2 batches x 2 contexts x (DynamicCache, RopeKVCache), plus the first point again
    assert len(points) == 9 and points[-1]["cache"] == points[0]["cache"] == "DynamicCache"
    for row in points:
        assert row["step_ms"] > 0 and row["aten_self_cpu_ms"] > 0 and row["host_ops"]
        if row["cache"].startswith("RopeKVCache"):
            assert budget <= row["kept"] < row["context"]
        else:
            assert row["kept"] > row["context"]  # the prompt's decode steps come on top
    assert len(pairs) == 4
    for row in pairs:
        assert len(row["dynamic_steps_ms"]) == len(row["ropekv_steps_ms"]) == 4
        assert row["paired_ratio"] > 0 and budget <= row["kept"]
    assert "Alternating plain decode steps" in (tmp_path / "profile.md").read_text()


def test_generate_speed_dry_run_times_both_caches(tmp_path: Path) -> None:
    run_script("generate_speed.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "generate_speed.json").read_text())
    dynamic, rope = result["runs"]
    assert dynamic["cache"] == "DynamicCache" and rope["cache"].startswith("RopeKVCache")
    for run in result["runs"]:
        assert run["new_tokens"] == result["new_tokens"]
        assert len(run["steps_ms"]) == result["new_tokens"] - 1 and min(run["steps_ms"]) > 0
    assert dynamic["kept"] == result["prompt"] + result["new_tokens"] - 1
    assert rope["kept"] <= result["budget"] + result["compress_every"]


def test_exactness_check_dry_run_finds_cpu_runs_identical(tmp_path: Path) -> None:
    run_script("exactness_check.py", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "exactness.json").read_text())["rows"]
    assert len(rows) == 6  # one dtype x two backend settings x three variants
    assert all(r["identical"] and r["max_logit_diff"] == 0.0 for r in rows), [r["summary"] for r in rows]


def test_stats_overhead_dry_run(tmp_path: Path) -> None:
    run_script("stats_overhead.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "stats_overhead.json").read_text())
    per_cache = result["per_cache"]
    assert sorted(per_cache) == ["calibrated", "online"]
    for row in per_cache.values():
        assert row["median_step_ms"] > 0 and row["compaction_steps"] >= 1  # both evicted on the same clock
        assert row["kept"] <= result["settings"]["budget"] + result["settings"]["compress_every"]


def test_compiled_decode_dry_run_alternates_variants_and_finds_capacity(tmp_path: Path) -> None:
    run_script("compiled_decode.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "compiled_decode.json").read_text())
    assert "cudnn" not in result["meta"]["sdpa_backends"]  # forced off, without the flag
    settings = result["settings"]
    steps_per_run = settings["new_tokens"] - 2  # gaps between logits, the first decode step left out
    points = result["points"]
    assert [(p["batch"], p["prompt"]) for p in points] == [(1, 48), (2, 80)]
    for point in points:
        summary = point["summary"]
        assert sorted(summary) == ["dynamic", "ropekv", "ropekv_static", "static"]
        for key in ("dynamic", "static", "ropekv"):
            row = summary[key]
            assert "error" not in row, row
            assert row["runs"] == settings["repeats"] and row["steps"] == settings["repeats"] * steps_per_run
            assert 0 < row["p50_ms"] <= row["p90_ms"] and row["mean_ms"] > 0 and row["prefill_ms"] > 0
        # generate compiled the StaticCache once, in its warm-up; the timed runs reused it
        assert summary["static"]["graphs_compiled_in_warmup"] >= 1
        assert summary["static"]["graphs_compiled_in_timed_runs"] == 0 and summary["static"]["compile_warmup_s"] > 0
        assert summary["dynamic"]["compile_warmup_s"] is None
        assert summary["ropekv"]["kept"] <= settings["budget"] + settings["compress_every"] < point["prompt"]
        # RopeKVCache(static=True): measured once the option exists, else an error entry and the run went on
        rope_static = summary["ropekv_static"]
        assert "constructing the cache" in rope_static.get("error", "") or rope_static["p50_ms"] > 0
    # The last point's (simulated) out-of-memory prefill was retried in chunks, which RopeKVCache accepts.
    assert points[0]["prefill_chunk"] is None and points[1]["prefill_chunk"] == 32
    assert points[1]["chunked_after_oom_of"] and not points[1]["errors"].get("ropekv")
    capacity = result["capacity"]["variants"]
    dynamic = capacity["dynamic"]  # the simulated cap fits two rows and not three
    assert [r["batch"] for r in dynamic["runs"]] == [2, 3] and dynamic["largest_batch"] == 2 and dynamic["exact"]
    assert dynamic["tokens_per_s"] > 0 and dynamic["prompt"] == 96
    assert capacity["ropekv_static"]["prompt"] == 64  # the bounded cache's shorter prompt, recorded
    markdown = (tmp_path / "compiled_decode.md").read_text()
    assert "speed-up vs StaticCache compiled" in markdown and "## Capacity" in markdown


def test_host_overhead_dry_run_counts_ops_and_times_both_caches(tmp_path: Path) -> None:
    run_script("host_overhead.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "host_overhead.json").read_text())
    rows = {row["cache"]: row for row in result["rows"]}
    assert sorted(rows) == ["DynamicCache", "RopeKVCache"]
    for row in rows.values():
        assert row["steps_counted"] > 0 and row["host_us_per_step"] > 0 and row["cpu_us_per_step"] > 0
        assert row["nonzero_per_step"] == 0 and row["host_tensors_per_step"] == 0
    dynamic, rope = rows["DynamicCache"], rows["RopeKVCache"]
    # The cache adds no host synchronisation (on transformers 5.17 it has one fewer: a decoding step with nothing to
    # hide hands the model no mask, whose all() transformers would check).
    assert rope["syncs_per_step"] <= dynamic["syncs_per_step"]
    # Steady state: a handful of ops per step plus one per layer (the captured query's view), not ~8.5 per layer.
    assert rope["ops_per_step"] - dynamic["ops_per_step"] <= result["shape"]["layers"] + 16
    assert rope["kept"] <= result["settings"]["budget"] + result["settings"]["compress_every"]
    # Paired figures: one ratio per round, each this round's RopeKVCache figure over its DynamicCache figure.
    repeats = result["settings"]["repeats"]
    assert rope["paired_plain"] == [r / d for r, d in zip(rope["medians_us"], dynamic["medians_us"])]
    assert len(rope["paired_all_steps"]) == repeats and all(x > 0 for x in rope["paired_all_steps"])
    assert dynamic["paired_plain"] == [1.0] * repeats
    markdown = (tmp_path / "host_overhead.md").read_text()
    assert "| RopeKVCache |" in markdown and "Paired, RopeKVCache / DynamicCache" in markdown


def test_lockstep_dry_run_pairs_every_step_of_the_caches(tmp_path: Path) -> None:
    run_script("lockstep_decode.py", "--out", str(tmp_path), "--pin-core", "-1", "--profile", "2", "--cprofile", "3")
    result = json.loads((tmp_path / "lockstep_decode.json").read_text())
    rows = {row["cache"]: row for row in result["rows"]}
    assert sorted(rows) == ["DynamicCache", "RopeKVCache", "RopeKVCache+recency"]
    steps = result["settings"]["steps"]
    for row in rows.values():
        assert row["steps"] == steps and row["plain_steps"] + row["compaction_steps"] == row["steps"]
        assert row["p50_us"] > 0 and row["step_ratio"] > 0
    assert rows["DynamicCache"]["step_ratio"] == 1.0 and rows["DynamicCache"]["compaction_steps"] == 0
    assert rows["RopeKVCache"]["compaction_steps"] > 0
    assert set(result["profiles"][str(result["settings"]["contexts"][0])]) == set(rows)
    text = (tmp_path / "lockstep_decode.md").read_text()
    assert "threads on one core" in text and "Python functions per decode step" in text
    python = result["python_profiles"][str(result["settings"]["contexts"][0])]
    assert any("paged.py" in name for name in python["RopeKVCache"])  # the cache's own functions were profiled
    assert not any("paged.py" in name for name in python["DynamicCache"])  # and only in its own thread
    for row in rows.values():
        assert row["gc_ms"] >= 0 and row["mean_all_minus_gc_us"] <= row["mean_all_us"]
        assert row["gc_full_collections"] >= 0
    steps_run = result["steps_us"][f"{result['settings']['contexts'][0]}/0"]
    assert all(len(v["wall"]) == steps and len(v["gc"]) == steps for v in steps_run.values())


def test_gc_pauses_are_counted_in_the_thread_that_collects() -> None:
    import gc
    import threading

    sys.path.insert(0, str(BENCH))
    from lockstep_decode import GcPauses

    seen: dict[str, tuple[float, int]] = {}
    with GcPauses() as pauses:
        def other() -> None:
            gc.collect()
            seen["other"] = pauses.take()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        seen["main"] = pauses.take()
    assert seen["other"][0] > 0 and seen["main"] == (0.0, 0)
    assert seen["other"][1] == 1  # gc.collect() is one full collection
    assert pauses.take() == (0.0, 0)  # taken: nothing is left over


def test_turnstile_runs_one_thread_at_a_time_round_robin() -> None:
    import threading

    sys.path.insert(0, str(BENCH))
    from lockstep_decode import Turnstile

    turnstile, order = Turnstile(3), []

    def run(i: int, turns: int) -> None:
        for _ in range(turns):
            turnstile.wait(i)
            order.append(i)
            turnstile.pass_on(i)
        turnstile.wait(i)
        turnstile.leave(i)

    threads = [threading.Thread(target=run, args=(i, turns)) for i, turns in enumerate((3, 1, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert order == [0, 1, 2, 0, 2, 0]  # thread 1 leaves after one turn, thread 2 after two
