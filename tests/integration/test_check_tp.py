"""RopeKVCache under transformers' tensor parallelism: ``benchmarks/tp_check.py`` launched by torchrun, 2 ranks.

The script stays a command of its own (an open issue asks for exactly
``torchrun --nproc_per_node 2 benchmarks/tp_check.py --device cuda``); these tests launch it and read the checks
it wrote: ``budget=None`` gives DynamicCache's tokens, both statistics sources evict within
``budget + compress_every`` with the same tokens on every rank, and each rank's attention saw its share of heads.
On 2 GPUs with NCCL (``multi_gpu``); on the CPU with gloo (``slow``: about 40 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SUBPROCESS_CWD

REPO = Path(__file__).resolve().parents[2]


def launch_tp_check(device: str, out: Path) -> dict:
    """Run the check on 2 ranks; its exit status must be 0 and every check it wrote true."""
    # Not from the repository root (SUBPROCESS_CWD): `-m` puts the working directory first on sys.path, and the
    # root's kernels/ would shadow HuggingFace's `kernels`; tp_check.py finds an uninstalled hf_ropekv itself.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "benchmarks" / "tp_check.py"), "--device", device, "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=SUBPROCESS_CWD,
    )
    assert proc.returncode == 0, f"tp_check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((out / "tp_check.json").read_text())
    assert result["world"] == 2 and result["checks"] and all(result["checks"].values()), result["checks"]
    return result


@pytest.mark.slow
def test_tp_check_on_cpu_with_gloo(tmp_path: Path) -> None:
    result = launch_tp_check("cpu", tmp_path)
    assert result["device"] == "cpu"
    # Two KV heads split over two ranks: each rank's cache and scorer hold one KV head's share.
    assert result["online statistics"]["local_kv_heads"] == 1


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_tp_check_on_two_gpus_with_nccl(tmp_path: Path) -> None:
    result = launch_tp_check("cuda", tmp_path)
    assert result["device"].startswith("cuda")
