#!/usr/bin/env bash
# one device call: A/B of the fused norms, then the GPU suite (bounded to ~350 s)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | tail -2
timeout 85 python3 benchmarks/pending/fused_norms_ab.py main ab 2>&1 | grep -v Warning | tail -30
PYTEST_ADDOPTS="--durations=5" GPU_TIMEOUT=250 bash .ci/gpu "$1" 2>&1 | tail -16
