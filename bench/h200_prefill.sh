#!/usr/bin/env bash
# One H200 run for issue 25 item 1: the TRITON prefill variants against FlashInfer
# (bench/prefill_sweep.py: checks every output first, then times), then their GPU tests.
#   bash bench/h200_prefill.sh WHEEL_DIR        (WHEEL_DIR: FlashInfer 0.5.3 wheels, as bench/h200.sh)
# Writes $OUT/prefill_sweep.{json,md,png,log} and $OUT/tests_prefill.log; prints the table.
set -u
WHEELS=${1:?wheel dir}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_env.sh"
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
