#!/usr/bin/env bash
# Issue 18 on the H200 (device tool): FlashInfer from WHEEL_DIR, the CUDA-graph GPU tests, then
# bench/e2e.py (meshserve against the compiled baseline). Logs go to $OUT.
#   bash bench/h200_decode.sh WHEEL_DIR "PYTEST TARGETS" "E2E FLAGS"
set -u
WHEELS=${1:?wheel dir}
TESTS=${2-tests/gpu/test_decode_graphs_gpu.py}
E2E=${3-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws TRITON_CACHE_DIR=/tmp/tcache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
SECONDS=0
if [ -n "$TESTS" ]; then
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rfEs $TESTS > "$OUT/tests.log" 2>&1
    echo "gpu tests exit $? after ${SECONDS}s"
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/tests.log" | cut -c1-220 | head -30
    tail -3 "$OUT/tests.log"
fi
if [ -n "$E2E" ]; then
    timeout "${E2E_TIMEOUT:-330}" python3 -m bench.e2e $E2E --out "$OUT" > "$OUT/e2e.log" 2>&1
    echo "e2e exit $? after ${SECONDS}s"
    grep -vE "^\s*$" "$OUT/e2e.log" | tail -30
fi
