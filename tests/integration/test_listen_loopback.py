"""`meshserve serve` listens only where it is told.

With the default flags, `serve --replicas 2 --tp 2` (two replicas of two ranks each, on the
embedded Ray cluster) listens on loopback only: gRPC, HTTP, metrics, the step channels, gloo,
NIXL/UCX and Ray's own GCS, raylet (node and object managers) and core workers (the KV export
servers of disaggregated pools on embedded Ray: test_cluster_ray.py).
Every process that the server started counts: its descendants (psutil; Ray's GCS and raylet are
children of the server, its workers children of the raylet) and any process that carries the
environment variable this test gave the server (Ray's processes inherit it: one that left the tree
would still be found). The server's own three ports must be among the listeners, and Ray's GCS
and raylet must have been seen listening, so that an empty answer cannot pass.

The same run then SIGKILLs the server (one start of four Ray actors is the dear part, so it
serves both checks): within GONE_WITHIN_S (tests/marked_processes.py) no process it started is left
(Ray's GCS and raylet share their driver's fate; cluster/executors/ray_reaper.py stops whatever else is left).

The counterpart: `--host 0.0.0.0` widens exactly the HTTP socket, nothing else.

`non_loopback_listeners()` (the test process's own tree) serves in-process checks too
(test_kv_reshard_handover.py: disaggregated pools of tp 2 and tp 4 ranks in processes).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import tempfile
import urllib.request
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil
import pytest

from meshserve.cluster.executors.executor import free_port
from tests.marked_processes import MARK, left_running, marked
from tests.serve_process import ROOT, start_serve


@dataclass(frozen=True)
class Listener:
    process: str
    pid: int
    ip: str
    port: int

    @property
    def on_loopback(self) -> bool:
        """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (Ray's gRPC servers bind ::ffff:127.0.0.1)."""
        ip = ipaddress.ip_address(self.ip)
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        return f"{self.process}[{self.pid}] {self.ip}:{self.port}"


def listeners(procs: list[psutil.Process]) -> list[Listener]:
    out = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out += [Listener(name, proc.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def non_loopback_listeners() -> list[str]:
    """Each listening inet socket of this process and its descendants that is off loopback."""
    me = psutil.Process(os.getpid())
    return [str(x) for x in listeners([me, *me.children(recursive=True)]) if not x.on_loopback]


def server_tree(pid: int, mark: str) -> list[psutil.Process]:
    """The server, its descendants, and every process carrying its environment mark."""
    root = psutil.Process(pid)
    tree = {p.pid: p for p in [root, *root.children(recursive=True)]}
    tree.update((p.pid, p) for p in marked(mark) if p.pid not in tree)
    return list(tree.values())


@pytest.fixture
def ray_tmp():
    temp = tempfile.mkdtemp(prefix="mslisten", dir="/tmp")  # short: Ray's socket paths have a length limit
    yield temp
    shutil.rmtree(temp, ignore_errors=True)


def serve(ray_tmp: str, *flags: str):
    """(process, mark, {"grpc"|"http"|"metrics": port}) of a started `meshserve serve`."""
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "RAY_TMPDIR": ray_tmp, MARK: mark}
    metrics = free_port()
    proc, grpc_address, url = start_serve(["--grpc-port", "0", "--port", "0", "--metrics-port", str(metrics),
                                           "--dtype", "float32", "--max-model-len", "128", *flags], env)
    ports = {"grpc": int(grpc_address.rsplit(":", 1)[1]), "http": urlsplit(url).port, "metrics": metrics}
    return proc, mark, ports, url


def complete(url: str) -> str:
    """One greedy completion over HTTP: the server serves, and its ranks have run steps (lazily
    opened connections are open) before the sockets are listed."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The for statement is used to", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)["choices"][0]["text"]


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except Exception:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_replicas_of_two_ranks_on_embedded_ray_listen_on_loopback_only_and_a_kill_leaves_nothing(ray_tmp):
    proc, mark, ports, url = serve(ray_tmp, "--replicas", "2", "--tp", "2")
    try:
        assert complete(url)
        seen = listeners(server_tree(proc.pid, mark))
    finally:
        proc.kill()  # SIGKILL: no shutdown code of the server runs
        proc.wait()
    assert left_running(mark) == []
    assert [str(x) for x in seen if not x.on_loopback] == []
    own = {x.port for x in seen if x.pid == proc.pid}
    assert set(ports.values()) <= own, (ports, [str(x) for x in seen])
    names = {x.process for x in seen}
    assert {"gcs_server", "raylet"} <= names, names  # Ray's servers were there and looked at
    actors = {x.pid for x in seen if x.process.startswith("ray::_WorkerActor")}
    assert len(actors) == 4, names  # the four ranks' core-worker servers were looked at too


@pytest.mark.timeout(120)
def test_host_flag_widens_exactly_the_http_socket(ray_tmp):
    proc, mark, ports, _ = serve(ray_tmp, "--host", "0.0.0.0")
    try:
        seen = listeners(server_tree(proc.pid, mark))
    finally:
        stop(proc)
    wide = [x for x in seen if not x.on_loopback]
    assert [(x.pid, x.ip, x.port) for x in wide] == [(proc.pid, "0.0.0.0", ports["http"])], [str(x) for x in seen]
    assert {ports["grpc"], ports["metrics"]} <= {x.port for x in seen if x.pid == proc.pid and x.on_loopback}
