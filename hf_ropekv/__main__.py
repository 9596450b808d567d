"""Command line: ``python -m hf_ropekv calibrate --model ... --text ... --out stats.safetensors``."""

from __future__ import annotations

import sys
from typing import Sequence

from .statistics.calibration import main as calibrate_main


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``python -m hf_ropekv calibrate ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "calibrate":
        print("usage: python -m hf_ropekv {calibrate} ...  (then --help)", file=sys.stderr)
        return 2
    return calibrate_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
