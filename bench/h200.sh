#!/usr/bin/env bash
# One session on the H200 (device tool): install the FlashInfer wheels, time the attention
# kernels side by side (bench/attention.py), run tests/gpu, and pack what was compiled.
#   bash bench/h200.sh WHEEL_DIR [--sweep] [TEST_FILTER]
# FlashInfer JIT-builds each kernel variant on first use; the built modules are packed into
# $OUT/fi_aot.tgz, and a later session that finds WHEEL_DIR/fi_aot.tgz loads them as AOT modules.
set -u
WHEELS=${1:?wheel dir}
SWEEP=${2:-}
FILTER=${3:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws TRITON_CACHE_DIR=/tmp/tcache
if [ -f "$WHEELS/fi_aot.tgz" ]; then
    mkdir -p /tmp/site/flashinfer/data/aot && tar -xzf "$WHEELS/fi_aot.tgz" -C /tmp/site/flashinfer/data/aot
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
pack() {  # compiled FlashInfer modules, as <name>/<name>.so
    local d
    d=$(ls -d /tmp/fiws/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
    [ -n "$d" ] && (cd "$d" && tar -czf "$OUT/fi_aot.tgz" */*.so 2>/dev/null)
}
SECONDS=0
timeout "${BENCH_TIMEOUT:-270}" python3 -m bench.attention $SWEEP --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench exit $? after ${SECONDS}s"
pack
grep -E "failed|Error|rel diff" "$OUT/bench.log" | head -30
MAX_JOBS=4 timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -n 4 -k "${FILTER}" \
    tests/gpu > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $? after ${SECONDS}s"
pack
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25
sed -n '/^Best Triton sweep/,$p' "$OUT/bench.log"
ls -la "$OUT"
