"""Names used but never defined, in every Python file of the repository (pyflakes).

Code that only runs on a GPU (a CUDA graph capture, a multi-GPU check) is not executed by CI, so a misspelt or
missing name there would surface only on the device: the graphed step's capture referred to a ``cache`` it was not
given, and every graphed GPU test failed with a ``NameError`` (found on the H200 on 2026-12-04). pyflakes reads the
source without running it; only its undefined-name findings fail here (unused imports are style, not bugs).
"""

from __future__ import annotations

from pathlib import Path

import pytest

api = pytest.importorskip("pyflakes.api")
from pyflakes import messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("hf_ropekv", "kernels", "benchmarks", "examples", "tests")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(Reporter):
    def __init__(self) -> None:
        super().__init__(None, None)
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")


def test_no_undefined_names() -> None:
    reporter = _Collect()
    # resolved, so a file reached twice (a local hf_ropekv/kernels link to kernels/) is read once
    files = sorted({path.resolve() for folder in FOLDERS for path in (REPO / folder).rglob("*.py")})
    assert len(files) > 100
    for path in files:
        api.checkPath(str(path), reporter)
    assert reporter.found == []


def test_the_check_sees_an_undefined_name(tmp_path: Path) -> None:
    """The check can fail: the fault it was written for, in miniature."""
    source = tmp_path / "capture.py"
    source.write_text("def record(state):\n    return (state, cache)\n")
    reporter = _Collect()
    api.checkPath(str(source), reporter)
    assert len(reporter.found) == 1 and "undefined name 'cache'" in reporter.found[0]
