#!/usr/bin/env bash
# One H200 run for issue 25 item 1: the TRITON prefill variants against FlashInfer
# (bench/prefill_sweep.py: checks every output first, then times), then their GPU tests.
#   bash bench/h200_prefill.sh WHEEL_DIR        (WHEEL_DIR: FlashInfer 0.5.3 wheels, as bench/h200.sh)
# Writes $OUT/prefill_sweep.{json,md,png,log} and $OUT/tests_prefill.log; prints the table.
set -u
WHEELS=${1:?wheel dir}
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
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
SECONDS=0
timeout "${BENCH_TIMEOUT:-240}" python3 -m bench.prefill_sweep --out "$OUT" ${SWEEP_FLAGS:-} > "$OUT/prefill_sweep.log" 2>&1
echo "prefill sweep exit $? after ${SECONDS}s"
grep -E "WRONG|FAILED|Error" "$OUT/prefill_sweep.log" | cut -c1-200 | head -20
sed -n '/^| case/,$p' "$OUT/prefill_sweep.log"
SECONDS=0
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -n 4 tests/gpu/test_prefill_desc_gpu.py \
    > "$OUT/tests_prefill.log" 2>&1
echo "gpu tests exit $? after ${SECONDS}s"
grep -E "(FAILED|ERROR) tests" "$OUT/tests_prefill.log" | sed 's/ - .*//' | sort -u | head -20
grep -E "^E  " "$OUT/tests_prefill.log" | cut -c1-160 | sort | uniq -c | sort -rn | head -8
tail -1 "$OUT/tests_prefill.log"
