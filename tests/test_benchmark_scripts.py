"""The benchmark entry points: one dry run each (a tiny random model on the CPU, in this process), and unit tests
of the logic that is easy to get wrong: answer extraction, the Wilson interval, the GSM8K split rule, retrieval
haystacks and scoring, program running, carrying a model in pieces, and the report's generated blocks.

The dry runs check what each script wrote (the result file's keys), never timings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import gsm8k  # noqa: E402
import program_runner  # noqa: E402
import report  # noqa: E402
import retrieval  # noqa: E402
import ship_model  # noqa: E402

RUN_KEYS = {"name", "date", "device", "commit", "command", "versions"}
ROW_KEYS = {"task", "model", "policy", "param", "setting", "score", "n", "extra"}


# ---------------------------------------------------------------------------------------------- dry runs
def test_speed_counts_the_decode_kernels_as_attention() -> None:
    """The profile's kernel classes: the library's Triton decode kernels are attention (they were 'other')."""
    import speed
    from hf_ropekv.kernels import attention

    for kernel in (attention._attention_split_kernel, attention._attention_combine_kernel):
        assert speed.kernel_class(kernel.fn.__name__) == "attention"
    assert speed.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert speed.kernel_class("triton_poi_fused_add_0") == "other"


def test_quality_dry_run_writes_every_task(tmp_path: Path) -> None:
    import quality

    out = tmp_path / "q.json"
    code = quality.main(["--dry-run", "--out", str(out), "--policies", "full,default,sink_recent",
                         "--tasks", "gsm8k_cot,gsm8k_pot,doc_ppl,retrieval", "--commit", "abc1234"])
    assert code == 0
    result = json.loads(out.read_text())
    assert RUN_KEYS <= result.keys() and result["commit"] == "abc1234"
    assert result["command"].startswith("python benchmarks/quality.py --dry-run")
    rows = result["rows"]
    assert all(ROW_KEYS <= r.keys() for r in rows)
    assert {r["task"] for r in rows} == {"gsm8k_cot", "gsm8k_pot", "doc_ppl", "retrieval"}
    assert {r["setting"] for r in rows if r["task"] == "retrieval"} == {"seen", "unseen"}
    default = next(r for r in rows if r["task"] == "gsm8k_cot" and r["policy"] == "default")
    assert default["vs_full"] is not None or default["score"] == 0
    assert {"lost", "gained"} <= default.keys() and len(default["extra"]["bits"]) == default["n"]
    assert (tmp_path / "raw" / "q.jsonl").is_file()  # per-problem outputs beside, not in the result


def test_quality_records_a_failed_cell_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import policies
    import quality

    make = policies.make_cache

    def failing(model, budget, policy="default", **options):
        if policy == "recency":
            raise RuntimeError("boom")
        return make(model, budget, policy, **options)

    monkeypatch.setattr(policies, "make_cache", failing)
    out = tmp_path / "q.json"
    assert quality.main(["--dry-run", "--out", str(out), "--tasks", "doc_ppl",
                         "--policies", "full,recency,default"]) == 1
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["rows"]] == ["full", "default"]
    assert len(result["errors"]) == 1 and "boom" in result["errors"][0]


def test_speed_dry_run_pairs_the_three_caches(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import speed

    out = tmp_path / "s.json"
    assert speed.main(["--dry-run", "--out", str(out), "--points", "1x48", "--repeats", "1"]) == 0
    result = json.loads(out.read_text())
    assert RUN_KEYS <= result.keys()
    assert [r["cache"] for r in result["rows"]] == ["dynamic", "static", "ropekv"]
    for row in result["rows"]:
        assert row["error"] is None and {"decode_p50_ms", "decode_p90_ms", "prefill_ms", "host_ms"} <= row.keys()
    speed.main(["--dry-run", "--child", "ropekv"])  # the end-to-end child, without a fresh process
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("E2E "))
    assert {"ttft_s", "total_s", "new_tokens"} <= json.loads(line[4:]).keys()


def test_memory_dry_run_bounds_the_budgeted_cache(tmp_path: Path) -> None:
    import memory

    out = tmp_path / "m.json"
    assert memory.main(["--dry-run", "--out", str(out), "--caches", "dynamic,ropekv"]) == 0
    result = json.loads(out.read_text())
    assert RUN_KEYS <= result.keys() and not result["notes"], result["notes"]
    rows = {(r["kind"], r["tokens"]): r for r in result["rows"]}
    last = max(t for _, t in rows)
    assert rows[("ropekv", last)]["kept"] <= result["settings"]["budget"] + 128
    assert rows[("ropekv", last)]["cache_bytes"] < rows[("dynamic", last)]["cache_bytes"]


def test_kv_precision_dry_run_measures_every_storage_against_unquantized(tmp_path: Path) -> None:
    import kv_precision

    out = tmp_path / "p.json"
    assert kv_precision.main(["--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["storage"]: r for r in result["rows"]}
    assert RUN_KEYS <= result.keys() and list(rows) == list(kv_precision.STORAGES)
    assert rows["unquantized"]["perplexity_vs_unquantized"] == 1.0
    assert len({r["mean_nll"] for r in result["rows"]}) > 1  # the quantizers did touch the keys and values


# ---------------------------------------------------------------------------------------------- GSM8K
@pytest.mark.parametrize("text, expected", [
    ("so 3 + 4 = 7.\nThe answer is 7", "7"),
    ("The answer is: **$1,234.50**", "1234.5"),
    ("\\boxed{18} and later 20 apples", "18"),
    ("first 12 then 15", "15"),
    ("The answer is 3, 4 remain", "3"),
    ("no number here", None),
])
def test_extract_answer(text: str, expected: str | None) -> None:
    assert gsm8k.extract_answer(text) == expected


def test_wilson_interval_matches_hand_values() -> None:
    lo, hi = gsm8k.wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert gsm8k.wilson_interval(0, 0) == (0.0, 1.0)
    assert gsm8k.wilson_interval(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        gsm8k.wilson_interval(11, 10)


def test_split_rule_refuses_held_out_problems_without_the_flag() -> None:
    assert gsm8k.problem_range("report") == range(300, 600)
    assert gsm8k.problem_range("tune", "10-19") == range(10, 20)
    for split, problems in (("report", "590-610"), ("held-out", None), ("tune", "600")):
        with pytest.raises(ValueError, match="held-out|held out"):
            gsm8k.problem_range(split, problems)
    assert gsm8k.problem_range("held-out", None, held_out=True).start == 600


# ---------------------------------------------------------------------------------------------- retrieval
def test_haystacks_are_deterministic_sized_and_hold_their_key() -> None:
    tokenizer = common.CharTokenizer()
    pool = retrieval.pool_token_ids(tokenizer)
    a, b = (retrieval.build(tokenizer, pool, 1003, 1024) for _ in range(2))
    assert a.ids == b.ids and a.key == b.key and a.needles == 4 and len(a.head) == 1024 - 32
    key_ids = tokenizer(a.key)["input_ids"]  # one id per character: the key's ids lie inside the document
    assert any(a.head[i:i + len(key_ids)] == key_ids for i in range(len(a.head)))
    assert retrieval.build(tokenizer, pool, 1004, 1024).key != a.key
    assert retrieval.found("The code is 4718265.", "4718265")
    assert not retrieval.found("The code is 47182651.", "4718265")
    assert not retrieval.found("lanterns", "lantern") and retrieval.found("lantern", "lantern")


@pytest.mark.parametrize("setting", ["seen", "unseen"])
def test_the_retrieval_harness_compresses_the_document_before_an_unseen_question(
        setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Question unseen: the first compaction holds the document only and comes with the question's forward (more
    input, so the default takes its plain vote); question seen: with the first decoding step, after the question."""
    import policies
    from conftest import tiny_model
    from hf_ropekv.eviction.compactor import Compactor

    tokenizer = common.CharTokenizer()
    haystack = retrieval.build(tokenizer, retrieval.pool_token_ids(tokenizer), 1002, 512)
    model = tiny_model("llama")
    assert max(haystack.ids) < model.config.vocab_size  # the character ids fit the tiny model
    plans = []
    compact = Compactor.compact

    def recording(self, layers, plan, *args, **kwargs):
        plans.append(plan)
        return compact(self, layers, plan, *args, **kwargs)

    monkeypatch.setattr(Compactor, "compact", recording)
    cache = policies.make_cache(model, 64, "default", protect_prompt=False)
    retrieval.answer(model, [haystack], cache, setting, max_new_tokens=2, stop_ids=[])
    first = plans[0]
    if setting == "unseen":
        assert (first.seen, first.new) == (len(haystack.head), len(haystack.tail))
    else:
        assert (first.seen, first.new) == (len(haystack.ids), 1)


