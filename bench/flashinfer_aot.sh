#!/usr/bin/env bash
# On the GPU machine (device tool): install FlashInfer 0.7 from the repacked wheel, JIT-build the
# modules our default shapes use, pack them as AOT modules, and prove a fresh start needs no JIT.
#   NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/flashinfer_aot.sh WHEEL_DIR   (the project's other wheels first)
# WHEEL_DIR holds flashinfer_python-0.7.x (from bench/repack_flashinfer.py --mode jit, ~18 MB) and
# apache_tvm_ffi (0.1.11 <= version < 0.2) unless .whl/ carries it (bench/device_setup.sh: xgrammar needs it too).
# Builds (by running the GPU tests that check them against the reference, so a module that
# builds but computes wrongly fails here): Llama-3-8B-shape GQA 32/8 x 128 bf16 prefill (FA3 on
# sm90) and decode (FA2 tensor-core), FP8 e4m3 K/V prefill/decode (FA2), pages 16 and 64
# (page size is a run-time argument: same modules); the ragged prefill of fresh prompts, also with a
# sliding window and soft-cap; DeepSeek MLA decode 512 + 64 bf16 and FP8 (FA3); the CUDA-core decode
# (GQA groups below 4 and MHA: Llama-2-7B shape) bf16 and FP8 e4m3, which a fresh start JIT-built before.
# Writes $OUT/fi07_cache.tgz: <module>/<module>.so, debug symbols stripped, the layout of
# flashinfer/data/aot/ (bench/h200_env.sh unpacks it there), to carry next time beside the
# Python-only wheel (bench/repack_flashinfer.py --mode aot, ~7 MB). Must stay under ~12 MB.
# A WHEEL_DIR/fi07_cache.tgz from an earlier (partial) run is loaded first: only what it lacks is
# built, and the new archive holds both, so a build cut off by the time limit resumes next call.
# Timeouts (s): BUILD_TIMEOUT (default 400) and VERIFY_TIMEOUT (150) within the 600 s of a call.
set -u
WHEELS=${1:?wheel dir with the repacked flashinfer_python-0.7.x and apache_tvm_ffi wheels}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site07
rm -rf "$SITE" /tmp/fiws07 /tmp/fiws07_fresh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHEELS"/flashinfer_python-0.7*.whl $(ls "$WHEELS"/apache_tvm_ffi-*.whl .whl/apache_tvm_ffi-*.whl 2>/dev/null | head -1) \
    || exit 1
export PYTHONPATH=$SITE:${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 XDG_CACHE_HOME=/tmp/cache
export HF_HUB_OFFLINE=1 FLASHINFER_CUDA_ARCH_LIST=9.0a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws07 TRITON_CACHE_DIR=/tmp/tcache
python3 -c 'import flashinfer, torch; print("flashinfer", flashinfer.__version__, "torch", torch.__version__,
torch.cuda.get_device_name())' || exit 1
# test_fresh_prefill_gpu.py: FLASHINFER's ragged prefill (ragged_prefill=True), whose runs live in
# the same module as the paged prefill's: proves the fresh start serves it too without JIT.
TESTS=(tests/gpu/test_flashinfer_kernels_gpu.py tests/gpu/test_mla_gpu.py tests/gpu/test_fresh_prefill_gpu.py)
# bf16 is the served dtype; each fp16 variant is another module ("not float16" also drops bfloat16).
# The window + soft-cap ragged case is another module (Gemma-style layers): built too, since without
# it such a model JIT-builds for ~130 s inside its first prefill (H100, 2026-12-06).
SELECT="flashinfer and not torch.float16"

AOT=$SITE/flashinfer/data/aot
mkdir -p "$AOT"
[ -f "$WHEELS/fi07_cache.tgz" ] && tar -xzf "$WHEELS/fi07_cache.tgz" -C "$AOT" \
    && echo "loaded $(ls "$AOT" | wc -l) modules from an earlier run"
SECONDS=0
timeout "${BUILD_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -k "$SELECT" "${TESTS[@]}" \
    > "$OUT/aot_build.log" 2>&1
echo "build + check: exit $? after ${SECONDS}s"; tail -3 "$OUT/aot_build.log"

OPS=$(ls -d /tmp/fiws07/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
STAGE=/tmp/fi07_stage
rm -rf "$STAGE" && mkdir -p "$STAGE"
for so in "$AOT"/*/*.so ${OPS:+"$OPS"/*/*.so}; do
    [ -f "$so" ] || continue
    name=$(basename "$(dirname "$so")")
    mkdir -p "$STAGE/$name" && cp "$so" "$STAGE/$name/"
    command -v strip > /dev/null && strip --strip-unneeded "$STAGE/$name/$(basename "$so")"
    printf '  %-150s %8d KiB (built %d KiB)\n' "$name" $(( $(stat -c %s "$STAGE/$name/$(basename "$so")") / 1024 )) \
        $(( $(stat -c %s "$so") / 1024 ))
done
[ -n "$(ls "$STAGE")" ] || { echo "nothing built, nothing loaded: no archive"; exit 1; }
(cd "$STAGE" && GZIP=-9 tar -czf "$OUT/fi07_cache.tgz" -- */*.so)
echo "fi07_cache.tgz: $(( $(stat -c %s "$OUT/fi07_cache.tgz") / 1024 )) KiB, $(ls "$STAGE" | wc -l) modules"

# A fresh start: the packed modules as AOT modules, an empty JIT workspace, JIT forbidden.
tar -xzf "$OUT/fi07_cache.tgz" -C "$AOT"
SECONDS=0
FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws07_fresh timeout "${VERIFY_TIMEOUT:-150}" \
    python3 -m pytest -q -p no:cacheprovider -k "$SELECT" "${TESTS[@]}" > "$OUT/aot_fresh.log" 2>&1
echo "fresh start, JIT disabled: exit $? after ${SECONDS}s"; tail -3 "$OUT/aot_fresh.log"
