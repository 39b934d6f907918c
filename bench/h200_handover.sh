#!/usr/bin/env bash
# Issue 19 on the H200 (device tool), one part per call, each bounded well under 8 minutes:
#   WHEELS=WHEEL_DIR bash bench/h200_handover.sh bench            # bench/kv_handover.py, single + pipelined
#   WHEELS=WHEEL_DIR bash bench/h200_handover.sh nixl             # issue 37: nixl vs cuda_ipc vs zmq, VRAM,
#       two processes on one GPU, 1k/8k/32k tokens of Llama-3-8B vs a device copy (WHEEL_DIR holds the
#       repacked NIXL wheel: bench/repack_nixl.py; without it the nixl rows say "skipped")
#   (the fixed cost per pull step by step: `bash bench/device_benches.sh nixl`)
#   WHEELS=WHEEL_DIR bash bench/h200_handover.sh transport        # tests/gpu/test_kv_transport_gpu.py
#   WHEELS=WHEEL_DIR bash bench/h200_handover.sh dcp-triton       # tests/gpu/test_dcp_gpu.py -k TRITON
#   WHEELS=WHEEL_DIR bash bench/h200_handover.sh dcp-flashinfer   # tests/gpu/test_dcp_gpu.py -k FLASHINFER
# Key numbers and failures go to stdout; full logs to $OUT. dcp-flashinfer packs the FlashInfer
# modules it built into $OUT/fi_aot.tgz (bench/h200_env.sh loads them from WHEEL_DIR next time).
set -u
PART=${1:?part: bench, nixl, transport, dcp-triton or dcp-flashinfer}
WHEELS=${WHEELS:?set WHEELS to the FlashInfer wheel dir}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
git log --oneline -1 2>/dev/null
tests() {  # log name, timeout, pytest args...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=8 "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after ${SECONDS}s"
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/$name.log" | cut -c1-220 | head -30
    sed -n '/slowest .* durations/,/^$/p' "$OUT/$name.log" | head -12
    tail -2 "$OUT/$name.log"
}
pack() {  # compiled FlashInfer modules, as <name>/<name>.so
    local d
    d=$(ls -d /tmp/fiws/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
    [ -n "$d" ] && (cd "$d" && ls -d */ | wc -l | sed 's/^/FlashInfer modules built: /' && tar -czf "$OUT/fi_aot.tgz" */*.so 2>/dev/null)
}
SECONDS=0
case "$PART" in
    bench)
        timeout 450 python3 -m bench.kv_handover --device cuda --sizes 1024,8192,32768 \
            --transports zmq,cuda_ipc,cuda_ipc-verify --reps 5 --burst 8 --burst-reps 3 --out "$OUT" \
            > "$OUT/kv_handover.log" 2>&1
        echo "kv_handover: exit $? after ${SECONDS}s"
        grep -vE "^\s*$" "$OUT/kv_handover.log" | tail -40 ;;
    nixl)
        timeout 480 python3 -m bench.kv_handover --device cuda --sizes 1024,8192,32768 \
            --transports nixl,cuda_ipc,zmq --burst-transports nixl,cuda_ipc --reps 5 --burst 4 --burst-reps 3 \
            --out "$OUT" > "$OUT/kv_handover_nixl.log" 2>&1
        echo "kv_handover nixl: exit $? after ${SECONDS}s"
        grep -vE "^\s*$" "$OUT/kv_handover_nixl.log" | tail -30 ;;
    transport) tests transport 450 tests/gpu/test_kv_transport_gpu.py tests/gpu/test_nixl_gpu.py ;;
    dcp-triton) tests dcp_triton 450 tests/gpu/test_dcp_gpu.py -k TRITON ;;
    dcp-flashinfer)
        tests dcp_flashinfer 450 tests/gpu/test_dcp_gpu.py -k FLASHINFER
        pack ;;
    *) echo "unknown part $PART"; exit 2 ;;
esac
