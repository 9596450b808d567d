"""What generate_paired.py and step_interleaved.py both import: benchmarks/ on the path, this checkout's hf_ropekv
and, when BASE names a folder holding an older copy renamed hf_ropekv_base, that copy (else None)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # benchmarks/
sys.path.insert(0, os.environ.get("BASE", HERE))

import hf_ropekv  # noqa: E402
import hf_ropekv.scorers  # noqa: E402,F401

try:
    import hf_ropekv_base
    import hf_ropekv_base.scorers  # noqa: F401
except ImportError:
    hf_ropekv_base = None
