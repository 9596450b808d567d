"""The task-accuracy benchmark (benchmarks/task_accuracy.py, benchmarks/gsm8k_tasks.py, benchmarks/program_runner.py):
answer extraction, Wilson intervals, paired counts, policy parsing and peer windows, the isolated program runner,
program-aided scoring, cross-domain warm statistics, and dry runs of the entry point on a tiny random model."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

import hf_ropekv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gsm8k_tasks as tasks  # noqa: E402
import program_runner as runner  # noqa: E402
import task_accuracy  # noqa: E402
from conftest import tiny_model  # noqa: E402


# ---------------------------------------------------------------------------------------------- answers
@pytest.mark.parametrize(
    "text, expected",
    [
        ("She sells 9 eggs at $2 each.\nThe answer is 18", "18"),
        ("The answer is $1,234.", "1234"),
        ("So the final answer is: **-7**.", "-7"),
        ("Thus \\boxed{42} is it. Check: 42 - 2 = 40", "42"),  # explicit form beats a later number
        ("#### 3.50", "3.5"),
        ("The answer is 5. Wait, recomputing: the answer is 6.", "6"),  # the last explicit form wins
        ("12 + 30 = 42 apples", "42"),  # no explicit form: the last number
        ("Answer: 18.0", "18"),
        ("first 3, 4 and 5", "5"),  # "3, 4" is a list, not 34
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert tasks.extract_answer(text) == expected


def test_extract_labeled_answers_takes_each_label_last_and_marks_missing() -> None:
    text = "Problem 1...\nAnswer 1: 18\nProblem 2 ...\nAnswer 2: $3\nAnswer 2: 4\n... Answer 4: 1,000"
    assert tasks.extract_labeled_answers(text, 4) == ["18", "4", None, "1000"]


def test_normalize_and_compare() -> None:
    assert tasks.normalize_number("$1,000.00") == "1000"
    assert tasks.normalize_number("abc") is None
    assert tasks.is_correct("18", "18") and tasks.is_correct("18.0", "18")
    assert not tasks.is_correct(None, "18") and not tasks.is_correct("17", "18")


def test_reference_answer_reads_after_hashes() -> None:
    assert tasks.reference_answer("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    assert tasks.reference_answer("... \n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="####"):
        tasks.reference_answer("no final line")


# ---------------------------------------------------------------------------------------------- statistics
def test_wilson_interval_matches_hand_values() -> None:
    z = 1.959964
    z2 = z * z
    # 0/10: centre z²/20 / (1+z²/10), half-width the same: the interval is [0, z²/10 / (1+z²/10)].
    lo, hi = tasks.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx((z2 / 10) / (1 + z2 / 10), abs=1e-12)
    assert hi == pytest.approx(0.27753, abs=1e-5)
    # 5/10: symmetric about 0.5, half-width z*sqrt(0.025 + z²/400) / (1 + z²/10).
    lo, hi = tasks.wilson_interval(5, 10)
    half = z * math.sqrt(0.025 + z2 / 400) / (1 + z2 / 10)
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-12)
    assert (lo, hi) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    # 10/10 mirrors 0/10.
    lo, hi = tasks.wilson_interval(10, 10)
    assert hi == pytest.approx(1.0, abs=1e-12) and lo == pytest.approx(1 - 0.27753, abs=1e-5)
    assert tasks.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        tasks.wilson_interval(11, 10)


def test_paired_counts_over_shared_problems() -> None:
    full = {0: True, 1: True, 2: False, 3: False, 4: True}
    other = {0: True, 1: False, 2: True, 3: False, 9: True}  # 4 missing (skipped), 9 not in full
    assert tasks.paired_counts(full, other) == (1, 1, 4)


def test_ranges_and_disjointness() -> None:
    assert tasks.parse_range("0-599") == range(0, 600)
    assert tasks.parse_range("7") == range(7, 8)
    with pytest.raises(ValueError):
        tasks.parse_range("5-2")
    tasks.check_disjoint(range(300, 600), range(0, 300))
    tasks.check_not_held_out(range(0, 600), "--problems")
    with pytest.raises(ValueError, match="held-out problems"):
        tasks.check_not_held_out(range(590, 610), "--problems")


def test_splits_default_and_refuse_held_out_or_overlapping_calibration() -> None:
    def ranges(*argv: str):
        args = task_accuracy.build_parser().parse_args(list(argv))
        policies = [task_accuracy.parse_policy(x) for x in task_accuracy.split_policies(args.policies)]
        return task_accuracy.problem_ranges(args, policies)

    # Reporting calibrates on the tune split by default; tuning has no default calibration set.
    assert ranges("--policies", "full,rope-calibrated") == (range(300, 600), range(0, 300))
    assert ranges("--split", "tune", "--policies", "full,recency") == (range(0, 300), None)
    with pytest.raises(ValueError, match="need --calib-problems"):
        ranges("--split", "tune", "--policies", "rope-calibrated")
    with pytest.raises(ValueError, match="held-out"):
        ranges("--problems", "500-700", "--policies", "recency")
    with pytest.raises(ValueError, match="held-out"):
        ranges("--policies", "rope-calibrated", "--calib-problems", "600-999")
    with pytest.raises(ValueError, match="overlap"):
        ranges("--policies", "rope-calibrated", "--calib-problems", "250-350")
    with pytest.raises(ValueError, match="overlap"):
        tasks.check_disjoint(range(0, 600), range(599, 700))


def test_policy_parsing() -> None:
    labels = task_accuracy.split_policies("full,default:selection=per_layer,window=16,compress_every=32,recency")
    assert labels == ["full", "default:selection=per_layer,window=16,compress_every=32", "recency"]
    policy = task_accuracy.parse_policy(labels[1])
    assert policy.cache_kwargs == {"selection": "per_layer", "window": 16, "compress_every": 32}
    assert task_accuracy.parse_policy("random").scorer_kwargs == {"seed": 0}
    assert task_accuracy.parse_policy("streaming").cache_kwargs == {"window": 0, "sink": 4}
    # Named policies pin what they depend on, so their rows keep their meaning when the library's defaults move.
    assert task_accuracy.parse_policy("paper").cache_kwargs == {"selection": "global", "window": 0, "stats_half_life": None,
                                                                 "stats_head_shrink": 0}
    assert task_accuracy.parse_policy("default").cache_kwargs == {}
    assert task_accuracy.parse_policy("random:scorer.seed=3").scorer_kwargs == {"seed": 3}
    with pytest.raises(ValueError, match="unknown policy"):
        task_accuracy.parse_policy("nope")
    with pytest.raises(ValueError, match="budget"):
        task_accuracy.parse_policy("default:budget=3")
    with pytest.raises(ImportError, match="NoSuchScorer"):
        task_accuracy.scorer_class("NoSuchScorer")
    assert task_accuracy.parse_policy("default:online.prompt_weight=0").online_kwargs == {"prompt_weight": 0}
    assert task_accuracy.parse_policy("default:stats_prompt_weight=0").cache_kwargs == {"stats_prompt_weight": 0}
    with pytest.raises(ValueError, match="online statistics"):
        task_accuracy.parse_policy("recency:online.prompt_weight=0")


def test_online_overrides_reach_the_cache_before_its_first_forward() -> None:
    model = tiny_model("llama")
    policy = task_accuracy.parse_policy("default:online.prompt_weight=0.5")
    cache = task_accuracy.make_cache(model, policy, budget=16, compress_every=4, protect_prompt=True, stats=None)
    assert cache._online.prompt_weight == 0.5
    plain = task_accuracy.make_cache(model, task_accuracy.parse_policy("default"), 16, 4, True, None)
    assert plain._online.prompt_weight == 1.0
    option = task_accuracy.make_cache(model, task_accuracy.parse_policy("default:stats_prompt_weight=0"), 16, 4, True,
                                      None)
    assert option.stats_prompt_weight == 0 and option._online.prompt_weight == 0  # the cache option, the same knob
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        task_accuracy.make_cache(model, task_accuracy.parse_policy("default:online.nope=1"), 16, 4, True, None)


# ---------------------------------------------------------------------------------------------- dry run
CharTokenizer = task_accuracy.CharTokenizer


def fake_problems() -> list[tasks.Problem]:
    rows = [(0, "Tom has 3 apples and buys 4. How many?", "3 + 4 = 7\n#### 7"),
            (1, "A box holds 12 pens. How many in 2 boxes?", "12 * 2 = 24\n#### 24"),
            (2, "Sam ran 5 km on each of 3 days. Total?", "5 * 3 = 15\n#### 15"),
            (3, "Ann had 9 cards and gave away 2. Left?", "9 - 2 = 7\n#### 7"),
            (298, "Bo reads 4 pages a day for 6 days. Pages?", "4 * 6 = 24\n#### 24"),
            (299, "A cat sleeps 14 hours. Awake hours?", "24 - 14 = 10\n#### 10")]
    return [tasks.Problem(i, q, s, tasks.reference_answer(s)) for i, q, s in rows]


def test_dry_run_writes_results(tmp_path: Path) -> None:
    model = tiny_model("llama")
    rows = task_accuracy.main(
        ["--out", str(tmp_path), "--problems", "0-2", "--calib-problems", "298-299", "--policies",
         "full,rope-calibrated-per-layer:window=2", "--gaps", "4", "--compress-every", "4",
         "--max-new-tokens", "12", "--batch-size", "2", "--commit", "test"],
        model=model, tokenizer=CharTokenizer(), problems=fake_problems(),
    )
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["policy"] for r in result["summary"]] == ["full", "rope-calibrated-per-layer:window=2"]
    assert [r["budget"] for r in result["summary"]] == [None, 4]
    assert result["settings"]["max_new_tokens"] == 12 and result["dtype"] == "float32"
    assert "calibration" in result and (tmp_path / "calibration_stats.safetensors").is_file()
    for row in result["rows"]:
        assert sorted(row["outcomes"]) == ["0", "1", "2"]
        for outcome in row["outcomes"].values():
            assert outcome["new_tokens"] == 12 and outcome["text_chars"] == 12
    full, evicting = result["summary"]
    assert full["ratio_to_full"] in (1.0, None) and full["lost_vs_full"] == 0
    # The budget was 4 tokens past the longest prompt of each batch; with 12 new tokens the cache evicted.
    assert evicting["mean_kept"] < evicting["mean_seen"] == full["mean_seen"]
    # The full cache holds the 11 generated positions processed (the 12th token is never fed back); the evicting
    # one keeps fewer of them (its pinned prompts stay), but some.
    assert full["mean_generated_kept"] == 11
    assert 0 < evicting["mean_generated_kept"] < 11
    assert (full["window"], evicting["window"]) == ("—", "2")
    assert evicting["paired_n"] == 3
    assert rows[1]["budget_of_batches"] == [max(r["prompt_tokens"] for r in list(rows[1]["outcomes"].values())[:2]) + 4,
                                            rows[1]["outcomes"]["2"]["prompt_tokens"] + 4]
    md = (tmp_path / "results.md").read_text()
    assert "| full | — | — |" in md and "| rope-calibrated-per-layer:window=2 | +4 | 2 |" in md
    assert "mean generated tokens kept" in md and "program errors" not in md  # a chain-of-thought run


def test_long_task_skips_prompts_that_do_not_fit(tmp_path: Path) -> None:
    model = tiny_model("llama")
    probs = fake_problems()
    lengths = [len(task_accuracy.chat_ids(CharTokenizer(), tasks.long_messages(g))) for g in (probs[:2], probs[2:4])]
    prompt_len, fits = min(lengths), max(lengths) + task_accuracy.LONG_MIN_FREE + 8
    task_accuracy.main(
        ["--task", "long", "--out", str(tmp_path), "--problems", "0-3", "--calib-problems", "298-299",
         "--long-size", "2", "--policies", "recency", "--budgets", f"{prompt_len},{fits}",
         "--compress-every", "4", "--max-new-tokens", "10"],
        model=model, tokenizer=CharTokenizer(), problems=probs,
    )
    result = json.loads((tmp_path / "results.json").read_text())
    small, large = result["summary"]
    assert small["n"] == 0 and small["skipped"] == 4  # both prompts longer than the budget: skipped, no crash
    assert large["n"] == 4 and large["skipped"] == 0
    assert result["settings"]["max_new_tokens"] == 10

    # Unpinned, the same small budget runs every prompt (the prompt itself gets evicted).
    task_accuracy.main(
        ["--task", "long", "--out", str(tmp_path), "--problems", "0-3", "--long-size", "2", "--policies", "recency",
         "--budgets", str(prompt_len), "--compress-every", "4", "--max-new-tokens", "10", "--protect-prompt", "off"],
        model=model, tokenizer=CharTokenizer(), problems=probs,
    )
    (unpinned,) = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert unpinned["n"] == 4 and unpinned["skipped"] == 0 and unpinned["mean_kept"] < unpinned["mean_seen"]


# ---------------------------------------------------------------------------------------------- model transfer
def test_ship_model_round_trip_and_cold_machine(tmp_path: Path) -> None:
    import os

    import ship_model

    source = tmp_path / "model.gguf"
    source.write_bytes(os.urandom(1000))
    parts = tmp_path / "parts"
    manifest = ship_model.split(source, parts, piece_bytes=300)
    assert [p["bytes"] for p in manifest["pieces"]] == [300, 300, 300, 100]

    def call(*names: str) -> tuple[int, Path]:  # one device call carrying the manifest and these pieces
        carried = tmp_path / "call"
        if carried.exists():
            for f in carried.iterdir():
                f.unlink()
        carried.mkdir(exist_ok=True)
        (carried / "manifest.json").write_bytes((parts / "manifest.json").read_bytes())
        for name in names:
            (carried / name).write_bytes((parts / name).read_bytes())
        target = tmp_path / "target.gguf"
        return ship_model.append(carried, target), target

    assert call("piece_00")[0] == ship_model.EXIT_PROGRESS
    assert call("piece_02")[0] == ship_model.EXIT_GAP  # piece_01 skipped
    assert call("piece_01")[0] == ship_model.EXIT_PROGRESS
    assert call("piece_01")[0] == ship_model.EXIT_PROGRESS  # resent: already there, not appended twice
    rc, target = call("piece_02", "piece_03")
    assert rc == 0 and target.read_bytes() == source.read_bytes()
    target.unlink()  # the machine went cold
    assert call("piece_03")[0] == ship_model.EXIT_GAP
    target.write_bytes(b"x" * 1000)  # right size, wrong bytes
    assert call()[0] == ship_model.EXIT_CHECKSUM


def test_max_minutes_stops_cleanly_and_merge_combines_runs(tmp_path: Path) -> None:
    model, tok, probs = tiny_model("llama"), CharTokenizer(), fake_problems()
    common = ["--problems", "0-2", "--calib-problems", "298-299", "--gaps", "4,8", "--compress-every", "4",
              "--max-new-tokens", "6"]
    task_accuracy.main(["--out", str(tmp_path / "a"), "--policies", "full,recency", "--max-minutes", "0", *common],
                       model=model, tokenizer=tok, problems=probs)
    stopped = json.loads((tmp_path / "a" / "results.json").read_text())
    assert stopped["rows"] == [] and stopped["not_run"] == "full@None, recency:window=auto@4, recency:window=auto@8"
    task_accuracy.main(["--out", str(tmp_path / "a"), "--policies", "full", *common],
                       model=model, tokenizer=tok, problems=probs)
    task_accuracy.main(["--out", str(tmp_path / "b"), "--policies", "recency", *common, "--gaps", "4"],
                       model=model, tokenizer=tok, problems=probs)
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert b["summary"][0]["lost_vs_full"] is None  # no full row in this run
    task_accuracy.main(["--out", str(tmp_path / "m"), "--merge", str(tmp_path / "a" / "results.json"),
                        str(tmp_path / "b" / "results.json")])
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [(r["policy"], r["budget"]) for r in merged["summary"]] == [("full", None), ("recency:window=auto", 4)]
    assert merged["summary"][1]["paired_n"] == 3 and len(merged["merged_from"]) == 2


def test_make_batches_in_order_or_by_length() -> None:
    units = [task_accuracy.Unit([p], [1] * n) for p, n in zip(fake_problems(), (5, 2, 9, 3, 7))]
    by_order = task_accuracy.make_batches(units, 2, sort_by_length=False)
    assert [[len(u.prompt) for u in b] for b in by_order] == [[5, 2], [9, 3], [7]]
    by_length = task_accuracy.make_batches(units, 2, sort_by_length=True)
    assert [[len(u.prompt) for u in b] for b in by_length] == [[2, 3], [5, 7], [9]]


# ---------------------------------------------------------------------------------------------- peer windows
def test_peers_get_the_default_window_and_the_label_says_so() -> None:
    def parsed(text: str, peer_window: str) -> list[task_accuracy.Policy]:
        return [task_accuracy.with_peer_window(task_accuracy.parse_policy(label), peer_window)
                for label in task_accuracy.split_policies(text)]

    # One command, every peer at window 32.
    peers = parsed("full,default,recency,random,snapkv,h2o,rkv", "32")
    assert [p.label for p in peers] == ["full", "default", "recency:window=32", "random:window=32",
                                        "snapkv:window=32", "h2o:window=32", "rkv:window=32"]
    assert [p.cache_kwargs.get("window") for p in peers] == [None, None, 32, 32, 32, 32, 32]
    assert [task_accuracy.window_setting(p) for p in peers] == ["—", "auto", "32", "32", "32", "32", "32"]
    # auto: RopeKVCache(window=None), the default cache's own rule; scorer overrides are kept.
    (rkv,) = parsed("rkv:scorer.window=8", "auto")
    assert rkv.label == "rkv:scorer.window=8,window=auto"
    assert rkv.cache_kwargs == {"window": None} and rkv.scorer_kwargs == {"window": 8}
    assert task_accuracy.parse_policy(rkv.label).cache_kwargs == {"window": None}  # the label reruns as is
    # A label's own window wins; pinned leaves the policies' own (0); the RoPE policies are never touched.
    assert [p.label for p in parsed("random:window=4,paper", "auto")] == ["random:window=4", "paper"]
    assert parsed("random:window=4", "auto")[0].cache_kwargs["window"] == 4
    assert [p.cache_kwargs for p in parsed("snapkv", "pinned")] == [{"window": 0}]
    with pytest.raises(ValueError, match="--peer-window"):
        parsed("h2o", "wide")


def test_peer_cache_protects_the_same_window_as_the_default() -> None:
    model = tiny_model("llama")
    default = task_accuracy.make_cache(model, task_accuracy.parse_policy("default"), 200, 16, True, None)
    for name in ("recency", "random", "snapkv", "h2o", "rkv"):
        auto = task_accuracy.with_peer_window(task_accuracy.parse_policy(name), "auto")
        cache = task_accuracy.make_cache(model, auto, 200, 16, True, None)
        assert cache.window == default.window == 32 and cache.options.auto_window == default.options.auto_window
        pinned = task_accuracy.make_cache(model, task_accuracy.parse_policy(name), 200, 16, True, None)
        assert pinned.window == 0


# ---------------------------------------------------------------------------------------------- program-aided
@pytest.mark.parametrize(
    "text, expected",
    [
        ("Here:\n```python\nx = 3\nprint(x + 4)\n```\nDone.", "x = 3\nprint(x + 4)\n"),
        ("```py\nprint(1)\n```", "print(1)\n"),
        ("```text\nnot this\n```\n```python\nprint(2)\n```\n```python\nprint(3)\n```", "print(2)\n"),  # first python
        ("```\nprint(5)\n```", "print(5)\n"),  # no python tag: the first fenced block
        ("```python\nprint(6)\nwhile", "print(6)\nwhile"),  # never closed: to the end
        ("print(7)", "print(7)"),  # no fence: the whole text
    ],
)
def test_extract_program(text: str, expected: str) -> None:
    assert runner.extract_program(text) == expected


def test_last_number_of_the_output() -> None:
    assert runner.last_number("0.30000000000000004\n") == "0.3"  # float noise rounded away
    assert runner.last_number("step 1\n1,234.50\n") == "1234.5"
    assert runner.last_number("-18.0") == "-18"
    assert runner.last_number("12.345678") == "12.345678"
    assert runner.last_number("done") is None


def test_run_program_outcomes() -> None:
    ok = runner.run_program("import math\nprint(math.comb(5, 2) * 3)\n")
    assert (ok.status, ok.answer, ok.ok) == ("ok", "30", True)
    start = time.perf_counter()
    slow = runner.run_program("while True:\n    pass\n", timeout=1.0)
    assert slow.status == "timeout" and slow.answer is None and time.perf_counter() - start < 4
    failed = runner.run_program("print(7)\nraise ValueError('boom')\n")
    assert failed.status == "error" and failed.answer is None and "ValueError: boom" in failed.stderr
    assert runner.run_program("x = 1\n").status == "no_output"
    assert runner.run_program("print('done')\n").status == "no_number"
    # No network: the socket module imports, but opening a socket (or resolving a name) fails.
    assert runner.run_program("import socket\nprint(7)\n").answer == "7"
    for code in ("import socket\ns = socket.socket()\nprint(7)\n",
                 "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\nprint(7)\n",
                 "import socket\nprint(socket.getaddrinfo('localhost', 80))\n"):
        net = runner.run_program(code)
        assert net.status == "error" and "network access is disabled" in net.stderr, code
    # Isolated: an empty temporary working folder, no site-packages.
    iso = runner.run_program("import os, sys\nprint(len(os.listdir('.')), 'site' in sys.modules)\n")
    assert iso.stdout.split() == ["3", "False"]  # program.py, stdout.txt, stderr.txt


def test_program_pool_runs_in_parallel() -> None:
    code = "import time\ntime.sleep(1)\nprint(1)\n"
    start = time.perf_counter()
    with runner.ProgramPool(workers=4) as pool:
        futures = [pool.submit(code) for _ in range(4)]
        assert not all(f.done() for f in futures)  # submit returns at once
        results = [f.result() for f in futures]
    assert [r.answer for r in results] == ["1"] * 4
    assert time.perf_counter() - start < 3  # one after another would take 4 s or more


class ProgramTokenizer(CharTokenizer):
    """Decodes the replies of a program-aided run, one per row in problem order: a right program, one that
    raises, one that prints no number."""

    replies = ["Sure.\n```python\napples = 3\nprint(apples + 4)\n```", "```python\nraise ValueError\n```",
               "```python\nprint('done')\n```"]

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return self.replies[(self.calls - 1) % len(self.replies)]


def test_pot_run_scores_programs_counts_errors_and_labels_cross_domain_warm(tmp_path: Path) -> None:
    model = tiny_model("llama")
    rows = task_accuracy.main(
        ["--out", str(tmp_path), "--domain", "pot", "--warm", "--warm-domain", "cot", "--warm-problems", "298-299",
         "--problems", "0-2", "--policies", "full,recency,default:window=2", "--gaps", "4", "--compress-every", "4",
         "--max-new-tokens", "8", "--batch-size", "2", "--program-workers", "2", "--commit", "test"],
        model=model, tokenizer=ProgramTokenizer(), problems=fake_problems(),
    )
    result = json.loads((tmp_path / "results.json").read_text())
    labels = [r["policy"] for r in result["summary"]]
    assert labels == ["full", "recency:window=auto", "default:window=2", "default:window=2+warm(cot)"]
    for summary, row in zip(result["summary"], rows):
        # Problem 0 (answer 7) gets the right program; 1 the failing one; 2 the one that prints no number.
        assert [row["outcomes"][k]["program"] for k in ("0", "1", "2")] == ["ok", "error", "no_number"]
        assert [row["outcomes"][k]["correct"] for k in ("0", "1", "2")] == [True, False, False]
        assert summary["correct"] == 1 and summary["program_errors"] == {"total": 2, "error": 1, "no_number": 1}
    assert result["settings"]["domain"] == "pot" and result["warm"]["domain"] == "cot"
    assert rows[-1]["warm_domain"] == "cot" and "warm_domain" not in rows[0]
    md = (tmp_path / "results.md").read_text()
    assert "# Task accuracy: gsm8k, program-aided" in md and "| program errors |" in md
    assert "| 2 (error 1, no number 1) |" in md
    assert "| recency:window=auto | +4 | auto (≤" in md
    assert "in the **chain of thought** domain" in md and "then were evaluated on program-aided" in md
    assert "GSM8K has no reference programs" not in md  # no calibrated policy ran

    # A pot run is not merged with a chain-of-thought one.
    cot = json.loads((tmp_path / "results.json").read_text())
    cot["settings"]["domain"] = "cot"
    (tmp_path / "cot.json").write_text(json.dumps(cot))
    with pytest.raises(ValueError, match="one domain at a time"):
        task_accuracy.main(["--merge", str(tmp_path / "results.json"), str(tmp_path / "cot.json"),
                            "--out", str(tmp_path / "m")])


def test_warm_domain_picks_the_warm_up_prompts(tmp_path: Path) -> None:
    model, probs = tiny_model("llama"), fake_problems()
    learned = {}
    for domain in ("cot", "pot"):
        out = tmp_path / domain
        task_accuracy.main(
            ["--out", str(out), "--warm", "--warm-domain", domain, "--warm-problems", "298-299", "--problems", "0-1",
             "--policies", "default:window=2", "--gaps", "4", "--compress-every", "4", "--max-new-tokens", "4"],
            model=model, tokenizer=CharTokenizer(), problems=probs,
        )
        result = json.loads((out / "results.json").read_text())
        learned[domain] = result["warm"]
        assert [r["policy"] for r in result["summary"]] == (
            ["default:window=2", "default:window=2+warm"] if domain == "cot"
            else ["default:window=2", "default:window=2+warm(pot)"])
        assert f"in the **{tasks.DOMAINS[domain]}** domain" in (out / "results.md").read_text()
    # The same two problems and generation length: the longer program-aided instruction is what the pot
    # warm-up learned more tokens from.
    pot_extra = sum(len(task_accuracy.chat_ids(CharTokenizer(), tasks.pot_messages(p)))
                    - len(task_accuracy.chat_ids(CharTokenizer(), tasks.gsm8k_messages(p))) for p in probs[-2:])
    assert learned["pot"]["domain"] == "pot" and learned["cot"]["domain"] == "cot"
    assert learned["pot"]["tokens"] > learned["cot"]["tokens"] and pot_extra > 0


def test_warm_only_drops_the_learners_cold_rows(tmp_path: Path) -> None:
    # Two prior weights compared warm, with one cold reference row (a policy that does not learn) and full.
    task_accuracy.main(
        ["--out", str(tmp_path), "--warm", "--warm-only", "--warm-problems", "298-299", "--problems", "0-1",
         "--policies", "full,default:window=2,default:window=2,prior_tokens=4096,default:window=2,learn_workload=False",
         "--gaps", "4", "--compress-every", "4", "--max-new-tokens", "4"],
        model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems(),
    )
    result = json.loads((tmp_path / "results.json").read_text())
    assert [(r["policy"], r["warm"]) for r in result["rows"]] == [
        ("full", False), ("default:window=2,learn_workload=False", False),
        ("default:window=2+warm", True), ("default:window=2,prior_tokens=4096+warm", True)]
    with pytest.raises(ValueError, match="needs --warm"):
        task_accuracy.main(["--out", str(tmp_path), "--warm-only", "--problems", "0-1", "--policies", "default"],
                           model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems())


def test_warm_online_sets_the_warm_up_caches(tmp_path: Path) -> None:
    """--warm-online prompt_weight=0: the warm-up's caches leave the prompts out of what the workload learns, so it
    learns exactly the decoding steps' queries (2 problems x 3 steps: the first of the 4 new tokens comes from the
    prompt's forward; the tiny config has no EOS)."""
    learned = {}
    for name, extra in (("plain", []), ("no_prompt", ["--warm-online", "prompt_weight=0"])):
        task_accuracy.main(
            ["--out", str(tmp_path / name), "--warm", "--warm-problems", "298-299", "--problems", "0-1",
             "--policies", "default:window=2", "--gaps", "4", "--compress-every", "4", "--max-new-tokens", "4",
             "--batch-size", "1", *extra],
            model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems(),
        )
        learned[name] = json.loads((tmp_path / name / "results.json").read_text())["warm"]
    assert learned["no_prompt"]["tokens"] == 2 * 3 and learned["no_prompt"]["online"] == {"prompt_weight": 0}
    assert learned["plain"]["tokens"] > 2 * 3 and learned["plain"]["online"] == {}
    assert "online.prompt_weight=0" in (tmp_path / "no_prompt" / "results.md").read_text()
    assert task_accuracy.parse_overrides("prompt_weight=0.5,half_life=none") == {"prompt_weight": 0.5, "half_life": None}
    with pytest.raises(ValueError, match="expected key=value"):
        task_accuracy.parse_overrides("prompt_weight")
    with pytest.raises(ValueError, match="needs --warm"):
        task_accuracy.main(["--out", str(tmp_path), "--warm-online", "prompt_weight=0", "--problems", "0-1",
                            "--policies", "default"],
                           model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems())


