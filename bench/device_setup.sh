# Source at the start of a device call (bench/README: the device has no network): installs the
# wheels carried in .whl/ (FlashInfer 0.5.3 and what it needs; xgrammar, pydantic, FastAPI,
# uvicorn, pyzmq, grpc extras for the serving benches) into /tmp/site and sets the environment.
# NO_FLASHINFER=1 leaves FlashInfer out (its tests then skip): 0.5.3 JIT-builds every module on
# first use, minutes per configuration, which a 10-minute call cannot afford without a prebuilt cache.
wheels=$(ls .whl/*.whl)
[ "${NO_FLASHINFER:-0}" = 1 ] && wheels=$(ls .whl/*.whl | grep -v -e flashinfer -e tvm_ffi -e cudnn_frontend)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
