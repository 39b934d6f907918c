"""Real Ray clusters on this machine for the cluster tests (no hard-coded ports, own temp dirs).

`embedded_ray()`: ray.init() of a local cluster in this process (the default deployment).
`multi_node_ray(resources)`: `ray start --head` plus one `ray start --address` node per entry of
`resources` (its custom resources), started one after the other once the head answers, each a
separate process group that is killed at the end; yields the head's address after connecting
this process to it.
Token authentication (on by default in Ray 2.60, which writes under ~/.ray) is disabled, and
every file Ray writes goes to a temp dir that is removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from meshserve.cluster.executors.executor import free_port

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
START_TIMEOUT_S = 90.0


@contextlib.contextmanager
def _auth(settings: dict[str, str]):
    """This process's Ray authentication settings (environment) for the block."""
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_for_gcs(address: str, deadline: float) -> None:
    """Until the head's GCS answers (a 4 s probe each time), or the deadline passes."""
    from meshserve.cluster.executors.ray_executor import probe_cluster
    from meshserve.errors import UnavailableError

    while True:
        try:
            probe_cluster(address)
            return
        except UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _no_auth():
    return _auth({"RAY_AUTH_MODE": "disabled"})


@contextlib.contextmanager
def embedded_ray(num_cpus: int = 2):
    import ray

    from meshserve.cluster.executors.ray_executor import ray_init

    temp = tempfile.mkdtemp(prefix="msray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    with _no_auth():
        ray_init(num_cpus=num_cpus, temp_dir=temp)
        try:
            yield temp
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def multi_node_ray(resources: list[dict[str, float]], *, node_ips: list[str] | None = None, token: str | None = None):
    """node_ips: the head's address, then each node's (all 127.0.0.1 by default); this process
    joins as a driver of the head's node. token: Ray token authentication on, with this token
    (this process must not have used Ray before: Ray reads its token once per process)."""
    import ray

    ips = node_ips or ["127.0.0.1"] * (1 + len(resources))
    temp = tempfile.mkdtemp(prefix="msrayc-", dir="/tmp")
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {"RAY_AUTH_MODE": "disabled"}
    env = {**os.environ, **auth}
    port = free_port(ips[0])
    address = f"{ips[0]}:{port}"
    common = ["--num-cpus", "1", "--disable-usage-stats", "--block", "--dashboard-agent-listen-port", "0"]
    procs = []

    def start(args):
        procs.append(subprocess.Popen([RAY, "start", *args, *common], env=env, start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    with _auth(auth):
        try:
            start(["--head", "--port", str(port), "--temp-dir", temp, "--include-dashboard", "false",
                   "--node-ip-address", ips[0], "--ray-client-server-port", str(free_port()),
                   "--dashboard-port", str(free_port())])
            deadline = time.monotonic() + START_TIMEOUT_S
            _wait_for_gcs(address, deadline)  # a ray.init before the GCS answers waits 30 s or more
            while True:  # a node joining a head that is still starting can crash its raylet: wait
                try:
                    ray.init(address=address, logging_level="WARNING", _node_ip_address=ips[0])
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)
            for i, res in enumerate(resources, start=1):
                # Nodes on one machine share the head's session dir, and a node picks unused socket
                # file names there only if the nodes before it have made theirs: one at a time.
                start(["--address", address, "--resources", json.dumps(res), "--node-ip-address", ips[i]])
                while len([n for n in ray.nodes() if n["Alive"]]) < 1 + i:
                    assert time.monotonic() < deadline, f"only {ray.nodes()} joined"
                    time.sleep(0.5)
            yield address
        finally:
            if ray.is_initialized():
                ray.shutdown()
            for proc in procs:  # each node's processes share the session started for it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            shutil.rmtree(temp, ignore_errors=True)
