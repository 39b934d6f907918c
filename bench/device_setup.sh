# Source at the start of a device call (bench/README: the device has no network): installs the
# wheels carried in .whl/ (what the engine imports: xgrammar and its apache_tvm_ffi and pydantic,
# msgpack, pyzmq, orjson, prometheus-client), .whlserve/ (what `meshserve serve` adds: grpc, protobuf,
# FastAPI with opentelemetry-api, uvicorn with httptools; carry it to serve/latency/disagg calls and to
# GPU tests that start a server) and in whichever of these ignored folders the call carries
# (bench/device_wheels.sh rebuilds them all on a fresh checkout): .whlnixl/ (the repacked NIXL
# wheel), .whlray/ (the repacked Ray), .whlfi053/ (FlashInfer 0.5.3, cudnn-frontend) or .whlfi07/ (the repacked
# FlashInfer 0.7.x; bench/flashinfer_aot.sh) or .whluv/ (uvloop, for serve --uvloop A/B runs: 4.5 MB) into
# /tmp/site, and sets the environment.
# NIXL (the KV data plane) travels as a repacked wheel of 7.9 MB (the stock one is 59 MB), made here first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 nixl-cu13==1.5.1 -d /tmp/nixlwhl     # (no manylinux_2_17 build exists)
#   python3 bench/repack_nixl.py /tmp/nixlwhl/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl --out .whlnixl
# (carry .whlnixl only to the calls that use NIXL; bench/repack_nixl.py says what it drops; --check tries a cp311 repack here; never commit .whl*/).
# Ray (the device has none: `serve --pools disaggregated` and Ray-placed replicas need it) travels as a
# Ray Core repack in .whlray/ (ignored), 23.0 MB instead of 79 MB, made here first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 ray==2.60.0 -d /tmp/raydl
#   python3 bench/repack_ray.py /tmp/raydl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl --out .whlray --system-aiohttp
# (carry .whlray only to the calls that need Ray; --system-aiohttp leans on the image's aiohttp, 0.9 MB less;
# Ray's other requirements are in the image or .whl (jsonschema); bench/repack_ray.py says what it drops and
# --check runs Ray Core from a cp311 repack here. .whl + .whlnixl + .whlray + the tree: about 63.5 of the 64 MiB.)
# NO_FLASHINFER=1 leaves FlashInfer out (its tests then skip): 0.5.3 JIT-builds every module on
# first use, minutes per configuration, which a 10-minute call cannot afford without a prebuilt cache.
wheels=$(ls .whl/*.whl .whlserve/*.whl .whlnixl/*.whl .whlray/*.whl .whlfi053/*.whl .whlfi07/*.whl .whluv/*.whl 2>/dev/null)
[ "${NO_FLASHINFER:-0}" = 1 ] && wheels=$(echo "$wheels" | grep -v -e flashinfer -e cudnn_frontend)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    || return 1
# FlashInfer 0.7's modules built by bench/flashinfer_aot.sh, as AOT modules: no JIT at start-up.
[ "${NO_FLASHINFER:-0}" != 1 ] && [ -f .whlfi07/fi07_cache.tgz ] && [ -d /tmp/site/flashinfer ] \
    && mkdir -p /tmp/site/flashinfer/data/aot && tar -xzf .whlfi07/fi07_cache.tgz -C /tmp/site/flashinfer/data/aot
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
nvidia-smi -L
[ -d /tmp/site/ray ] && python3 -c 'import ray, aiohttp; print("ray", ray.__version__, "from /tmp/site; aiohttp", aiohttp.__version__)'
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
# The host's speed at host-side work (bench/host_probe.py): host-bound timings compare across calls
# only where this line agrees (2026-12-06: two H100 hosts ran the same host code 1.4-2x apart).
python3 -m bench.host_probe --out "${OUT:-/tmp}/host_probe.json"
