# Sourced by the bench/h200*.sh scripts on the GPU machine (set WHEELS first): install the
# FlashInfer wheels beside the image's packages, set the build and cache environment, and load
# FlashInfer modules packed by an earlier session (WHEELS/fi_aot.tgz) as AOT modules.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws TRITON_CACHE_DIR=/tmp/tcache
if [ -f "$WHEELS/fi_aot.tgz" ]; then
    mkdir -p /tmp/site/flashinfer/data/aot && tar -xzf "$WHEELS/fi_aot.tgz" -C /tmp/site/flashinfer/data/aot
fi
