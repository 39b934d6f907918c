# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint docs proto clean

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

# The demo model on 127.0.0.1:50051 (metrics on :9400) until Ctrl-C; try `meshserve client "Python supports"`.
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

clean:
	rm -rf $(VENV)
