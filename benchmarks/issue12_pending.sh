#!/usr/bin/env bash
# The issue-12 checks still to run on one H200, as two device calls of under 10 minutes each, writing at most 8
# files under $OUT (what the device tool brings back). Every log is kept whole.
#
#   stage a (~9 min):
#     1. the CUDA tests of the static cache and the grouped attention (gpu_tests.txt);
#     2. the capacity at 32K under an 80 GiB cap: DynamicCache from batch 9 (its largest, measured), the static
#        cache from 180 (cap/compiled_decode.{md,json});
#     3. bf16 exactness, compiled static against eager static over 256 steps (exact/static_exactness.{md,json});
#     4. the eager default against DynamicCache at batch 1, 4K, in a fresh process (ho/host_overhead.{md,json}).
#   stage b (~8 min): batch 16 at 32K, the four variants (b16/compiled_decode.{md,json}).
#   stage c (~5 min): batch 16 at 16K, the four variants, compiled ones timed after their warm-up (b16/...).
#   stage w (~9 min): the CUDA tests of the static cache (gpu_tests.txt), then batch 16 at 32K with the prefill in
#                     chunks, DynamicCache and the compiled static cache only: the compile warm-up with a chunked
#                     prefill (b16/compiled_decode.{md,json}).
#   stage h (~7 min): the eager default against DynamicCache at batch 1, 4K and 32K, HO_REPEATS (default 6)
#                     alternated rounds with paired ratios (ho/host_overhead.{md,json}).
#
#   stage l (~6 min): the CUDA tests of the static cache (gpu_tests.txt), then the eager default against DynamicCache
#                     at batch 1, 4K and 32K, in lockstep (lockstep_decode.py: one model per cache, one step at a
#                     time, every thread on one core), 4 rounds of 256 steps and a cProfile of 64 steps per cache
#                     (ls/lockstep_decode.{md,json}); the steadiest reading of the eager target.
#
#   OUT=... bash benchmarks/issue12_pending.sh COMMIT a|b|c|h|l|w  # from the repository root, on the GPU machine
#   (stage a: CAP_VARIANTS, CAP_BATCHES, CAP_RUNS choose the capacity runs; SKIP_EXACT=1 leaves out step 3)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
COMMIT=${1:?give the commit measured}
STAGE=${2:?give the stage: a or b}
OUT=${OUT:?set OUT to the folder the results go to}
ln -sfn ../kernels hf_ropekv/kernels
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
quiet() { grep -v "cudagraph_utils\|UserWarning\|warnings.warn"; }
if [ "$STAGE" = a ]; then
    timeout 150 python -m pytest -q -p no:cacheprovider -p no:logging -rA -m gpu tests/test_static_cache.py \
        tests/test_attention.py > "$OUT/gpu_tests.txt" 2>&1
    tail -4 "$OUT/gpu_tests.txt"
    cd benchmarks
    timeout 330 python compiled_decode.py --points none --capacity --capacity-prompt 4096 \
        --capacity-variants ${CAP_VARIANTS:-dynamic,ropekv_static} --capacity-batches ${CAP_BATCHES:-9,180} \
        --capacity-runs ${CAP_RUNS:-2} --out "$OUT/cap" --commit "$COMMIT" --max-minutes 5 2>&1 \
        | quiet > "$OUT/log.txt"
    [ -n "${SKIP_EXACT:-}" ] || timeout 110 python static_exactness.py --out "$OUT/exact" --commit "$COMMIT" 2>&1 | quiet >> "$OUT/log.txt"
    timeout 150 python host_overhead.py --out "$OUT/ho" --device cuda --shape qwen3-8b --contexts 4096 \
        --repeats 1 --commit "$COMMIT" 2>&1 | quiet >> "$OUT/log.txt"
    tail -12 "$OUT/cap/compiled_decode.md" 2>/dev/null; cat "$OUT/ho/host_overhead.md" 2>/dev/null
    head -12 "$OUT/exact/static_exactness.md" 2>/dev/null
elif [ "$STAGE" = w ]; then
    timeout 200 python -m pytest -q -p no:cacheprovider -p no:logging -rA -m gpu tests/test_static_cache.py \
        > "$OUT/gpu_tests.txt" 2>&1
    tail -4 "$OUT/gpu_tests.txt"
    cd benchmarks
    timeout 380 python compiled_decode.py --points 16x32768 --prefill-chunk auto --variants dynamic,ropekv_static \
        --repeats 1 --out "$OUT/b16" --commit "$COMMIT" --max-minutes 5 2>&1 | quiet > "$OUT/log.txt"
    tail -25 "$OUT/b16/compiled_decode.md" 2>/dev/null || tail -30 "$OUT/log.txt"
elif [ "$STAGE" = l ]; then
    timeout 150 python -m pytest -q -p no:cacheprovider -p no:logging -rA -m gpu tests/test_static_cache.py \
        > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
    cd benchmarks
    timeout 420 python lockstep_decode.py --device cuda --shape qwen3-8b --contexts 4096 32768 --steps 256 \
        --rounds 4 --cprofile 64 --pin-core -1 --variants DynamicCache RopeKVCache --out "$OUT/ls" --commit "$COMMIT" 2>&1 \
        | quiet > "$OUT/log.txt"
    cat "$OUT/ls/lockstep_decode.md" 2>/dev/null || tail -30 "$OUT/log.txt"
elif [ "$STAGE" = h ]; then
    cd benchmarks
    timeout 560 python host_overhead.py --out "$OUT/ho" --device cuda --shape qwen3-8b --contexts 4096 32768 \
        --repeats ${HO_REPEATS:-6} --commit "$COMMIT" 2>&1 | quiet > "$OUT/log.txt"
    cat "$OUT/ho/host_overhead.md" 2>/dev/null || tail -30 "$OUT/log.txt"
elif [ "$STAGE" = c ]; then
    cd benchmarks
    timeout 420 python compiled_decode.py --points 16x16384 --repeats 1 --out "$OUT/b16" \
        --commit "$COMMIT" --max-minutes 6.5 2>&1 | quiet > "$OUT/log.txt"
    tail -25 "$OUT/b16/compiled_decode.md" 2>/dev/null || tail -30 "$OUT/log.txt"
else
    cd benchmarks
    timeout 560 python compiled_decode.py --points 16x32768 --prefill-chunk auto --repeats 1 --out "$OUT/b16" \
        --commit "$COMMIT" --max-minutes 8.3 2>&1 | quiet > "$OUT/log.txt"
    tail -25 "$OUT/b16/compiled_decode.md" 2>/dev/null || tail -30 "$OUT/log.txt"
fi