def test_warm_file_saves_the_prior_and_a_later_call_loads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--warm-file: the first call learns and saves the prior; a second call on a fresh copy of the model loads it
    (no warm-up runs) and scores with the same statistics; other warm settings refuse the file."""
    path = tmp_path / "prior.safetensors"
    argv = ["--warm", "--warm-problems", "298-299", "--problems", "0-1", "--policies", "default:window=2",
            "--gaps", "4", "--compress-every", "4", "--max-new-tokens", "4", "--batch-size", "1",
            "--warm-online", "prompt_weight=0", "--warm-file", str(path)]
    first_model, second_model = tiny_model("llama"), tiny_model("llama")
    task_accuracy.main(["--out", str(tmp_path / "first"), *argv], model=first_model, tokenizer=CharTokenizer(),
                       problems=fake_problems())
    learned = json.loads((tmp_path / "first" / "results.json").read_text())["warm"]
    assert path.is_file() and learned["tokens"] == 2 * 3 and "loaded_from" not in learned

    def no_warm_up(*args, **kwargs):
        raise AssertionError("the warm-up ran although --warm-file held a prior")

    monkeypatch.setattr(task_accuracy, "learn_workload", no_warm_up)
    task_accuracy.main(["--out", str(tmp_path / "second"), *argv], model=second_model, tokenizer=CharTokenizer(),
                       problems=fake_problems())
    loaded = json.loads((tmp_path / "second" / "results.json").read_text())["warm"]
    assert loaded == {**learned, "loaded_from": str(path)}
    first, second = (hf_ropekv.workload_statistics(m).prior() for m in (first_model, second_model))
    assert second.frozen and second.tokens == first.tokens == 6
    torch.testing.assert_close(second.means, first.means.float().double(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="learned with other settings"):
        task_accuracy.main(["--out", str(tmp_path / "third"), *argv[:-4], "--warm-file", str(path)],
                           model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems())
    with pytest.raises(ValueError, match="needs --warm"):
        task_accuracy.main(["--out", str(tmp_path), "--warm-file", str(path), "--problems", "0-1",
                            "--policies", "default"],
                           model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems())


def test_calibration_on_the_models_own_answers(tmp_path: Path) -> None:
    model, probs = tiny_model("llama"), fake_problems()
    task_accuracy.main(
        ["--out", str(tmp_path), "--calib-source", "own", "--problems", "0-1", "--calib-problems", "298-299",
         "--policies", "default:stats=calibrated,window=2", "--gaps", "4", "--compress-every", "4",
         "--max-new-tokens", "5", "--batch-size", "2"],
        model=model, tokenizer=CharTokenizer(), problems=probs,
    )
    result = json.loads((tmp_path / "results.json").read_text())
    assert "chain of thought: the model's own greedy answers" in result["calibration"]
    stats = hf_ropekv.FrequencyStats.load(tmp_path / "calibration_stats.safetensors")
    # CharTokenizer has no chat_template, so calibrate() tokenizes each user message as plain text.
    prompts = [len(CharTokenizer()(tasks.gsm8k_messages(p)[-1]["content"])["input_ids"]) for p in probs[-2:]]
    assert stats.tokens == sum(prompts) + 2 * 5  # the two prompts and their 5-token answers, not the references


@pytest.mark.parametrize("source", ["questions", "reference-plain"])
def test_calibration_on_the_prompts_alone_or_plain_references(tmp_path: Path, source: str) -> None:
    """--calib-source questions calibrates on exactly the evaluated prompts' text, reference-plain on the reference
    solutions without GSM8K's <<calculator>> notes: each equals a calibration on those texts and no other."""
    model, probs = tiny_model("llama"), fake_problems()
    probs[-1] = dataclasses.replace(probs[-1], solution="She has 3 * 4 = <<3*4=12>>12 apples.\n#### 12",
                                    answer="12")
    task_accuracy.main(
        ["--out", str(tmp_path), "--calib-source", source, "--problems", "0-1", "--calib-problems", "298-299",
         "--policies", "default:stats=calibrated,window=2", "--gaps", "4", "--compress-every", "4",
         "--max-new-tokens", "3", "--batch-size", "2"],
        model=model, tokenizer=CharTokenizer(), problems=probs,
    )
    stats = hf_ropekv.FrequencyStats.load(tmp_path / "calibration_stats.safetensors")
    tok = CharTokenizer()
    if source == "questions":
        texts = [tok.apply_chat_template(tasks.gsm8k_messages(p), tokenize=False, add_generation_prompt=True)
                 for p in probs[-2:]]
        assert all(t.endswith("<assistant>") for t in texts)
    else:
        texts = [tok.apply_chat_template(tasks.calibration_messages(p, plain=True), tokenize=False)
                 for p in probs[-2:]]
        assert "<<" not in texts[1] and "3 * 4 = 12 apples" in texts[1]
    expected = hf_ropekv.calibrate(model, tok, texts, max_tokens=10**9, progress=False)
    assert stats.tokens == expected.tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    torch.testing.assert_close(stats.q_abs_mean, expected.q_abs_mean)
    assert hf_ropekv.FrequencyStats.load(tmp_path / "calibration_stats.safetensors").metadata["source"].startswith(
        "GSM8K test problems 298-299")


