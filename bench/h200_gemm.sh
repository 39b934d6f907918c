#!/usr/bin/env bash
# Issue 24 / issue 18 item 2 on the H200 (device tool): the GEMM GPU tests, then bench/quant_gemm.py.
# Logs, JSON and PNG go to $OUT; prints the test verdict and the bench's summary table last.
#   bash bench/h200_gemm.sh            (about 5 min: tests <= 300 s, bench < 2 min)
#   BENCH_TIMEOUT=500 TEST_TIMEOUT=60 bash bench/h200_gemm.sh --sweep   (the sweep alone adds ~3 min)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=/tmp/tcache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
SECONDS=0
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_quant_gpu.py \
    > "$OUT/tests.log" 2>&1
echo "gpu tests exit $? after ${SECONDS}s"
grep -E "^(FAILED|ERROR)|^E  " "$OUT/tests.log" | cut -c1-220 | head -30
tail -2 "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-290}" python3 bench/quant_gemm.py --out "$OUT" --reps 20 "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $? after ${SECONDS}s"
sed -n '/^summary:/,$p' "$OUT/bench.log"
grep -E "unavailable|DISAGREE|failed|Error" "$OUT/bench.log" | head -10
