# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Installs come from a lock (requirements/*.txt, made by `make lock`): a fresh clone gets the versions
# the suite last passed with, whatever was released since. A machine with a GPU takes the CUDA lock.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
LOCK := requirements/$(if $(HAS_GPU),gpu,cpu).txt
GPU_EXTRA := $(if $(HAS_GPU),gpu,)
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
comma := ,
PIP := $(BIN)/python -m pip install --compile --progress-bar on --constraint $(LOCK)

.PHONY: run test lint lock docs proto image clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# What serving needs, nothing more (torch, Ray, gRPC, the HTTP server; the gpu extra on a GPU machine).
$(RUN_STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(PIP) -e ".$(if $(GPU_EXTRA),[$(GPU_EXTRA)],)"
	@touch $@

# The test and benchmark tools on top.
$(TEST_STAMP): $(RUN_STAMP)
	$(PIP) -e ".[test,bench$(if $(GPU_EXTRA),$(comma)$(GPU_EXTRA),)]"
	@touch $@

# The demo model on http://127.0.0.1:8000/v1 (OpenAI API, /metrics beside it) and 127.0.0.1:50051 (gRPC)
# until Ctrl-C; try `meshserve client "Python supports"` or the curl lines in README.md.
run: $(RUN_STAMP)
	$(BIN)/meshserve serve

# ruff and the import layers (api > cluster > engine > workers/kvtransfer > parallel/kvstore/attention > core).
lint: $(TEST_STAMP)
	$(BIN)/ruff check meshserve tests $(wildcard bench scripts)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_import_layers.py

# The unit directories whose tests run in-process (kernels under the interpreter, the model runner,
# the KV manager) run on two pytest-xdist workers, CI's two cores (2:50 instead of ~4 min serially);
# everything that starts processes, servers or Ray, or waits on a heartbeat, runs alone after them.
PARALLEL_TESTS := tests/unit/attention tests/unit/workers tests/unit/core tests/unit/kvstore tests/unit/engine
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider

# With a GPU, the CPU suite runs as CI runs it (no visible GPU: Triton kernels in the interpreter,
# which must be chosen before any kernel is defined), then tests/gpu runs on the GPU.
test: $(TEST_STAMP)
	$(BIN)/ruff check meshserve tests $(wildcard bench scripts)
	@if [ -n "$(HAS_GPU)" ]; then \
	    CUDA_VISIBLE_DEVICES= $(PYTEST) -n 2 $(PARALLEL_TESTS) && \
	    CUDA_VISIBLE_DEVICES= $(PYTEST) tests --ignore=tests/gpu $(addprefix --ignore=,$(PARALLEL_TESTS)) && \
	    $(PYTEST) tests/gpu; \
	else \
	    $(PYTEST) -n 2 --durations=5 $(PARALLEL_TESTS) && \
	    $(PYTEST) --durations=15 tests $(addprefix --ignore=,$(PARALLEL_TESTS)); \
	fi

# Re-resolve every dependency at today's releases, reinstall from the new lock, run the suite: an
# upgrade is one deliberate commit (requirements/*.txt) with its test run.
lock:
	UPGRADE=1 scripts/lock.sh
	rm -f $(RUN_STAMP) $(TEST_STAMP)
	$(MAKE) test

docs: $(TEST_STAMP)
	$(BIN)/python -m meshserve.attention.docs --write docs/attention-backends.md
	$(BIN)/python -m meshserve.workers.quant.support --write docs/quantization.md

proto: $(TEST_STAMP)
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
