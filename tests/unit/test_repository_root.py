"""Python started in the repository root must work: the Triton kernels' folder ``kernels/`` sits there, and
HuggingFace publishes a package named ``kernels`` that transformers >= 5.25 imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import hf_ropekv.kernels, pathlib, sys
from transformers import AutoModelForCausalLM, LlamaConfig
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
model = AutoModelForCausalLM.from_config(config)
assert pathlib.Path(hf_ropekv.kernels.__file__).parent == pathlib.Path.cwd() / "kernels", hf_ropekv.kernels.__file__
try:
    import kernels
except ImportError:  # HuggingFace's package is not installed here: nothing may pretend it is
    print("no kernels package")
else:
    assert getattr(kernels, "__file__", None) is None or "site-packages" in kernels.__file__, kernels.__file__
    print("kernels:", getattr(kernels, "__file__", None))
"""


def test_python_started_in_the_repository_root_builds_a_model() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
