#!/usr/bin/env bash
# One session on the H200 (device tool): install the FlashInfer wheels, time the attention
# kernels side by side (bench/attention.py), run tests/gpu, and pack what was compiled.
#   bash bench/h200.sh WHEEL_DIR ["BENCH FLAGS"]
# FlashInfer JIT-builds each kernel variant on first use; the built modules are packed into
# $OUT/fi_aot.tgz, and a later session that finds WHEEL_DIR/fi_aot.tgz loads them as AOT modules.
set -u
WHEELS=${1:?wheel dir}
SWEEP=${2:-}  # bench/attention.py flags, e.g. "--sweep --no-prefill-sweep"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
pack() {  # compiled FlashInfer modules, as <name>/<name>.so
    local d
    d=$(ls -d /tmp/fiws/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
    [ -n "$d" ] && (cd "$d" && tar -czf "$OUT/fi_aot.tgz" */*.so 2>/dev/null)
}
gpu_tests() {  # name, timeout, pytest -k expression
    MAX_JOBS=4 timeout "$2" python3 -m pytest -v -p no:cacheprovider -n 4 -k "$3" tests/gpu > "$OUT/tests_$1.log" 2>&1
    echo "gpu tests ($1) exit $? after ${SECONDS}s"
    grep -E "(FAILED|ERROR) tests" "$OUT/tests_$1.log" | sed 's/ - .*//' | sort -u | head -20
    grep -E "^E  " "$OUT/tests_$1.log" | cut -c1-160 | sort | uniq -c | sort -rn | head -8
    tail -1 "$OUT/tests_$1.log"
}
SECONDS=0
timeout "${BENCH_TIMEOUT:-270}" python3 -m bench.attention $SWEEP --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench exit $? after ${SECONDS}s"
pack
grep -E "failed|Error|rel diff" "$OUT/bench.log" | cut -c1-200 | head -30
gpu_tests triton "${TEST_TIMEOUT:-150}" "not FLASHINFER"
gpu_tests flashinfer "${FI_TEST_TIMEOUT:-200}" "${FI_FILTER:-FLASHINFER}"
pack
sed -n '/^Best Triton sweep/,$p' "$OUT/bench.log"
ls -la "$OUT"
