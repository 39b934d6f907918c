"""The CI workflow that builds and pushes the image on tags, and `make image`.

The workflow is validated offline against GitHub's workflow schema as vendored by
check-jsonschema (the `test` extra); the checks below pin what the schema cannot know.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.manifests import REPO

WORKFLOW = REPO / ".github" / "workflows" / "image.yml"


def check_jsonschema() -> str:
    found = Path(sys.executable).with_name("check-jsonschema")
    path = str(found) if found.exists() else shutil.which("check-jsonschema")
    assert path, "check-jsonschema is missing: install the test extra (pip install -e '.[test]')"
    return path


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([check_jsonschema(), "--builtin-schema", "vendor.github-workflows", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_workflow_matches_githubs_schema():
    done = validate(WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("broken", [
    "jobs:\n  build:\n    steps:\n      - run: echo\n",  # no `on`, no runs-on
    "on: push\njobs:\n  build:\n    runs-on: ubuntu-latest\n    steps:\n      - uses: 5\n",
])
def test_schema_check_catches_broken_workflows(tmp_path, broken):
    bad = tmp_path / "bad.yml"
    bad.write_text(broken)
    assert validate(bad).returncode != 0


def test_workflow_builds_the_dockerfile_and_pushes_on_version_tags():
    doc = yaml.safe_load(WORKFLOW.read_text())
    triggers = doc[True] if True in doc else doc["on"]  # YAML 1.1 reads the key `on` as True
    assert triggers["push"]["tags"] == ["v*"]
    assert doc["permissions"]["packages"] == "write"
    steps = doc["jobs"]["build-and-push"]["steps"]
    build = next(s for s in steps if s.get("uses", "").startswith("docker/build-push-action@"))
    assert build["with"]["file"] == "deploy/docker/Dockerfile" and build["with"]["context"] == "."
    assert build["with"]["push"] is True
    login = next(s for s in steps if s.get("uses", "").startswith("docker/login-action@"))
    meta = next(s for s in steps if s.get("uses", "").startswith("docker/metadata-action@"))
    assert login["with"]["registry"] == "ghcr.io" and meta["with"]["images"].startswith("ghcr.io/")
    assert "type=semver,pattern={{version}}" in meta["with"]["tags"]


def test_make_image_builds_the_dockerfile_tagged_with_the_charts_app_version():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    chart = yaml.safe_load((REPO / "deploy" / "helm" / "meshserve" / "Chart.yaml").read_text())
    out = subprocess.run(["make", "-n", "image"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert f"docker build -f deploy/docker/Dockerfile -t meshserve/meshserve:{chart['appVersion']}" in out
    out = subprocess.run(["make", "-n", "image", "IMAGE=reg/x:1", "IMAGE_ARGS=--build-arg TORCH_CUDA=cu129"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "-t reg/x:1 --build-arg TORCH_CUDA=cu129 ." in out
