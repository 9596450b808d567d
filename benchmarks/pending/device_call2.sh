#!/usr/bin/env bash
# the second device call, on a warm machine (issue 46): batch 32 step, then first token in fresh processes
export PYTHONUNBUFFERED=1
python3 -c "import hf_ropekv" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | tail -2
timeout 300 python3 benchmarks/speed.py --points 32x4096 --caches dynamic,ropekv --commit "$1" --max-minutes 4.5 --out $OUT/speed_32x4096.json 2>&1 | grep -v Warning | tail -8
timeout 250 python3 benchmarks/speed.py --points none --e2e --e2e-new-tokens 32 --e2e-rounds 2 --commit "$1" --out $OUT/speed_ttft.json 2>&1 | grep -v Warning | tail -10
timeout 130 python3 benchmarks/pending/fused_norms_ab.py main fresh 2>&1 | grep -v Warning | tail -60