def test_the_plain_vote_ablation_differs_from_the_default_only_when_a_decoding_step_compacts() -> None:
    """``plain_vote`` (``vote_candidates.py``) is the default with the plain prompt vote always: where more input
    follows a prompt it must keep the very slots the default keeps (else a screen compares against something else),
    and where a decoding step compacts it must keep others."""
    import policies
    from conftest import cache_kw, tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(7))

    def kept(policy: str, split: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        cache = policies.make_cache(model, 64, policy, protect_prompt=False)
        with torch.no_grad():
            model(input_ids=ids[:, :split], use_cache=True, **cache_kw(model, cache))
            logits = model(input_ids=ids[:, split:], use_cache=True, **cache_kw(model, cache)).logits
        assert cache.num_compactions == 1
        return [cache.kept_positions(i) for i in range(model.config.num_hidden_layers)], logits

    more_input, plain = kept("default", 250), kept("plain_vote", 250)  # 50 tokens follow: more input
    assert all(torch.equal(a, b) for a, b in zip(more_input[0], plain[0])) and torch.equal(more_input[1], plain[1])
    answered, plain = kept("default", 299), kept("plain_vote", 299)  # one token follows: a decoding step
    assert not all(torch.equal(a, b) for a, b in zip(answered[0], plain[0]))


def test_gsm8k_cells_never_rank_by_the_prompt_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GSM8K cell (prompt pinned, budget = longest prompt + G, a left-padded batch through ``generate``) compacts
    only while decoding, where the prompt window is stale: neither its vote nor key novelty ever ranks there, so a
    change to the ranking right after a prompt (the retrieval and chunked-document cells) leaves GSM8K's slots as
    they were."""
    import policies
    import quality
    from conftest import tiny_model

    from hf_ropekv.scorers import frequency

    def refuse(*args, **kwargs):
        raise AssertionError("a GSM8K cell ranked keys right after its prompt")

    monkeypatch.setattr(frequency, "key_novelty", refuse)
    monkeypatch.setattr(frequency.FrequencyScorer, "_prompt_vote", refuse)
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in (40, 52, 61)]
    cache = policies.make_cache(model, max(map(len, prompts)) + 24, "default", compress_every=16)
    rows, _ = quality.generate_batch(model, prompts, cache, max_new_tokens=60, stop_ids=[], pad_id=0)
    assert cache.num_compactions >= 2 and all(len(r) == 60 for r in rows)


# ---------------------------------------------------------------------------------------------- programs
def test_program_runner_reads_the_last_number_and_reports_failures() -> None:
    reply = "Here:\n```python\nx = 0.1 * 3\nprint('total', x)\n```"
    result = program_runner.run_program(program_runner.extract_program(reply), timeout=5)
    assert result.ok and result.answer == "0.3"
    assert program_runner.run_program("raise SystemExit(2)", timeout=5).status == program_runner.ERROR
    assert program_runner.run_program("print('none')", timeout=5).status == program_runner.NO_NUMBER


def test_ship_model_round_trip_and_cold_machine(tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 40)
    parts = tmp_path / "parts"
    manifest = ship_model.split(source, parts, piece_bytes=4000)
    assert len(manifest["pieces"]) == 3
    target = tmp_path / "assembled.gguf"
    second = tmp_path / "second"
    second.mkdir()
    (second / "manifest.json").write_text((parts / "manifest.json").read_text())
    (second / "piece_01").write_bytes((parts / "piece_01").read_bytes())
    assert ship_model.append(second, target) == ship_model.EXIT_GAP  # a cold machine: piece 00 is missing
    assert ship_model.append(parts, target) == 0 and target.read_bytes() == source.read_bytes()


# ---------------------------------------------------------------------------------------------- report
def _quality_result(date: str, rows: list[dict]) -> dict:
    return {"name": "quality", "date": date, "device": "CPU", "commit": "abcdef0123", "command": "python x",
            "rows": rows}


def _row(policy: str, score: float, bits: str | None = None, task: str = "gsm8k_cot", param: str = "G=48") -> dict:
    extra = {"correct": round(score * 4), "bits": bits} if bits else {}
    return {"task": task, "model": "m", "policy": policy, "param": "" if policy == "full" else param,
            "setting": "report", "score": score, "n": 4, "extra": extra}


def test_finalize_pairs_rows_with_full() -> None:
    rows = report.finalize_rows([_row("full", 0.5, "1100"), _row("default", 0.5, "1010"),
                                 _row("full", 10.0, task="doc_ppl"), _row("default", 12.0, task="doc_ppl")])
    assert rows[1]["vs_full"] == 1.0 and (rows[1]["lost"], rows[1]["gained"]) == (1, 1)
    assert rows[3]["vs_full"] == pytest.approx(0.2)


def test_report_rewrites_blocks_and_check_finds_stale_ones(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    doc = tmp_path / "page.md"
    doc.write_text("# Page\n<!-- generated:quality_matrix -->\nold\n<!-- /generated:quality_matrix -->\n"
                   "<!-- generated:speed -->\n<!-- /generated:speed -->\n"
                   "<!-- generated:other -->\nx\n<!-- /generated:other -->\n"
                   "In prose, `<!-- generated:speed -->` is no block.\n")
    assert report.main(["--results", str(results), str(doc)]) == 0
    text = doc.read_text()
    assert text.count(report.NO_RESULTS) == 2 and "-->\nx\n<!--" in text and "`<!-- generated:speed -->` is" in text
    older = _quality_result("2026-12-01T00:00:00", [_row("full", 0.5, "1100"), _row("default", 0.25, "1000")])
    newer = _quality_result("2026-12-02T00:00:00", [_row("default", 0.5, "1010")])
    (results / "quality_a.json").write_text(json.dumps(older))
    (results / "quality_b.json").write_text(json.dumps(newer))
    assert report.main(["--check", "--results", str(results), str(doc)]) == 1
    assert report.main(["--results", str(results), str(doc)]) == 0
    text = doc.read_text()
    assert "| gsm8k_cot | m | CPU | report | G=48 | 2/4 | 2/4 (1.00) |" in text  # the newer default row won
    assert "`quality_a.json`" in text and report.main(["--check", "--results", str(results), str(doc)]) == 0


def test_quality_rows_pair_with_the_full_cache_of_their_own_device() -> None:
    """Greedy tokens differ between GPUs: a run on another device gets its own line and its own full cache."""
    h200 = {**_quality_result("2026-12-01T00:00:00", [_row("full", 0.5, "1100"), _row("default", 0.25, "1000")]),
            "device": "NVIDIA H200"}
    h100 = {**_quality_result("2026-12-02T00:00:00", [_row("full", 1.0, "1111"), _row("snapkv", 0.5, "1100")]),
            "device": "NVIDIA H100 80GB HBM3"}
    table = report.quality_table(report.merge_rows([h200, h100]))
    assert "| gsm8k_cot | m | H200 | report | G=48 | 2/4 | 1/4 (0.50) |  |" in table
    assert "| gsm8k_cot | m | H100 | report | G=48 | 4/4 |  | 2/4 (0.50) |" in table
    assert report.device_label("CPU (x86_64, 2 cores)") == "CPU"


def test_matrix_keeps_peers_and_options_and_the_variants_table_the_default_and_its_variants() -> None:
    rows = [_row("full", 1.0, "1111"), _row("default", 0.75, "1110"), _row("snapkv_fullroom", 0.5, "1100"),
            _row("int8_2x", 1.0, "1111"), _row("default_share50", 0.25, "1000"),
            _row("full", 1.0, "1111", param="G=96"), _row("default", 1.0, "1111", param="G=96")]
    matrix = report.quality_table(report.merge_rows([_quality_result("2026-12-01T00:00:00", rows)]))
    assert "| full | default | snapkv_fullroom | int8_2x |" in matrix and "share50" not in matrix
    assert "| G=96 | 4/4 | 4/4 (1.00) |  |  |" in matrix
    variants = report.quality_table(report.merge_rows([_quality_result("2026-12-01T00:00:00", rows)]), variants=True)
    assert "| full | default | default_share50 |" in variants and "G=96" not in variants  # no variant ran there
    assert "| G=48 | 4/4 | 3/4 (0.75) | 1/4 (0.25) |" in variants
    assert report.peer_of("snapkv_fullroom") == "snapkv" and report.peer_of("sink_recent") == "sink_recent"
    assert report.peer_of("default_share50") is None
    # Variants of other tasks go to tables of their own, each with only its columns.
    rows += [_row("full", 1.0, task="retrieval", param=""), _row("default", 0.5, task="retrieval", param="4K/16x"),
             _row("novelty_x", 0.75, task="retrieval", param="4K/16x")]
    for r in rows[-3:]:
        r["setting"] = "unseen"
    variants = report.quality_table(report.merge_rows([_quality_result("2026-12-01T00:00:00", rows)]), variants=True)
    gsm8k, retrieval = variants.split("\n\n**retrieval, question unseen**\n\n")
    assert gsm8k.startswith("**gsm8k_cot**") and "novelty_x" not in gsm8k and "retrieval" not in gsm8k
    assert "| full | default | novelty_x |" in retrieval and "share50" not in retrieval
    assert "| retrieval | m | CPU | unseen | 4K/16x | 1.000 | 0.500 (0.50) | 0.750 (0.75) |" in retrieval


def test_speed_tables_take_each_point_whole_from_the_newest_run_of_the_same_code() -> None:
    def run(date: str, commit: str, points: dict[str, float]) -> dict:
        rows = [{"point": p, "cache": c, "decode_p50_ms": ms * (3 if c == "dynamic" else 1)}
                for p, ms in points.items() for c in ("dynamic", "ropekv")]
        return {"name": "speed", "date": date, "device": "GPU", "commit": commit, "command": "x", "rows": rows}

    old_commit = run("2026-12-01", "aaaaaaa", {"1x4096": 9.0, "32x4096": 9.0})
    first = run("2026-12-02T01", "bbbbbbb", {"1x4096": 10.0})
    second = run("2026-12-02T02", "bbbbbbb", {"1x4096": 12.0, "1x32768": 11.0})
    merged, used = report.newest_speed([old_commit, first, second])
    assert used == [second] and {(r["point"], r["decode_p50_ms"]) for r in merged["rows"] if r["cache"] == "ropekv"} \
        == {("1x4096", 12.0), ("1x32768", 11.0)}  # 1x4096 whole from the newer run; the old commit's 32x4096 left out
    merged, used = report.newest_speed([old_commit, first, run("2026-12-02T02", "bbbbbbb", {"1x32768": 11.0})])
    assert [r["commit"] for r in used] == ["bbbbbbb"] * 2 and len(merged["rows"]) == 4
    assert "| 1x4096 | 30.0 ms | 10.0 ms | 3.00x |" in report.speed_summary(merged)
    e2e = [{"point": "1x4096", "cache": c, "new_tokens": 2000, "ttft_s": 0.5, "total_s": s}
           for c, s in (("dynamic", 60.0), ("ropekv", 20.0))]
    e2e_only = {**run("2026-12-02T03", "bbbbbbb", {}), "e2e": e2e}
    merged, used = report.newest_speed([old_commit, second, e2e_only])
    assert used == [e2e_only, second] and len(merged["rows"]) == 4 and len(merged["e2e"]) == 2
    assert "| 1x4096, 2000 tokens end to end | 60.0 s | 20.0 s | 3.00x |" in report.speed_summary(merged)
    short = [{**e, "new_tokens": 32, "total_s": e["total_s"] / 50} for e in e2e]  # a first-token run, newer
    merged, used = report.newest_speed([second, e2e_only, {**run("2026-12-02T04", "bbbbbbb", {}), "e2e": short}])
    assert len(used) == 3 and len(merged["e2e"]) == 4  # each length whole from the newest run that has it
    summary, table = report.speed_summary(merged), report.speed_table(merged)
    assert "| 1x4096, 2000 tokens end to end | 60.0 s | 20.0 s | 3.00x |" in summary
    assert "32 tokens" not in summary  # the summary keeps each point's longest run
    assert "| 1x4096, 32 tokens | ropekv |" in table and "| 1x4096, 2000 tokens | ropekv |" in table


def test_repository_docs_are_up_to_date_with_the_results() -> None:
    assert report.main(["--check"]) == 0, "run python benchmarks/report.py"
