#!/usr/bin/env bash
# The issue-12 checks still to run on one H200, in one device call of about 9 minutes, writing at most 8 files
# under $OUT (what the device tool brings back):
#
#   1. the CUDA tests of the static cache, whole output (gpu_tests.txt): decode replay, compiled chunked prefill;
#   2. the capacity at 32K under an 80 GiB cap: DynamicCache from batch 9 (its largest, measured), the static
#      cache from 180 (cap/compiled_decode.{md,json}, cap_log.txt);
#   3. the eager default against DynamicCache at batch 1, 4K, in a fresh process (ho/host_overhead.{md,json}).
#
#   bash benchmarks/issue12_pending.sh COMMIT         # from the repository root, on the GPU machine
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
COMMIT=${1:?give the commit measured}
OUT=${OUT:?set OUT to the folder the results go to}
ln -sfn ../kernels hf_ropekv/kernels
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 120 python -m pytest -q -p no:cacheprovider -rA -m gpu tests/test_static_cache.py > "$OUT/gpu_tests.txt" 2>&1
cd benchmarks
timeout 330 python compiled_decode.py --points none --capacity --capacity-prompt 4096 --capacity-batches 9,180 \
    --capacity-runs 2 --out "$OUT/cap" --commit "$COMMIT" --max-minutes 5 2>&1 \
    | grep -v "cudagraph_utils\|UserWarning\|warnings.warn" > "$OUT/cap_log.txt"
timeout 100 python host_overhead.py --out "$OUT/ho" --device cuda --shape qwen3-8b --contexts 4096 --repeats 1 \
    --commit "$COMMIT" > /dev/null 2>&1
tail -3 "$OUT/gpu_tests.txt"; tail -15 "$OUT/cap/compiled_decode.md" 2>/dev/null; cat "$OUT/ho/host_overhead.md" 2>/dev/null
