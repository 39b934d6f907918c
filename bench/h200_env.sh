# Sourced by the bench/h200*.sh scripts on the GPU machine (set WHEELS first): install the
# FlashInfer wheels beside the image's packages, set the build and cache environment, and load
# FlashInfer modules packed by an earlier session (WHEELS/fi_aot.tgz) as AOT modules.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws TRITON_CACHE_DIR=/tmp/tcache
# fi_aot.tgz: FlashInfer 0.5.3 modules; fi07_cache.tgz: 0.7.x modules (bench/flashinfer_aot.sh). Only the
# one matching the FlashInfer wheel in WHEELS loads (module names differ between releases).
for packed in fi_aot.tgz fi07_cache.tgz; do
    if [ -f "$WHEELS/$packed" ]; then
        mkdir -p /tmp/site/flashinfer/data/aot && tar -xzf "$WHEELS/$packed" -C /tmp/site/flashinfer/data/aot
    fi
done
