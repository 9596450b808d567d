#!/usr/bin/env bash
# one device call (issue 46): A/B of the fused norms and the prefill profile, the GPU suite, then speed.py 1x4096
export PYTHONUNBUFFERED=1
T0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | tail -2
COMMIT=$1 timeout 120 python3 benchmarks/pending/fused_norms_ab.py main ab,prefill 2>&1 | grep -v Warning | tail -75
PYTEST_ADDOPTS="--durations=5" GPU_TIMEOUT=270 bash .ci/gpu "$1" 2>&1 | tail -14
LEFT=$(( 575 - (SECONDS - T0) ))
echo "speed.py gets ${LEFT}s"
timeout $LEFT python3 benchmarks/speed.py --points 1x4096 --commit "$1" --max-minutes $(python3 -c "print(round(($LEFT-40)/60,1))") --out $OUT/speed.json 2>&1 | grep -v Warning | tail -12
