#!/usr/bin/env bash
# Here (not on the device): the ignored wheel folders a device call carries, rebuilt from the lock
# (requirements/gpu.txt) for the device's Python 3.12, since a fresh checkout has none of them.
#   bash bench/device_wheels.sh            .whl (engine) and .whlserve (front-ends)
#   bash bench/device_wheels.sh fi07       + .whlfi07: FlashInfer from the lock, repacked (bench/repack_flashinfer.py)
#   bash bench/device_wheels.sh uvloop     + .whluv: uvloop, for the serve --uvloop A/B
# Two folders because a call carries at most 64 MiB (67.1 MB) with the tree (~22 MB): .whl (~8.5 MB)
# is what the engine imports (xgrammar and its tvm-ffi and pydantic, msgpack, pyzmq, orjson,
# prometheus-client), .whlserve (~10 MB) what `meshserve serve` adds (grpc, protobuf, FastAPI,
# uvicorn with httptools). .whl + .whlfi07 (~28 MB with its module archive) + the tree fit; all
# four did not (68.5 MB, 2026-12-06). bench/device_setup.sh installs whichever folders came.
# fi07_cache.tgz (FlashInfer's prebuilt modules) is made ON the device by bench/flashinfer_aot.sh
# (one call, ~5 minutes on an H100): copy it from that call's files into .whlfi07/.
set -eu
cd "$(dirname "$0")/.."
LOCK=requirements/gpu.txt
ENGINE=(apache-tvm-ffi msgpack pyzmq orjson prometheus-client xgrammar pydantic pydantic-core annotated-types
        typing-inspection typing-extensions)
SERVE=(grpcio grpcio-health-checking grpcio-reflection protobuf fastapi starlette annotated-doc anyio uvicorn h11
       httptools click opentelemetry-api)
grep -qx '/.whl\*/' .git/info/exclude 2>/dev/null || echo '/.whl*/' >> .git/info/exclude

pinned() {  # the lock's NAME==VERSION for each name given
    local name line
    for name in "$@"; do
        line=$(grep -i "^${name}==" "$LOCK") || { echo "not in $LOCK: $name" >&2; return 1; }
        echo "${line%% *}"
    done
}
download() {  # DIR SPEC...: manylinux wheels for CPython 3.12, no dependencies (each is named)
    local dir=$1
    shift
    mkdir -p "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@" 2>&1 | grep -v "^WARNING: Location" || true
    echo "$dir: $(find "$dir" -type f -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
}

mapfile -t specs < <(pinned "${ENGINE[@]}")
download .whl "${specs[@]}"
mapfile -t specs < <(pinned "${SERVE[@]}")
download .whlserve "${specs[@]}"
for extra in "$@"; do
    case $extra in
        fi07)
            tmp=$(mktemp -d)
            download "$tmp" "$(pinned flashinfer-python)"
            python3 bench/repack_flashinfer.py "$tmp"/flashinfer_python-*.whl --out .whlfi07
            rm -rf "$tmp"
            [ -f .whlfi07/fi07_cache.tgz ] || echo "no .whlfi07/fi07_cache.tgz: build it on the device with" \
                "NO_FLASHINFER=1 . bench/device_setup.sh && bash bench/flashinfer_aot.sh .whlfi07 (carry .whl .whlfi07)" ;;
        uvloop) download .whluv uvloop==0.23.0 ;;  # opt-in, not in the lock
        *) echo "unknown extra $extra (fi07 or uvloop)" >&2; exit 2 ;;
    esac
done
