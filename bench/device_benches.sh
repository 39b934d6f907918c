# Device calls (<= 10 minutes each), one part per call; each prints its table last and leaves
# JSON/PNG/logs under $OUT. Source bench/device_setup.sh first (NO_FLASHINFER=1 unless the call
# carries a FlashInfer folder). Every call carries .whl; the parts that start `meshserve serve`
# (serve, latency, disagg, tests gpu_share) carry .whlserve too; bench/device_wheels.sh makes them:
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh serve      (carry .whl .whlserve)
#       issue 41: the serving path (serve's defaults, HTTP and gRPC) against the in-process engine on
#       the Llama-3-8B shape, three alternating rounds, then structured outputs at batch 64 (issue 38)
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh nixl      (carry .whl .whlnixl)
#       issue 37: the NIXL GPU tests, then the fixed cost of a pull step by step (NIXL, CUDA IPC batched
#       and a memcpy per frame; VRAM, two processes on one GPU, 1k/8k/32k tokens of Llama-3-8B against a
#       device copy), then the GPU tests no call has finished yet
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh tests mla fused_moe ...
#       the GPU test files named (tests/gpu/test_<name>_gpu.py), each under 120 s, logs in $OUT
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh disagg    (carry .whl .whlserve .whlray)
#       issue 37: TTFT of `serve --pools disaggregated` against unified, 8k-token prompts of the
#       Llama-3-8B shape, C = 1 and 4 (bench/disagg_ttft.py; on one GPU the disaggregated server runs
#       with --gpus-per-rank 0.5, both replicas on the GPU, KV by CUDA IPC, 8 GiB of KV per replica).
#       The prefill and decode replicas are Ray actors and the device has no Ray: .whlray holds the
#       Ray Core repack (bench/repack_ray.py; recipe in bench/device_setup.sh). .whl, .whlray and the
#       tree come to 59.4 MB of the 64 MiB (67.1 MB) a call carries, with .whlnixl too to 67.4 MB
#       (2026-12-05): on one GPU `auto` moves KV by CUDA IPC, so leave .whlnixl out. Check with
#       `du -cb .whl .whlserve .whlray $(git ls-files)` first (2026-12-06: the serving wheels moved to .whlserve).
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh tests gpu_share    (carry .whl .whlserve .whlray)
#       `serve --pools disaggregated --gpus-per-rank 0.5` on one GPU (tests/gpu/test_gpu_share_gpu.py): Ray too
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh latency    (carry .whl .whlserve; + .whluv for the uvloop paths)
#       issue 41: served time to first token against offline, one request at a time, hop by hop; with
#       serve --paced-overlap beside serve's defaults (-paced paths)
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh fi07      (carry .whl .whlfi07)
#       issue 42: FlashInfer 0.7 modules built or completed (bench/flashinfer_aot.sh, resumes from
#       .whlfi07/fi07_cache.tgz), then every backend timed per problem class (bench/attention_choice.py),
#       merged into a copy of the kernel-choice table under $OUT
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh moe
#       issue 41 item 3: the MoE shapes end to end at full depth (bench/e2e.py: DeepSeek-V2-Lite, 27
#       layers, 31.4 GB bf16; GPT-OSS-20B, 24 layers, 41.8 GB), decode steps at bs 1/64/256 against
#       their bytes roofline (bandwidth: a device copy measured in each run), `generate` at bs 64
#   . bench/device_setup.sh && bash bench/device_benches.sh e2e42      (carry .whl .whlfi07)
#       issue 42 item 5: 8B shape, TTFT 4k/16k and the bs-1 step, TRITON then the default, then FP8
#       weights (--quantization fp8), then FP8 weights with the LM head in FP8 (--quantize-lm-head)
#   . bench/device_setup.sh && bash bench/device_benches.sh fp8head    (carry .whl .whlfi07, as e2e42)
#       issue 42 item 4 alone: the 8B bs-1 decode step in bf16, FP8 weights, FP8 weights + FP8 LM head,
#       no TTFT (the three e2e.py runs of e2e42 that item 4 needs, side by side in one call)
#   . bench/device_setup.sh && bash bench/device_benches.sh ttft      (carry .whl .whlfi07)
#       issue 42 item 5 after the fresh-prefill defaults: the 8B shape's TTFT at 4k/16k and bs-1 step, TRITON
#       forced then the default (FLASHINFER's ragged prefill), then the GPU tests of the new defaults (fresh
#       prefill, TRITON's FlashMLA-structured MLA decode, FlashInfer's kernels) within the call
#   . bench/device_setup.sh && bash bench/device_benches.sh fresh     (carry .whl .whlfi07)
#       issue 42: prefill of fresh prompts from the step's own K/V (bench/prefill_sweep.py, every output
#       checked first): FlashInfer 0.7's ragged prefill beside its paged one, TRITON fresh-desc and
#       fresh-gather beside today's gather (p16) and page-descriptor (p64) paths, pages 16 and 64, at
#       4 x 4096 and 1 x 16384; then tests/gpu/test_fresh_prefill_gpu.py and the fresh prefill_desc cases
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh gemv16
#       bf16 weights on the split-K GEMV (workers/quant/gemv.py): checked, then timed against bf16 cuBLAS and
#       small_m.py per projection of the 8B, GPT-OSS-20B attention and DeepSeek-V2-Lite decode GEMVs in CUDA
#       graphs (bench/kernels_device.py --part gemv16, ~4 min), then the bs-1 decode step end to end with
#       --small-m-gemm on against auto (the baseline), 8B shape first, then GPT-OSS-20B, as long as the call
#       lasts (GEMV16_E2E: the models, default "llama3-8b gpt-oss-20b"; GEMV16_BUDGET: the kernel bench's
#       seconds, default 200)
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh bs256
#       issue 41: the 8B step at bs 256 beside the compiled baseline with a profiler timeline of its idle gaps
#       (bench/e2e.py --timeline), then GPU tests (BS256_TESTS, default fused_moe) with the time left
#   . bench/device_setup.sh && bash bench/device_benches.sh backends      (carry .whl .whlfi07)
#       issue 42's test: tests/gpu/test_backends_gpu.py whole with FlashInfer 0.7 in (pytest -n 6 within one call;
#       the fifteenth session's run with the graph tests beside it stopped one case short)
#   NO_FLASHINFER=1 . bench/device_setup.sh && GEMV16_E2E=gpt-oss-20b bash bench/device_benches.sh gemv16e2e
#       the e2e half alone (what the first call had no time for), then the bf16/fp16 GEMV's GPU tests
#       (tests/gpu/test_quant_gpu.py -k "dense or streamed") with the time left
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh mlastack
#       DeepSeek MLA's stacked q_kv_a_proj (one GEMM for q_proj + kv_a_proj_with_mqa) and kv_a_layernorm inside
#       the MLA rope kernel: the DeepSeek-V2-Lite bs-1 step at full depth first (kernels per step and ms against
#       the 3.58 ms / 599 kernels measured before on an H100: 54 kernels fewer expected, 2 a layer; compare on the
#       same card kind), then the rope + latent-norm kernel's GPU tests (stacked views included), then DeepSeek's
#       decode graphs (V2 and V3, TRITON and FLASHINFER MLA) with the time left; the rest of the MLA path's GPU
#       tests: `bash bench/device_benches.sh tests mla piecewise_graphs decode_graphs`
#   . bench/device_setup.sh && bash bench/device_benches.sh defaultpaths      (carry .whl .whlfi07)
#       issue 42's backend scenario table on the default kernel paths only (TRITON, FLASHINFER; -n 8), then
#       the stacked MLA's GPU tests (rope + latent norm, MLA backends, DeepSeek decode graphs) with the time left
#   . bench/device_setup.sh && bash bench/device_benches.sh mlafi      (carry .whl .whlfi07)
#       mlastack with FlashInfer in: the V2-Lite bs-1 step on TRITON's MLA and on the default (FlashInfer's
#       MLA decode), then the rope/norm, MLA and DeepSeek decode-graph GPU tests
#   . bench/device_setup.sh && bash bench/device_benches.sh split      (carry .whl .whlfi07)
#       the phase split (attention/backends/phase_split.py): the 8B shape's decode steps at bs 1 and 256
#       (prompt 128: ~160 keys a row) and TTFT at 4k, the default (FLASHINFER both phases) beside
#       --attention-backend prefill=FLASHINFER,decode=TRITON (and TRITON alone where time is left); then
#       the split's GPU tests: the backend scenario table and the bf16 decode-graph test (-k split)
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh shortdecode      (carry .whl .whlfi07)
#       the short-context decode class alone (bench/attention_choice.py --only decode-short: 256x160, 256x512,
#       64x1024, size "short"), FlashInfer 0.7 modules first as fi07 does, merged into a copy of the
#       kernel-choice table under $OUT: the measurement that can make short servers split their phases
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh mha      (carry .whl .whlfi07)
#       the FlashInfer archive rebuilt with FlashInfer's CUDA-core decode (MHA and GQA groups below 4; the
#       JIT-disabled fresh start proves it), then the MHA classes (mha-bf16-16, mha-fp8-16) timed per backend,
#       merged into a copy of the kernel-choice table under $OUT; copy files_at/fi07_cache.tgz into .whlfi07/
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/device_benches.sh mhagluon      (carry .whl .whlfi07)
#       mha with the Gluon prefill's GPU tests between the archive and the MHA timings (one call for both)
#   . bench/device_setup.sh && bash bench/device_benches.sh gluon      (carry .whl .whlfi07)
#       issue 42 item 3: the Gluon prefill (kernels/prefill_gluon.py; first run 2026-12-06 on an H100): its GPU
#       tests against the reference first (a wrong barrier phase hangs, hence the short timeout), then
#       bench/prefill_sweep.py at 4 x 4096 and 1 x 16384: FlashInfer 0.7's ragged and paged prefill, the
#       Gluon variants, TRITON's fresh-desc tiles (today's fresh default 64x64 and 128x64)
#   . bench/device_setup.sh && bash bench/device_benches.sh splittests      (carry .whl .whlfi07)
#       the split's GPU tests alone (what the split part had no time for)
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
e2e_bs1() {  # "name bench/e2e.py flags..." per run: the 8B shape at bs 1, the log and JSON under $OUT/e2e-name
    local run name
    for run in "$@"; do
        set -- $run
        name=$1; shift
        timeout $((590 - SECONDS)) python3 -m bench.e2e --batch-sizes 1 --throughput-sizes 1 --no-baseline \
            --out "$OUT/e2e-$name" "$@" > "$OUT/e2e-$name.log" 2>&1
        echo "e2e $name: exit $? at ${SECONDS}s"; grep -vE "^\s*$" "$OUT/e2e-$name.log" | tail -14
    done
}
e2e_small_m() {  # model...: the bs-1 step with --small-m-gemm on, then auto (the baseline), per model
    local model mode left
    for model in "$@"; do
        for mode in on auto; do
            left=$((590 - SECONDS))
            [ "$left" -lt 60 ] && { echo "e2e $model small_m_gemm $mode: not run (time)"; continue; }
            timeout "$left" python3 -m bench.e2e --model "$model" --batch-sizes 1 --throughput-sizes 1 --no-baseline \
                --ttft-lens= --small-m-gemm "$mode" --kv-bytes $((8 << 30)) --out "$OUT/e2e-$model-$mode" \
                > "$OUT/e2e-$model-$mode.log" 2>&1
            echo "e2e $model small_m_gemm $mode: exit $? at ${SECONDS}s"
            grep -vE "^\s*$" "$OUT/e2e-$model-$mode.log" | tail -14
        done
    done
}
case "${1:?part: serve, latency, piecewise, probe, nixl, tests, disagg, fi07, e2e42, fp8head, ttft, fresh, moe, gemv16, gemv16e2e, bs256, mlastack, mlafi, defaultpaths, mha, mhagluon, gluon, backends, split, splittests or shortdecode}" in
    split)  # FlashInfer's prefill with TRITON's decode against the default, same card, same call
        for run in "default" "split --attention-backend prefill=FLASHINFER,decode=TRITON" \
                "triton --attention-backend TRITON"; do
            set -- $run
            name=$1; shift
            left=$((500 - SECONDS))
            [ "$left" -lt 90 ] && { echo "e2e $name: not run (time)"; continue; }
            timeout "$left" python3 -m bench.e2e --batch-sizes 1,256 --throughput-sizes 256 --ttft-lens 4096 \
                --no-baseline --out "$OUT/e2e-$name" "$@" > "$OUT/e2e-$name.log" 2>&1
            echo "e2e $name: exit $? at ${SECONDS}s"; grep -vE "^\s*$" "$OUT/e2e-$name.log" | tail -16
        done
        [ $((590 - SECONDS)) -gt 60 ] && tests gpu_split $((590 - SECONDS)) -n 4 tests/gpu/test_backends_gpu.py \
            tests/gpu/test_decode_graphs_gpu.py -k split ;;
    shortdecode)
        BUILD_TIMEOUT=240 VERIFY_TIMEOUT=90 bash bench/flashinfer_aot.sh .whlfi07
        cp meshserve/attention/kernel_choice.json "$OUT/"
        PYTHONPATH=/tmp/site07:$PYTHONPATH timeout $((580 - SECONDS)) python3 -m bench.attention_choice --out "$OUT" \
            --classes gqa-bf16-16,gqa-bf16-64,gqa-fp8-16,gqa-fp8-64 --only decode-short \
            --write "$OUT/kernel_choice.json" 2>&1 | tail -40 ;;
    mha)  # the FlashInfer archive with the CUDA-core decode modules (MHA cases), then the MHA classes measured
        BUILD_TIMEOUT=240 VERIFY_TIMEOUT=90 bash bench/flashinfer_aot.sh .whlfi07
        cp meshserve/attention/kernel_choice.json "$OUT/"
        PYTHONPATH=/tmp/site07:$PYTHONPATH timeout $((580 - SECONDS)) python3 -m bench.attention_choice --out "$OUT" \
            --classes mha-bf16-16,mha-fp8-16 --write "$OUT/kernel_choice.json" 2>&1 | tail -40 ;;
    mhagluon)  # mha's archive and its JIT-disabled start, then the Gluon prefill's GPU tests (bounded), then the
        # MHA classes with the time left: one call for both when device time is short
        BUILD_TIMEOUT=240 VERIFY_TIMEOUT=90 bash bench/flashinfer_aot.sh .whlfi07
        tests gluon_prefill_gpu 100 -x tests/gpu/test_fresh_prefill_gpu.py -k gluon
        cp meshserve/attention/kernel_choice.json "$OUT/"
        PYTHONPATH=/tmp/site07:$PYTHONPATH timeout $((580 - SECONDS)) python3 -m bench.attention_choice --out "$OUT" \
            --classes mha-bf16-16,mha-fp8-16 --write "$OUT/kernel_choice.json" 2>&1 | tail -40 ;;
    splittests)
        tests gpu_split 560 -n 4 tests/gpu/test_backends_gpu.py tests/gpu/test_decode_graphs_gpu.py -k split ;;
    mlastack)  # MLA's stacked q_kv_a_proj + latent norm in the rope kernel: the V2-Lite bs-1 step first (kernels
        # and ms per step), then the rope/norm kernel's GPU tests, then DeepSeek's decode graphs with the time left
        timeout 330 python3 -m bench.e2e --model deepseek-v2-lite --batch-sizes 1 --throughput-sizes 1 \
            --ttft-lens= --no-baseline --kv-bytes $((8 << 30)) --out "$OUT/e2e-deepseek-v2-lite" \
            > "$OUT/e2e-deepseek-v2-lite.log" 2>&1
        echo "e2e deepseek-v2-lite: exit $? at ${SECONDS}s"; grep -vE "^\s*$" "$OUT/e2e-deepseek-v2-lite.log" | tail -14
        tests gpu_mla_rope 90 tests/gpu/test_mla_rope_gpu.py
        left=$((585 - SECONDS))
        [ "$left" -ge 60 ] && tests gpu_decode_graphs_deepseek "$left" tests/gpu/test_decode_graphs_gpu.py -k deepseek ;;
    mlafi)  # carry .whl .whlfi07 (FlashInfer on): mlastack's V2-Lite bs-1 step on TRITON's MLA (the stacking's
        # kernel count) and on the default (FlashInfer's MLA decode, which .[gpu] gets), then the rope/norm,
        # MLA (V2's strided q_pe through FlashInfer) and DeepSeek decode-graph GPU tests with the time left
        for run in "triton --attention-backend TRITON" "default"; do
            set -- $run
            name=$1; shift
            left=$((400 - SECONDS))
            [ "$left" -lt 90 ] && { echo "e2e deepseek-v2-lite $name: not run (time)"; continue; }
            timeout "$left" python3 -m bench.e2e --model deepseek-v2-lite --batch-sizes 1 --throughput-sizes 1 \
                --ttft-lens= --no-baseline --kv-bytes $((8 << 30)) --out "$OUT/e2e-deepseek-v2-lite-$name" "$@" \
                > "$OUT/e2e-deepseek-v2-lite-$name.log" 2>&1
            echo "e2e deepseek-v2-lite $name: exit $? at ${SECONDS}s"
            grep -vE "^\s*$" "$OUT/e2e-deepseek-v2-lite-$name.log" | tail -12
        done
        tests gpu_mla_rope 90 tests/gpu/test_mla_rope_gpu.py
        BUDGET=$((560 - SECONDS)) bash "$0" tests mla
        left=$((590 - SECONDS))
        [ "$left" -ge 45 ] && tests gpu_decode_graphs_deepseek "$left" tests/gpu/test_decode_graphs_gpu.py -k deepseek ;;
    gemv16)
        timeout $((${GEMV16_BUDGET:-200} + 120)) python3 bench/kernels_device.py --part gemv16 \
            --budget "${GEMV16_BUDGET:-200}" --out "$OUT" > "$OUT/kernels_device_gemv16.log" 2>&1
        echo "kernels_device --part gemv16: exit $? at ${SECONDS}s"
        grep -E "CHECK FAILED|graph replay|^check:" "$OUT/kernels_device_gemv16.log" | cut -c1-220 | head -12
        sed -n '/^summary/,$p' "$OUT/kernels_device_gemv16.log" | cut -c1-260
        e2e_small_m ${GEMV16_E2E:-llama3-8b gpt-oss-20b} ;;
    gemv16e2e)  # the e2e runs, then the bf16/fp16 GEMV's GPU tests with the time left
        e2e_small_m ${GEMV16_E2E:-llama3-8b gpt-oss-20b}
        left=$((580 - SECONDS))
        [ "$left" -ge 30 ] && tests gpu_quant_dense "$left" tests/gpu/test_quant_gpu.py -k "dense or streamed" ;;
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
        # the fixed cost of a pull step by step (--phases): nixl, cuda_ipc (one batched launch up to
        # 256 MiB) and cuda_ipc-memcpy (a memcpy per frame) at 1k/8k/32k tokens against a device copy
        timeout 300 python3 -m bench.kv_handover --device cuda --sizes 1024,8192,32768 \
            --transports nixl,cuda_ipc,cuda_ipc-memcpy --burst-transports none --reps 7 --phases \
            --out "$OUT" > "$OUT/kv_handover_phases.log" 2>&1
        echo "kv_handover phases: exit $? at ${SECONDS}s"
        grep -vE "^\s*$" "$OUT/kv_handover_phases.log" | tail -30
        # then the GPU tests (NIXL_THEN_TESTS: the names, default the transport test and the ones cut by time before)
        BUDGET=$((${BUDGET:-560} - SECONDS)) bash "$0" tests ${NIXL_THEN_TESTS-kv_transport prefill_desc backends decode_graphs} ;;
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
        # (the short-context decode class is `shortdecode`'s: this call's time went to these before)
        PYTHONPATH=/tmp/site07:$PYTHONPATH timeout $((580 - SECONDS)) python3 -m bench.attention_choice --out "$OUT" \
            --only prefill,decode --write "$OUT/kernel_choice.json" 2>&1 | tail -60 ;;
    e2e42)  # issue 42 item 5 (carry .whlfi07, FlashInfer on): TTFT 4k/16k and the bs-1 decode step, 8B shape,
        # TRITON against the default (the kernel-choice table: FlashInfer 0.7 where it measured fastest), then FP8
        # weights, then FP8 weights with the LM head in FP8 too (item 4's step target; ModelConfig.quantize_lm_head)
        e2e_bs1 "triton --attention-backend TRITON" "default" "fp8 --quantization fp8 --ttft-lens=" \
            "fp8head --quantization fp8 --quantize-lm-head --ttft-lens=" ;;
    gluon)  # GLUON_BUDGET: the seconds this part may take (default 580; less when the call's limit is lower)
        tests gluon_prefill_gpu 150 tests/gpu/test_fresh_prefill_gpu.py -k gluon
        timeout $((${GLUON_BUDGET:-580} - SECONDS)) python3 -m bench.prefill_sweep --out "$OUT/prefill-gluon" --cases 4x4096,1x16384 \
            --jobs 4 --only "gluon,fresh-desc 64x64 w4 s3 p16,fresh-desc 128x64 w4 s2 p16" > "$OUT/prefill-gluon.log" 2>&1
        echo "prefill sweep: exit $? at ${SECONDS}s"
        grep -E "WRONG|FAILED|Error" "$OUT/prefill-gluon.log" | cut -c1-200 | head -8
        sed -n '/^| case/,$p' "$OUT/prefill-gluon.log" ;;
    fresh)  # FlashInfer rows always run; --only picks TRITON's fresh variants and today's two default tiles
        timeout 330 python3 -m bench.prefill_sweep --out "$OUT/prefill-fresh" --cases 4x4096,1x16384 --jobs 6 \
            --only "fresh-,gather 128x64 w4 s3 p16,desc 128x64 w4 s3 p64" > "$OUT/prefill-fresh.log" 2>&1
        echo "prefill sweep: exit $? at ${SECONDS}s"
        grep -E "WRONG|FAILED|Error" "$OUT/prefill-fresh.log" | cut -c1-200 | head -8
        sed -n '/^| case/,$p' "$OUT/prefill-fresh.log"
        tests fresh_prefill_gpu $((570 - SECONDS)) tests/gpu/test_fresh_prefill_gpu.py tests/gpu/test_prefill_desc_gpu.py \
            -k "fresh" ;;
    ttft)
        e2e_bs1 "triton --attention-backend TRITON" "default"
        BUDGET=$((590 - SECONDS)) bash "$0" tests fresh_prefill mla flashinfer_kernels ;;
    fp8head)  # issue 42 item 4 alone: the bs-1 decode step, bf16 / FP8 weights / FP8 weights + FP8 LM head, no TTFT
        e2e_bs1 "default --ttft-lens=" "fp8 --quantization fp8 --ttft-lens=" \
            "fp8head --quantization fp8 --quantize-lm-head --ttft-lens=" ;;
    moe)  # one process per shape (each frees its GPU memory), 12 GiB of KV (256 sequences of <= 512 tokens
        # need 4.1 GB for DeepSeek's latents, 6.4 GB for GPT-OSS), TTFT of a 512-token prompt; the log of each in $OUT, the tables last
        for run in "deepseek-v2-lite 270" "gpt-oss-20b 570"; do  # seconds at most (DeepSeek first: the new shape)
            set -- $run
            left=$((570 - SECONDS))
            timeout $(($2 < left ? $2 : left)) python3 -m bench.e2e --model "$1" --batch-sizes 1,64,256 \
                --throughput-sizes 64 --ttft-lens 512 --kv-bytes $((12 << 30)) --out "$OUT/e2e-$1" > "$OUT/e2e-$1.log" 2>&1
            echo "e2e $1: exit $? at ${SECONDS}s"
            grep -E "^(roofline|checkpoint|meshserve)|Error|error:" "$OUT/e2e-$1.log" | cut -c1-220 | head -12
        done
        for m in deepseek-v2-lite gpt-oss-20b; do
            table=$(sed -n '/bench\/e2e.py:begin/,/bench\/e2e.py:end/p' "$OUT/e2e-$m.log")
            if [ -n "$table" ]; then echo "$table"; else echo "$m: no table; the log ends:"; tail -8 "$OUT/e2e-$m.log"; fi
        done ;;
    latency)  # issue 41's TTFT target: one request at a time (then 15 streams decoding beside it), served
        # HTTP/gRPC against offline, and each hop's share from a traced server (bench/serve_latency.py)
        # (serve paces its overlap by default since 2026-12-06: -unpaced is serve --no-paced-overlap; LATENCY_PATHS
        # picks others, e.g. offline,http,grpc,http-uvloop,grpc-uvloop with .whluv carried: serve --uvloop)
        uptime
        timeout 560 python3 -m bench.serve_latency --device cuda --shape llama3-8b --input-len 512 \
            --paths "${LATENCY_PATHS:-offline,http,grpc,http-unpaced,grpc-unpaced}" --background "0 15" --repeats 40 \
            --out "$OUT" \
            2>&1 | tail -48 ;;
    piecewise)  # the piecewise graphs of steps with prefill tokens: their GPU tests, then where a lone prompt's TTFT goes
        tests gpu_piecewise 150 tests/gpu/test_piecewise_graphs_gpu.py
        timeout 200 python3 -m bench.prefill_probe --variants default,eager-prefill,sync --repeats 10 --out "$OUT" \
            2>&1 | grep -v Warning | tail -50
        tests gpu_decode_graphs $((580 - SECONDS)) tests/gpu/test_decode_graphs_gpu.py -k "not deepseek" ;;
    probe)  # where a lone 512-token prompt's offline TTFT goes (bench/prefill_probe.py), then the warm-up's GPU test
        timeout 420 python3 -m bench.prefill_probe --out "$OUT" 2>&1 | tail -70
        BUDGET=$((590 - SECONDS)) bash "$0" tests warmup ;;
    disagg)
        timeout 540 python3 -m bench.disagg_ttft --device cuda --shape llama3-8b --deadline 300 --out "$OUT" \
            --logs "$OUT" 2>&1 | tail -30 ;;
    bs256)  # issue 41's bs-256 target: the 8B step at bs 256 beside the compiled baseline, with a profiler timeline
        # (bench/e2e.py --timeline: which host work each device idle gap waited for), then GPU tests (BS256_TESTS)
        timeout 420 python3 -m bench.e2e --batch-sizes 256 --throughput-sizes 256 --ttft-lens= --timeline \
            --out "$OUT/e2e-bs256" > "$OUT/e2e-bs256.log" 2>&1
        echo "e2e bs256: exit $? at ${SECONDS}s"
        grep -vE "^\s*$" "$OUT/e2e-bs256.log" | grep -v Warning | tail -40
        BUDGET=$((590 - SECONDS)) bash "$0" tests ${BS256_TESTS-fused_moe} ;;
    defaultpaths)  # carry .whl .whlfi07: issue 42's test on the kernels a default picks (TRITON and FLASHINFER, no
        # forced phase split: those are splittests') with eight workers, then the stacked MLA's GPU tests (rope +
        # latent norm, DeepSeek's decode graphs on both MLA backends, the MLA backends) with the time left
        tests gpu_backends_defaults 330 -n 8 tests/gpu/test_backends_gpu.py -k "not split"
        tests gpu_mla_rope 60 tests/gpu/test_mla_rope_gpu.py
        left=$((585 - SECONDS))
        [ "$left" -ge 45 ] && tests gpu_mla_and_deepseek_graphs "$left" -n 4 tests/gpu/test_mla_gpu.py \
            tests/gpu/test_decode_graphs_gpu.py -k "deepseek or mla or MLA" ;;
    backends)  # issue 42's test: the backend scenario table whole, every default kernel path against the
        # reference (carry .whl .whlfi07, FlashInfer on); six workers, one file, the call's time
        tests gpu_backends 560 -n 6 tests/gpu/test_backends_gpu.py ;;
    *) echo "unknown part $1"; exit 2 ;;
esac
