# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint docs proto image clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	@# The CPU build of torch is pinned where no GPU is present (a plain `torch` pulls CUDA wheels).
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install -q "torch<=2.14.1"; \
	else \
	    $(BIN)/python -m pip install -q torch==2.13.0; \
	fi
	@$(BIN)/python -m pip install -q --compile -e ".[test,bench]"
	@touch $(STAMP)

# The demo model on 127.0.0.1:50051 (gRPC), http://127.0.0.1:8000/v1 (OpenAI API) and :9400 (metrics)
# until Ctrl-C; try `meshserve client "Python supports"` or the curl lines in README.md.
run: $(STAMP)
	$(BIN)/meshserve serve

# With a GPU, the CPU suite runs as CI runs it (no visible GPU: Triton kernels in the interpreter,
# which must be chosen before any kernel is defined), then tests/gpu runs on the GPU.
test: $(STAMP)
	$(BIN)/ruff check meshserve tests $(wildcard bench scripts)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest -q -p no:cacheprovider tests --ignore=tests/gpu && \
	    $(BIN)/python -m pytest -q -p no:cacheprovider tests/gpu; \
	else \
	    $(BIN)/python -m pytest -q -p no:cacheprovider tests; \
	fi

docs: $(STAMP)
	$(BIN)/python -m meshserve.attention.docs --write docs/attention-backends.md
	$(BIN)/python -m meshserve.workers.quant.support --write docs/quantization.md

proto: $(STAMP)
	$(BIN)/python -m meshserve.api.protogen

# The serving image (deploy/docker/Dockerfile). IMAGE names it; extra build arguments, e.g.
# IMAGE_ARGS="--build-arg TORCH_CUDA=cu129 --build-arg CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04".
# Smoke test on a GPU host: docker run --rm --gpus all $(IMAGE) doctor --require TRITON,FLASHINFER
IMAGE ?= meshserve/meshserve:$(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}/\1/p' deploy/helm/meshserve/Chart.yaml)
DOCKER ?= docker
image:
	$(DOCKER) build -f deploy/docker/Dockerfile -t $(IMAGE) $(IMAGE_ARGS) .

clean:
	rm -rf $(VENV)
