#!/usr/bin/env bash
# Download the wheels the benchmark suite needs on the GPU machine into .whl/ (gitignored), for Python 3.12 on
# x86-64 Linux. That machine reaches no package index; the wheels travel with the work tree (carry: [".whl"]).
#
#   bash benchmarks/fetch_wheels.sh            # optimum-quanto (memory.py: QuantizedCache), gguf (quality.py: GGUF models)
#   bash benchmarks/fetch_wheels.sh NAME==VER  # ...plus more wheels, same platform tags
#   bash benchmarks/fetch_wheels.sh bitsandbytes==0.50.2   # for the NF4 test in tests/test_quantized.py (43 MB:
#                                                          # fits the 64 MiB the device tool carries)
#
# Both are pure Python (py3-none-any). optimum-quanto 0.2.7 needs torch, ninja, numpy, safetensors and huggingface_hub;
# gguf 0.19.0 needs numpy, pyyaml, requests and tqdm: the GPU image has all of them, so nothing else is fetched.
# (ninja only serves quanto's C++/CUDA extensions; memory.py serves the one operation it needs from those, int4
# unpack, with quanto's own PyTorch code, so nothing is compiled there.)
#
# On the GPU machine (see benchmarks/README.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
PY=${PYTHON:-python3}
WHEELS=("optimum-quanto==0.2.7" "gguf==0.19.0" "$@")
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "${WHEELS[@]}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true

echo
echo "== wheels in .whl/"
ls -l .whl/*.whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024)) KiB"
if (( total > 20 * 1024 * 1024 )); then
    echo "WARNING: more than 20 MiB of wheels; a device call carries at most 64 MiB with the work tree" >&2
fi
echo
echo "== their requirements (the GPU image has torch, transformers, accelerate, numpy, safetensors,"
echo "   huggingface_hub and ninja; fetch anything else listed here too)"
for w in .whl/*.whl; do
    echo "-- $(basename "$w")"
    unzip -p "$w" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true
done
