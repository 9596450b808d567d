"""Run model-written Python programs in isolated subprocesses (program-aided GSM8K in ``quality.py``).

A program is a model's untrusted text. Each one runs in a fresh interpreter:

* ``sys.executable -I -S``: isolated mode (no ``PYTHON*`` variables, no user site, the script's folder not on
  ``sys.path``) and no ``site`` (no site-packages: the standard library only);
* in a new temporary directory (its working directory and ``HOME``), deleted afterwards, with a minimal
  environment (``PATH``, ``LANG``, ``HOME``, no proxies);
* in its own session, killed as a process group after ``timeout`` seconds of wall time;
* with resource limits set before the program runs (where ``resource`` exists): CPU seconds, address space,
  size of any file written (stdout included: it goes to a file, so a program that prints forever is stopped by
  the limit, not by filling the parent's memory), no core files, no new processes;
* without network: the child replaces ``socket.socket``, ``socket.create_connection``, ``socket.getaddrinfo``
  and ``socket.socketpair`` (and ``_socket``'s) with functions that raise before the program runs.

This is a guard against accidents (an endless loop, a huge list, a stray download), not a security boundary
against a hostile program: the program still runs as this user. Programs run in parallel on a small thread pool,
each thread waiting on one child process (:class:`ProgramPool`), so scoring one batch's programs overlaps the
next batch's generation.

The answer of a program is the last number it printed (:func:`last_number`), with float noise (``0.1 * 3``)
rounded away at ``ANSWER_DECIMALS`` decimals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0
MEMORY_LIMIT_BYTES = 1 << 30  # address space of a program
OUTPUT_LIMIT_BYTES = 1 << 20  # bytes a program may write to any file, stdout and stderr included
ANSWER_DECIMALS = 6  # printed numbers are rounded here: 0.30000000000000004 -> 0.3

#: Outcomes of :func:`run_program`; all but ``ok`` count as a wrong answer and as a program error.
OK, TIMEOUT, ERROR, NO_OUTPUT, NO_NUMBER = "ok", "timeout", "error", "no_output", "no_number"
STATUSES = (OK, TIMEOUT, ERROR, NO_OUTPUT, NO_NUMBER)

# The same number syntax as gsm8k.NUMBER (thousands separators only in groups of three).
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "python3", "py"}

# Run by the child before the program: no network, resource limits, then the program as __main__.
_BOOTSTRAP = r"""
import sys
class _no_network:  # a class, so that modules subclassing socket.socket (ssl) still import
    def __new__(cls, *args, **kwargs):
        raise PermissionError("network access is disabled for this program")
import socket, _socket
for _module in (socket, _socket):
    for _name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd", "create_server"):
        if hasattr(_module, _name):
            setattr(_module, _name, _no_network)
try:
    import resource
except ImportError:
    resource = None
if resource is not None:
    cpu, memory, output = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    for _limit, _value in (("RLIMIT_CPU", cpu), ("RLIMIT_AS", memory), ("RLIMIT_FSIZE", output),
                           ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 0)):
        if hasattr(resource, _limit):
            try:
                resource.setrlimit(getattr(resource, _limit), (_value, _value))
            except (ValueError, OSError):
                pass
with open(sys.argv[1], encoding="utf-8") as _f:
    _code = compile(_f.read(), "program.py", "exec")
del _f, _module, _name, _no_network
sys.argv = ["program.py"]
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class ProgramResult:
    """What one program did: its status (one of ``STATUSES``), the last number it printed (normalised, or
    ``None``), and the tails of its stdout / stderr (for the results file)."""

    status: str
    answer: str | None
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


def extract_program(text: str) -> str:
    """The program in a model's reply: the first fenced block tagged ``python`` (or ``py`` / ``python3``), else
    the first fenced block of any tag, else the whole text. A fence the generation never closed runs to the end
    of the text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for tag, body in blocks:
        if tag in _PYTHON_TAGS:
            return body
    if blocks:
        return blocks[0][1]
    return text


def last_number(output: str) -> str | None:
    """The last number in a program's output, normalised (``"1,234.50"`` -> ``"1234.5"``) and rounded to
    ``ANSWER_DECIMALS`` decimals; ``None`` if it printed no number."""
    numbers = _NUMBER.findall(output)
    if not numbers:
        return None
    try:
        value = Decimal(numbers[-1].replace(",", ""))
    except InvalidOperation:
        return None
    value = value.quantize(Decimal(1).scaleb(-ANSWER_DECIMALS), rounding=ROUND_HALF_EVEN)
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _minimal_env(home: str) -> dict[str, str]:
    return {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home, "TMPDIR": home}


def _tail(path: Path, limit: int = 2000) -> str:
    data = path.read_bytes() if path.is_file() else b""
    return data[-limit:].decode("utf-8", errors="replace")


def run_program(code: str, timeout: float = DEFAULT_TIMEOUT_S) -> ProgramResult:
    """Run ``code`` in an isolated interpreter (see the module docstring) and read its answer.

    Status: ``timeout`` (killed after ``timeout`` s), ``error`` (a non-zero exit: an exception, a limit, a
    signal), ``no_output`` (exited 0, printed nothing), ``no_number`` (printed no number), else ``ok``."""
    with tempfile.TemporaryDirectory(prefix="pot_") as tmp:
        folder = Path(tmp)
        script, out_path, err_path = folder / "program.py", folder / "stdout.txt", folder / "stderr.txt"
        script.write_text(code, encoding="utf-8")
        cpu = max(1, int(timeout) + 1)
        argv = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(script), str(cpu), str(MEMORY_LIMIT_BYTES),
                str(OUTPUT_LIMIT_BYTES)]
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(argv, cwd=folder, env=_minimal_env(tmp), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True)
            try:
                code_ = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return ProgramResult(TIMEOUT, None, _tail(out_path), _tail(err_path))
            finally:
                _kill_group(proc)  # whatever it started in its session goes with it
        stdout, stderr = _tail(out_path), _tail(err_path)
    if code_ != 0:
        return ProgramResult(ERROR, None, stdout, stderr)
    if not stdout.strip():
        return ProgramResult(NO_OUTPUT, None, stdout, stderr)
    answer = last_number(stdout)
    return ProgramResult(OK if answer is not None else NO_NUMBER, answer, stdout, stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class ProgramPool:
    """Runs programs ``workers`` at a time in the background: :meth:`submit` returns at once with a future of
    :class:`ProgramResult`, so the caller can go on generating. Use as a context manager (or call
    :meth:`close`)."""

    def __init__(self, workers: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1; got {workers}")
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pot")

    def submit(self, code: str) -> Future:
        return self._executor.submit(run_program, code, self.timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "ProgramPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_workers() -> int:
    """Workers for a machine: its cores less two (the generating process and the tokenizer), between 1 and 8."""
    return max(1, min(8, (os.cpu_count() or 2) - 2))
