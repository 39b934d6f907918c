#!/usr/bin/env bash
# Issue 24 / issue 18 item 2 on the H200 (device tool): the quant GPU tests, then bench/quant_gemm.py.
# Logs, JSON and PNG go to $OUT; prints the test verdict, then the bench's summary table last
# (per M: bf16, per-tensor, blockwise torch, block path as wired, online per-channel as wired,
# the dispatch table the numbers suggest, and the 32-layer decode graph proxy).
#   bash bench/h200_gemm.sh            (cold machine: tests <= TEST_TIMEOUT s in SHARDS parallel
#                                       processes, Triton compiles being most of it; bench <= BENCH_TIMEOUT s)
#   BENCH_TIMEOUT=420 TEST_TIMEOUT=1 bash bench/h200_gemm.sh --sweep   (the sweep alone adds ~3 min)
set -u
OUT=${OUT:-/tmp/out}
SHARDS=${SHARDS:-8}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=/tmp/tcache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
SECONDS=0
# The tests, round-robin over SHARDS processes on the one GPU: a cold run is Triton compiles (CPU),
# which one process does serially (the sixth session's cold run did 41 tests in 170 s).
python3 -m pytest --collect-only -q -p no:cacheprovider tests/gpu/test_quant_gpu.py 2>/dev/null | grep '::' \
    > "$OUT/test_ids.txt"
echo "collected $(wc -l < "$OUT/test_ids.txt") GPU tests, $SHARDS shards"
for i in $(seq 0 $((SHARDS - 1))); do
    awk -v n="$SHARDS" -v i="$i" 'NR % n == i' "$OUT/test_ids.txt" > "$OUT/shard$i.txt"
    [ -s "$OUT/shard$i.txt" ] || { echo "shard $i: no tests" > "$OUT/tests$i.log"; continue; }
    # shellcheck disable=SC2046
    timeout "${TEST_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider -rfEs $(cat "$OUT/shard$i.txt") \
        > "$OUT/tests$i.log" 2>&1 &
done
wait
echo "gpu tests done after ${SECONDS}s"
for i in $(seq 0 $((SHARDS - 1))); do
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/tests$i.log" | cut -c1-240 | head -12
    echo "shard $i: $(tail -1 "$OUT/tests$i.log" | cut -c1-200)"
done
timeout "${BENCH_TIMEOUT:-170}" python3 bench/quant_gemm.py --out "$OUT" --reps 20 "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $? after ${SECONDS}s"
grep -E "unavailable|DISAGREE|failed|Error|blockwise probe" "$OUT/bench.log" | cut -c1-240 | head -14
sed -n '/^summary/,$p' "$OUT/bench.log" | grep -v '^blockwise probe'