def test_pot_is_refused_for_the_long_task() -> None:
    with pytest.raises(ValueError, match="not for --task long"):
        task_accuracy.main(["--task", "long", "--domain", "pot", "--problems", "0-7"],
                           model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems())


def test_max_minutes_skips_a_warm_up_that_leaves_no_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each cold row "takes" 10 s of wall time; the clock says 45 s have passed when the warm row comes: a row
    # (10 s) would fit in 60 s, a warm-up and a row (20 s) would not, so the warm-up never starts.
    learned = []
    monkeypatch.setattr(task_accuracy, "learn_workload", lambda *a, **k: learned.append(1) or {})
    monkeypatch.setattr(task_accuracy, "run_policy", lambda *a, **k: {
        "policy": a[3].label, "outcomes": {}, "skipped": [], "mean_new_tokens": None, "mean_kept": None,
        "mean_seen": None, "wall_s": 10.0, "budget_of_batches": []})
    calls = []
    monkeypatch.setattr(task_accuracy.time, "perf_counter", lambda: 45.0 if calls.append(1) or len(calls) > 1 else 0.0)
    task_accuracy.main(["--out", str(tmp_path), "--problems", "0-2", "--policies", "default", "--gaps", "4",
                        "--warm", "--warm-problems", "298-299", "--max-minutes", "1"],
                       model=tiny_model("llama"), tokenizer=CharTokenizer(), problems=fake_problems())
    result = json.loads((tmp_path / "results.json").read_text())
    assert learned == [] and result["not_run"] == "default+warm@4" and "warm" not in result
