#!/usr/bin/env bash
# Regenerate requirements/{cpu,gpu}.txt: every package `make run` and `make test` install, pinned.
# pip-compile runs from its own venv (.venv-lock) so the project's venv never carries pip-tools.
# `make lock` then reinstalls from the new lock and runs the suite: an upgrade is a commit with its test run.
# UPGRADE=1 (what `make lock` sets) re-resolves every package at today's releases; without it the pins
# already in the lock stay and only what pyproject.toml added or changed is resolved.
set -euo pipefail
[ "${UPGRADE:-0}" = 1 ] || unset UPGRADE
cd "$(dirname "$0")/.."
PY=${PY:-python3}
[ -x .venv-lock/bin/pip-compile ] || { "$PY" -m venv .venv-lock && .venv-lock/bin/pip install -q "pip-tools>=7.4"; }
compile() {  # compile OUT TORCH_CONSTRAINT EXTRAS...
    local out=$1 torch=$2; shift 2
    local extras=(); for e in "$@"; do extras+=(--extra "$e"); done
    .venv-lock/bin/pip-compile --quiet ${UPGRADE:+--upgrade} --strip-extras --no-emit-index-url --no-emit-find-links \
        --constraint "$torch" "${extras[@]}" --output-file "$out" pyproject.toml
    # A local version label (+cpu) names one wheel index; torch==X matches X+cpu where that wheel lies.
    sed -i 's/^\(torch==[0-9.]*\)+[a-z0-9]*$/\1/' "$out"
}
compile requirements/cpu.txt requirements/torch-cpu.in test bench
compile requirements/gpu.txt requirements/torch-gpu.in gpu test bench
echo "lock: requirements/cpu.txt ($(grep -c '==' requirements/cpu.txt) pins), requirements/gpu.txt ($(grep -c '==' requirements/gpu.txt) pins)"
