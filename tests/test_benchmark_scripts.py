"""The four benchmark entry points still run: their ``--dry-run`` paths on the CPU, tiny shapes, a subprocess each.

They are run on the H200 only a few times a session, so a broken import or a renamed cache attribute would
otherwise surface there, costing device time. The checks read what the scripts wrote, not just their exit code.
"""

from __future__ import annotations

import json
import math
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


def assert_run_readme(folder: Path, script: str) -> None:
    """Every run folder names its commit, device and the command that made it."""
    text = (folder / "README.md").read_text()
    assert "- commit: `" in text and "- device: CPU" in text
    assert f"- command: `python benchmarks/{script} --dry-run" in text


def test_memory_dry_run_holds_the_budget_where_dynamic_cache_grows(tmp_path: Path) -> None:
    run_script("memory.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "memory.json").read_text())
    assert not result["errors"], result["errors"]
    settings, rows = result["settings"], result["rows"]
    bound = {b: b + settings["compress_every"] for b in settings["budgets"]}
    by_cache: dict[str, list[dict]] = {}
    for row in rows:
        by_cache.setdefault(row["cache"], []).append(row)
        assert row["tokens"] in settings["mem_points"] or row["tokens"] > settings["mem_points"][-1] - 8
    dynamic = by_cache.pop("DynamicCache")
    # DynamicCache holds every token: its bytes are the tokens seen times the bytes per token, independently.
    for row in dynamic:
        assert row["kept"] == row["tokens"] and row["cache_bytes"] == row["tokens"] * settings["kv_bytes_per_token"]
    last_full = dynamic[-1]["cache_bytes"]
    for budget in settings["budgets"]:
        last = by_cache[f"RopeKVCache(budget={budget})"][-1]
        assert last["kept"] <= bound[budget] < last["tokens"] and last["compactions"] >= 1
        assert last["cache_bytes"] < last_full
    assert result["reclamation"]["max_cache_bytes"] <= result["reclamation"]["limit_bytes"]
    assert "| RopeKVCache(budget=64) |" in (tmp_path / "memory.md").read_text()
    assert_run_readme(tmp_path, "memory.py")


def test_perplexity_dry_run_teacher_forced_and_decode_proxy(tmp_path: Path) -> None:
    run_script("perplexity.py", "--out", str(tmp_path))
    data = json.loads((tmp_path / "quality_tiny.json").read_text())
    (sample,) = data["samples"]
    runs = sample["runs"]
    assert {f"{p}@48" for p in data["config"]["policies"]} | {"full"} <= set(runs)
    for name, run in runs.items():
        assert run["count"] > 0 and math.isfinite(run["nll"])
        if not name.startswith("full"):
            assert run["compactions"] >= 1 and run["kl"] > 0  # evicted, so it differs from the full cache
    proxy = data["decode_proxy"]
    assert set(proxy["runs"]) == {"full"} | set(data["config"]["policies"])
    assert proxy["runs"]["full"]["compactions"] == 0
    assert proxy["runs"]["full"]["kept"] == proxy["prompt_tokens"] + proxy["tokens"] - 1
    for policy in data["config"]["policies"]:
        run = proxy["runs"][policy]
        assert run["compactions"] >= 1 and run["kept"] <= proxy["budget"] + proxy["compress_every"]
        assert run["tokens"] == proxy["tokens"] and run["ppl"] > 1
    assert "## Decode-conditions proxy" in (tmp_path / "quality_tiny.md").read_text()
    assert_run_readme(tmp_path, "perplexity.py")


def test_task_accuracy_dry_run_reports_the_report_split(tmp_path: Path) -> None:
    run_script("task_accuracy.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["policy"] for r in result["summary"]] == ["full", "rope-calibrated-per-layer:window=2",
                                                        "recency:window=auto"]
    for row in result["rows"]:
        assert sorted(int(i) for i in row["outcomes"]) == [300, 301, 302]  # the report split, made-up problems
    full, calibrated, recency = result["summary"]
    assert calibrated["mean_kept"] < calibrated["mean_seen"] == full["mean_seen"]
    assert calibrated["mean_generated_kept"] < full["mean_generated_kept"]
    assert (tmp_path / "calibration_stats.safetensors").is_file()
    assert_run_readme(tmp_path, "task_accuracy.py")


def test_task_accuracy_dry_run_program_aided_with_chain_of_thought_warm_up(tmp_path: Path) -> None:
    run_script("task_accuracy.py", "--domain", "pot", "--warm", "--warm-domain", "cot", "--out", str(tmp_path))
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["settings"]["domain"] == "pot" and result["warm"]["domain"] == "cot"
    assert [r["policy"] for r in result["summary"]][-1] == "default:window=2+warm(cot)"
    for summary in result["summary"]:  # a random tiny model writes no program that runs
        assert summary["n"] == 3 and summary["program_errors"]["total"] == 3
    assert "program-aided" in (tmp_path / "README.md").read_text()


def test_speed_dry_run_alternates_variants_and_finds_capacity(tmp_path: Path) -> None:
    run_script("speed.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "speed.json").read_text())
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
    markdown = (tmp_path / "speed.md").read_text()
    assert "speed-up vs StaticCache compiled" in markdown and "## Capacity" in markdown
    assert_run_readme(tmp_path, "speed.py")


def test_speed_variants_other_than_the_static_cache_run_on_stock_sdpa() -> None:
    """A static RopeKVCache switches the model to hf_ropekv's grouped sdpa; the other variants must switch it back.

    ``_stock_sdpa`` once looked the name up at ``hf_ropekv.attention.GROUPED_SDPA`` after the module had moved
    to ``hf_ropekv.model.attention``: the lookup gave ``None``, nothing was switched back, and DynamicCache and
    StaticCache were measured on the grouped sdpa (the dry run passes either way: both compute the same).
    """
    from types import SimpleNamespace

    import hf_ropekv
    from conftest import tiny_model
    from hf_ropekv.model.attention import GROUPED_SDPA

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import speed

    model = tiny_model("qwen3")
    bench = SimpleNamespace(model=model, args=SimpleNamespace(budget=16, compress_every=4, new_tokens=4))
    hf_ropekv.RopeKVCache(model, budget=16, compress_every=4, static=True)
    grouped = model.config._attn_implementation
    assert grouped == GROUPED_SDPA != "sdpa"
    for key in ("dynamic", "static", "ropekv"):
        speed.VARIANTS[key].make(bench, 8)
        assert model.config._attn_implementation == "sdpa", key
        speed.VARIANTS["ropekv_static"].make(bench, 8)
        assert model.config._attn_implementation == grouped


@pytest.mark.slow  # about 2.5 minutes on 2 CPU cores: the warm-up part compiles with inductor three times
def test_warmup_dry_run_runs_every_part_in_fresh_processes(tmp_path: Path) -> None:
    run_script("warmup.py", "--out", str(tmp_path), timeout=900)
    result = json.loads((tmp_path / "results.json").read_text())
    assert sorted(result["parts"]) == ["e2e", "overhead", "profile", "warmup"] and not result["skipped"]
    warm = result["parts"]["warmup"]
    for key in ("cold", "warm", "load"):
        assert "error" not in warm[key], warm[key].get("error")
    counts = {key: warm[key]["runs"][0]["counters"] for key in ("cold", "warm", "load")}
    assert counts["cold"]["inductor.fxgraph_cache_miss"] >= 1 and counts["cold"]["inductor.fxgraph_cache_hit"] == 0
    for key in ("warm", "load"):  # (b) reuses (a)'s folders; (c) starts empty but loads (a)'s artifacts
        assert counts[key]["inductor.fxgraph_cache_hit"] >= 1 and counts[key]["inductor.fxgraph_cache_miss"] == 0
    assert warm["load"]["loaded"]["artifacts"]["inductor"] >= 1 and warm["cold"]["saved"]["model"]["budget"] == 32
    phases = {key: warm[key]["runs"][0]["compile_phases_s"] for key in ("cold", "warm")}
    assert phases["cold"]["inductor_compile"] > 0 and "inductor_compile" not in phases["warm"]  # (b): a cache hit
    assert phases["warm"]["entire_frame_compile"] > 0  # dynamo still traces the frame
    for entry in result["parts"]["profile"]["contexts"]:
        for key, row in entry["variants"].items():
            assert "error" not in row, (key, row.get("error"))
            timed = row["timed"][0]
            assert timed["p50_ms"] > 0 and row["profiled"]["profiled_steps"] == 6
            split = timed["median"]
            assert 0 <= split["cache_share"] < 1 and split["forward_call_ms"] > 0
        rope = entry["variants"]["ropekv_static"]["timed"][0]
        assert rope["compaction_steps"] >= 1 and rope["median"]["cache_ms"] > 0 and rope["kept"] <= 40
    overhead = result["parts"]["overhead"]
    summary = overhead["summary"]
    assert set(summary) == {"file", "off", "on", "frozen"} and summary["file"]["vs_file_pct"] == 0
    runs = overhead["runs"]
    assert all(r["prior_tokens"] == 0 for r in runs if r["variant"] in ("off", "file"))
    assert all(r["prior_frozen"] for r in runs if r["variant"] == "frozen")
    assert {r["round"] for r in runs} == {0, 1}  # --dry-run: 1 round before the freeze, 1 after
    for name, row in summary.items():
        assert len(row["paired_vs_file_rounds"]) == (2 if name in ("file", "off") else 1), (name, row)
        assert row["cache_host_ms"] > 0 and overhead["profiled"][name]["profiled_steps"] == 6
    e2e = result["parts"]["e2e"]["variants"]
    assert sorted(e2e) == ["dynamic", "ropekv_default", "ropekv_static"]
    for row in e2e.values():
        assert "error" not in row and row["new_tokens"] == 40 and row["total_s"] > 0
    assert e2e["ropekv_static"]["static"] is True and e2e["ropekv_static"]["is_compileable"]
    markdown = (tmp_path / "results.md").read_text()
    assert "## Warm-up" in markdown and "## End to end" in markdown and "- command: `python benchmarks/warmup.py" in markdown
    assert_run_readme(tmp_path, "warmup.py")


def test_overhead_pairs_each_run_with_the_reference_runs_of_its_round() -> None:
    """The host drifts within a run: the paired ratios see a variant's cost, unpaired medians see the drift; the
    decomposed cost is the kernel and cache host time over the statistics file's, in % of its step."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import warmup

    def run(variant: str, round_: int, p50: float) -> dict:
        return dict(variant=variant, round=round_, p50_ms=p50, steps_ms=[p50] * 3)

    # The host slows by 20 % from round 0 to round 1 and stays there; online statistics cost 0.5 % over the file,
    # learning 1 % more, frozen nothing more than online.
    runs = [run("file", 0, 10.0), run("off", 0, 10.05), run("on", 0, 10.15),
            run("on", 1, 12.18), run("file", 1, 12.0), run("off", 1, 12.06),
            run("frozen", 2, 12.06), run("file", 2, 12.0), run("off", 2, 12.06)]
    profiled = {name: dict(kernel_ms_per_step=k, kernels_per_step=100) for name, k in
                (("file", 8.0), ("off", 8.02), ("on", 8.05), ("frozen", 8.02))}
    host = {name: dict(median=dict(cache_ms=c)) for name, c in
            (("file", 0.2), ("off", 0.21), ("on", 0.3), ("frozen", 0.21))}
    summary = warmup.overhead_summary(runs, profiled, host)
    on = summary["on"]
    assert [round(x, 6) for x in on["paired_vs_file_rounds"]] == [1.5, 1.5]
    assert abs(on["paired_vs_file_pct"] - 1.5) < 1e-9 and abs(on["paired_vs_off_pct"] - 100 * (10.15 / 10.05 - 1)) < 1e-9
    assert abs(summary["frozen"]["paired_vs_off_pct"]) < 1e-9 and abs(summary["off"]["paired_vs_file_pct"] - 0.5) < 1e-9
    assert abs(on["vs_file_pct"] - 1.5) > 5  # unpaired medians mix the two host speeds: the drift
    # (8.05 - 8.0 + 0.3 - 0.2) / median file step 12.0
    assert abs(on["decomposed_vs_file_pct"] - 100 * 0.15 / 12.0) < 1e-9
    assert summary["file"]["decomposed_vs_file_pct"] == 0
    assert warmup.overhead_summary(runs)["on"]["decomposed_vs_file_pct"] is None  # nothing profiled: no guess


def test_host_timers_split_a_static_cache_step_and_leave_nothing_behind() -> None:
    """``instrument.py`` in-process on a tiny model: the cache's host work is found inside generate's calls, and
    restoring the timers leaves the model and cache as they were."""
    import torch
    from transformers import CompileConfig

    import hf_ropekv
    from conftest import cache_kw, tiny_model

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import instrument

    model = tiny_model("qwen3")
    cache = hf_ropekv.RopeKVCache(model, budget=16, compress_every=4, static=True, protect_prompt=False)
    wrapped = ("prepare_inputs_for_generation", "get_compiled_call")
    before = {name: vars(model).get(name) for name in wrapped}  # hf_ropekv's own wrappers, set by the cache
    timers = instrument.HostTimers()
    instrument.instrument_cache(timers, cache, eager_update=False)
    instrument.instrument_generate(timers, model, compiled=True)
    clock = instrument.TimedClock(timers)
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    from transformers import LogitsProcessorList

    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                   logits_processor=LogitsProcessorList([clock]), compile_config=config, **cache_kw(model, cache))
    timers.restore()
    assert {name: vars(model).get(name) for name in wrapped} == before
    assert "_forward_starts" not in vars(cache) and "compact" not in vars(cache.coordinator.compactor)
    assert not {"_pre_forward", "_post_forward", "_forward_ends"} & set(vars(cache._attachment))
    steps = clock.steps()
    assert len(steps) == 11 and timers.calls["cache.compact"] >= 1 and timers.calls["generate.forward_call"] >= 11
    for step in steps:
        split = instrument.host_split(step)
        assert split["cache_ms"] > 0 and split["forward_call_ms"] > 0
        assert split["cache_ms"] + split["transformers_prepare_ms"] + split["forward_call_ms"] <= split["wall_ms"]
        assert abs(sum(split[k] for k in ("cache_ms", "transformers_prepare_ms", "forward_call_ms",
                                          "generate_loop_ms")) - split["wall_ms"]) < 1e-6


def test_warmup_starts_no_part_that_would_not_fit_in_max_minutes(tmp_path: Path) -> None:
    run_script("warmup.py", "--out", str(tmp_path), "--parts", "profile,e2e", "--max-minutes", "0.1")
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["parts"] == {} and [s.split(" ")[0] for s in result["skipped"]] == ["profile", "e2e"]
    assert "Not run: profile" in (tmp_path / "results.md").read_text()
    assert_run_readme(tmp_path, "warmup.py")


def test_warmup_baseline_compiles_transformers_static_cache(tmp_path: Path) -> None:
    """--warmup-cache static: the cold process compiles transformers' StaticCache (the model's own compile, the
    baseline of the cache's warm-up); it saves no artifacts, so a load process is refused."""
    run_script("warmup.py", "--out", str(tmp_path), "--parts", "warmup", "--warmup-modes", "cold",
               "--warmup-cache", "static", timeout=600)
    result = json.loads((tmp_path / "results.json").read_text())
    cold = result["parts"]["warmup"]["cold"]
    assert "error" not in cold and "saved" not in cold and result["settings"]["warmup_cache"] == "static"
    assert cold["runs"][0]["counters"]["inductor.fxgraph_cache_miss"] >= 1  # it compiled
    assert cold["runs"][1]["counters"]["inductor.fxgraph_cache_miss"] == 0  # once
    assert cold["compile_s"] > 0 and "warm" not in result["parts"]["warmup"]
    assert "with transformers' StaticCache (the baseline)" in (tmp_path / "results.md").read_text()
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import warmup

    with pytest.raises(SystemExit):
        warmup.parse_args(["--warmup-cache", "static", "--warmup-modes", "cold,load"])


def test_trace_cost_runs_and_reports(tmp_path: Path) -> None:
    """benchmarks/trace_cost.py on two layers: every variant asked for traces one graph; the report is written."""
    out = tmp_path / "trace"
    run_script("trace_cost.py", "--out", str(out), "--variants", "static_cache,ropekv_recency,ropekv_dynamic_batch",
               "--batch", "2", "--commit", "test")
    result = json.loads((out / "results.json").read_text())
    assert set(result["rows"]) == {"static_cache", "ropekv_recency", "ropekv_dynamic_batch"}
    assert result["meta"]["batch"] == 2
    for row in result["rows"].values():
        assert row["runs"][0]["graphs"] == 1 and row["runs"][0]["first_s"] > row["runs"][0]["again_s"] > 0
    assert "| ropekv_recency |" in (out / "results.md").read_text()


def test_warmup_bytecode_cache_compiles_first_and_hands_the_folder_to_its_processes(tmp_path: Path, monkeypatch) -> None:
    """--bytecode-cache: site-packages' bytecode is compiled into the folder before any timed process, and the
    processes get it (PYTHONPYCACHEPREFIX) with bytecode writing back on; without it the environment's is recorded."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import sysconfig

    import warmup

    site = tmp_path / "site"
    site.mkdir()
    (site / "some_module.py").write_text("VALUE = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"purelib": str(site)})
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/nowhere")  # restored after the test
    messages: list[str] = []
    args = warmup.parse_args(["--dry-run", "--bytecode-cache", str(tmp_path / "pyc")])
    bytecode = warmup.prepare_bytecode(args, messages.append)
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pyc") and "PYTHONDONTWRITEBYTECODE" not in os.environ
    assert str(site) in bytecode["roots"] and bytecode["compile_s"] > 0 and messages
    compiled = list((tmp_path / "pyc").rglob("some_module.*.pyc"))
    assert len(compiled) == 1 and site.name in compiled[0].parts  # the prefix mirrors the source's path
    assert "compiled into" in warmup.bytecode_line(bytecode)

    environment = warmup.prepare_bytecode(warmup.parse_args(["--dry-run"]), messages.append)
    assert environment["mode"] == "environment's" and "compile_s" not in environment
    assert "none cached" in warmup.bytecode_line(dict(environment, written=False))


def test_prefill_profile_dry_run_times_every_cache_and_profiles_the_first_call(tmp_path: Path) -> None:
    """benchmarks/prefill_profile.py on a tiny model: every variant timed in every round, the first RopeKVCache
    call under cProfile, a later one under torch.profiler."""
    run_script("prefill_profile.py", "--out", str(tmp_path), "--rounds", "2", "--tag", "t", "--commit", "test")
    result = json.loads((tmp_path / "t.json").read_text())
    assert [(r["round"], r["variant"]) for r in result["runs"]] == [
        (round_, variant) for round_ in range(2) for variant in ("dynamic", "ropekv", "ropekv_eager")]
    for run in result["runs"]:
        assert run["generate_ms"] >= run["logits_synced_ms"] >= run["logits_unsynced_ms"] > 0
    assert "function calls" in (tmp_path / "t_cprofile_cumulative.txt").read_text()
    assert "aten::" in (tmp_path / "t_torch_profile.txt").read_text()
    assert result["traced"]["variant"] == "ropekv"


def test_warmup_profiles_the_graphed_step(tmp_path: Path) -> None:
    """--profile-variants ropekv_graphed: the cache with cuda_graphs=True is timed and split like the compiled one
    (on the CPU its steps run eagerly: the executor declines, with a warning, and the script goes on)."""
    run_script("warmup.py", "--out", str(tmp_path), "--parts", "profile", "--profile-variants", "ropekv_graphed")
    entries = json.loads((tmp_path / "results.json").read_text())["parts"]["profile"]["contexts"]
    for entry in entries:
        row = entry["variants"]["ropekv_graphed"]
        assert "error" not in row and row["timed"][0]["p50_ms"] > 0 and row["timed"][0]["compaction_steps"] >= 1
    assert "eager step as a CUDA graph" in (tmp_path / "results.md").read_text()


def test_warmup_e2e_rounds_alternate_the_order_and_give_each_round_its_ratio(tmp_path: Path) -> None:
    """--e2e-rounds 2: each variant runs once per round in a process of its own, the second round in reverse
    order (A B, B A), and each round's ratio divides that round's own DynamicCache total."""
    run_script("warmup.py", "--out", str(tmp_path), "--parts", "e2e", "--e2e-variants", "ropekv_default,dynamic",
               "--e2e-rounds", "2", "--e2e-cold")
    part = json.loads((tmp_path / "results.json").read_text())["parts"]["e2e"]
    assert part["cold"]["variant"] == "ropekv_default" and part["cold"]["new_tokens"] > 0  # --e2e-cold: first
    assert [list(r) for r in part["rounds"]] == [["ropekv_default", "dynamic"], ["dynamic", "ropekv_default"]]
    for variants, ratios in zip(part["rounds"], part["round_ratios"]):
        assert ratios["ropekv_default"] == variants["dynamic"]["total_s"] / variants["ropekv_default"]["total_s"]
    assert part["variants"] == part["rounds"][0] and part["vs_dynamic_total"] == part["round_ratios"][0]
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["e2e_dynamic_r0.log", "e2e_dynamic_r1.log", "e2e_ropekv_default_cold.log",
                    "e2e_ropekv_default_r0.log", "e2e_ropekv_default_r1.log", "e2e_warm.log"]
    markdown = (tmp_path / "results.md").read_text()
    assert "round by round" in markdown and markdown.count("| 1 | ") == 2
    assert markdown.count("| cold (empty caches) | ") == 1 and markdown.count("| 0 | ") == 2


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_graphed_step_probe_sees_one_input_signature_for_every_decode_step(arch: str) -> None:
    """``graphed_step_probe.py`` replays one CUDA graph per input signature and cache. That is sound only while a
    static cache's decode steps all come with the same signature (shapes, strides, the mask's structure, every
    non-tensor value), also across compactions and with sliding-window layers: otherwise it would record a graph
    every step (the probe's first H200 run did, until the per-layer-type mask dict was flattened). Checked here
    on the CPU through the same chain as on the GPU (the cache's ``get_compiled_call`` wrapper, then the probe's)."""
    import torch
    from transformers import CompileConfig

    import hf_ropekv
    from conftest import cache_kw, tiny_model

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import graphed_step_probe as probe

    model = tiny_model(arch, attn_implementation="eager" if arch == "gemma2" else None)
    seen: list[tuple] = []

    def step(*args, **kwargs):  # stands in for GraphedForward: records the signature, runs the step eagerly
        seen.append((probe.signature(args, kwargs), len(probe.tensors(args, kwargs))))
        static_args, static_kwargs = probe.clone_inputs(args, kwargs)
        assert [t.data_ptr() for t in probe.tensors(static_args, static_kwargs)] != [
            t.data_ptr() for t in probe.tensors(args, kwargs)]
        return model(*args, **kwargs)

    model.get_compiled_call = lambda *a, **k: step  # set before the cache: its wrapper chains to it
    cache = hf_ropekv.RopeKVCache(model, budget=16, compress_every=4, static=True, protect_prompt=False)
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                   compile_config=config, **cache_kw(model, cache))
    assert len(seen) == 11 and cache.num_compactions >= 2
    assert len({signature for signature, _ in seen}) == 1, "a decode step changed its input signature"
    assert seen[0][1] >= 3  # ids, positions and the slot mask are tensors the graph copies in
