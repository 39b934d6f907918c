# Device calls (<= 10 minutes each), one part per call; each prints its table last and leaves
# JSON/PNG/logs under $OUT. Source bench/device_setup.sh first (NO_FLASHINFER=1 unless the call
# carries a FlashInfer folder):
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh serve
#       issue 41: the serving path (serve's defaults, HTTP and gRPC) against the in-process engine on
#       the Llama-3-8B shape, three alternating rounds, then structured outputs at batch 64 (issue 38)
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh nixl      (carry .whlnixl)
#       issue 37: the NIXL GPU tests, then NIXL vs CUDA IPC vs zmq, VRAM, two processes on one GPU,
#       1k/8k/32k tokens of Llama-3-8B against a device copy, then the GPU tests no call has run yet
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh tests mla fused_moe ...
#       the GPU test files named (tests/gpu/test_<name>_gpu.py), each under 120 s, logs in $OUT
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh disagg    (carry .whl .whlnixl .whlray)
#       issue 37: TTFT of `serve --pools disaggregated` against unified, 8k-token prompts of the
#       Llama-3-8B shape, C = 1 and 4 (bench/disagg_ttft.py; on one GPU the disaggregated server runs
#       with --gpus-per-rank 0.5, both replicas on the GPU, KV by CUDA IPC, 8 GiB of KV per replica).
#       The prefill and decode replicas are Ray actors and the device has no Ray: .whlray holds the
#       Ray Core repack (bench/repack_ray.py; recipe in bench/device_setup.sh). The three folders and
#       the tree come to about 63.5 of the 64 MiB a call carries (2026-12-05): check with
#       `du -cb .whl .whlnixl .whlray $(git ls-files)` first; without .whlnixl, auto picks another transport.
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh tests gpu_share    (carry .whl .whlray)
#       `serve --pools disaggregated --gpus-per-rank 0.5` on one GPU (tests/gpu/test_gpu_share_gpu.py): Ray too
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh fi07      (carry .whlfi07)
#       issue 42: FlashInfer 0.7 modules built or completed (bench/flashinfer_aot.sh, resumes from
#       .whlfi07/fi07_cache.tgz), then every backend timed per problem class (bench/attention_choice.py),
#       merged into a copy of the kernel-choice table under $OUT
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
SECONDS=0
tests() {  # log name, timeout, pytest args...: failures and the summary line to stdout, the log to $OUT
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfEs "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? at ${SECONDS}s"
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/$name.log" | cut -c1-220 | head -20
    tail -1 "$OUT/$name.log"
}
case "${1:?part: serve, nixl, tests, disagg or fi07}" in
    serve)
        # Three alternating rounds (medians): the offline engine and the server side by side on one GPU,
        # so each gets 12 GiB of KV (two 16 GB weight copies + 2 x 12 GiB fit 80 GB). The one-round,
        # 32 GiB run of 2026-12-05 (docs/performance.md) had its TTFTs on both sides of offline's.
        timeout 500 python3 -m bench.serve_vs_offline --device cuda --shape llama3-8b --deadline 420 --rounds 3 \
            --kv-cache-memory-bytes $((12 << 30)) --paths offline,http,grpc --out "$OUT" 2>&1 | tail -30
        timeout $((580 - SECONDS)) python3 -m bench.structured_outputs --device cuda --dtype bfloat16 --rounds 4 \
            --tag gpu 2>&1 | tail -8
        cp bench/results/structured_outputs-gpu.* "$OUT"/ 2>/dev/null || true ;;
    nixl)
        tests nixl_gpu 90 tests/gpu/test_nixl_gpu.py
        timeout 200 python3 -m bench.kv_handover --device cuda --sizes 1024,8192,32768 \
            --transports nixl,cuda_ipc,zmq --burst-transports nixl,cuda_ipc --reps 5 --burst 4 --burst-reps 3 \
            --out "$OUT" > "$OUT/kv_handover_nixl.log" 2>&1
        echo "kv_handover nixl: exit $? at ${SECONDS}s"
        grep -vE "^\s*$" "$OUT/kv_handover_nixl.log" | tail -30
        BUDGET=$((560 - SECONDS)) bash "$0" tests kv_transport hybrid fused_ops quant prefill_desc structured_graphs mla mla_sparse fused_moe ;;
    tests)  # tests/gpu/test_<name>_gpu.py for each name given, each within 120 s, all within $BUDGET s (560)
        shift
        for f in "$@"; do
            left=$((${BUDGET:-560} - SECONDS))
            [ "$left" -lt 30 ] && { echo "not run (time): $f"; continue; }
            tests "gpu_$f" $((left < 120 ? left : 120)) "tests/gpu/test_${f}_gpu.py"
        done ;;
    fi07)
        BUILD_TIMEOUT=240 VERIFY_TIMEOUT=90 bash bench/flashinfer_aot.sh .whlfi07
        cp meshserve/attention/kernel_choice.json "$OUT/"
        PYTHONPATH=/tmp/site07:$PYTHONPATH timeout $((580 - SECONDS)) python3 -m bench.attention_choice --out "$OUT" \
            --write "$OUT/kernel_choice.json" 2>&1 | tail -60 ;;
    disagg)
        timeout 540 python3 -m bench.disagg_ttft --device cuda --shape llama3-8b --deadline 300 --out "$OUT" \
            --logs "$OUT" 2>&1 | tail -30 ;;
    *) echo "unknown part $1"; exit 2 ;;
esac
