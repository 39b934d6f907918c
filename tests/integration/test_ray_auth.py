"""Joining a Ray cluster that runs token authentication (Ray 2.60's default): with the token it
works; without it, `meshserve serve --ray-address` fails at once with one line naming
RAY_AUTH_MODE and exit code 2 (before this, ray.init retried for 20 s and printed a traceback)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from meshserve.cluster.executors.executor import free_port
from meshserve.cluster.executors.ray_executor import probe_cluster
from meshserve.errors import UnavailableError

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
PROBE = "import sys\nfrom meshserve.cluster.executors.ray_executor import probe_cluster\nprobe_cluster(sys.argv[1])"


def probe(address: str, **env: str) -> subprocess.CompletedProcess:
    """probe_cluster in a fresh process, as `meshserve serve` runs it (Ray loads its token once per process)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | env
    return subprocess.run([sys.executable, "-c", PROBE, address], env=full, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def token_cluster():
    """A one-node Ray head with RAY_AUTH_MODE=token; yields (address, token)."""
    temp = tempfile.mkdtemp(prefix="msauth-", dir="/tmp")  # short: Ray's socket paths have a length limit
    token = secrets.token_hex(16)
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
                             "--num-cpus", "0", "--temp-dir", temp, "--include-dashboard", "false",
                             "--disable-usage-stats", "--ray-client-server-port", str(free_port()),
                             "--dashboard-agent-listen-port", "0"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while probe(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token).returncode != 0:  # bounded wait
            assert time.monotonic() < deadline and head.poll() is None, "the Ray head did not come up"
            time.sleep(0.5)
        yield address, token
    finally:
        # SIGKILL to the session, as tests/integration/ray_cluster.py stops its nodes: `ray start
        # --block` outlived SIGTERM by more than 30 s here, which only cost the suite time.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_clusters_token_passes_the_probe(token_cluster):
    address, token = token_cluster
    done = probe(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("env", [{"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "wrong"}])
def test_missing_or_wrong_credentials_name_ray_auth_mode(token_cluster, env):
    address, _ = token_cluster
    done = probe(address, **env)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("meshserve.errors.UnavailableError: ")
    assert f"RAY_AUTH_MODE={env['RAY_AUTH_MODE']}" in last and "RAY_AUTH_TOKEN" in last


def test_serve_fails_in_one_line_with_exit_code_2(token_cluster):
    address, _ = token_cluster
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_AUTH_TOKEN", None)
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "serve", "--ray-address", address, "--replicas", "2",
                           "--grpc-port", "0", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("meshserve: error: ") and "RAY_AUTH_MODE=disabled" in lines[-1]
    assert "Traceback" not in done.stderr


def test_an_absent_cluster_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(UnavailableError, match="cannot reach the Ray cluster at .*RAY_AUTH_MODE=disabled"):
        probe_cluster(address, timeout=2)
