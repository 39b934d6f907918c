"""The front-end processes of `meshserve serve --api-server-count N` (vLLM's flag), as the first
one (serve's own process) starts and watches the others (their main: api/api_server_main.py).

Every front-end process serves gRPC and HTTP on the same ports (SO_REUSEPORT: the kernel spreads
new connections over the listening processes) and has its own EngineClient to the one engine
process, signing with the same deployment secret and channel session (the engine's endpoint keeps
a sequence per peer). Process 0 binds first (a port held by anyone, even another server that
shares its ports, is refused before anything starts: `check_port_free`), then starts the others
on the ports it got (port 0 resolved), and announces serving once the engine serves and every
process has said it is ready.

Metrics: prometheus_client's multiprocess mode. `shared_metrics_dir` makes a 0700 folder and
puts it in PROMETHEUS_MULTIPROC_DIR before prometheus_client is imported, in this process and
(inherited) in the others: each process writes its API counters and histograms to its own file
there, and whichever process answers a scrape sums them; the engine's series come once, from that
process's copy of the engine's report.

Shutdown: SIGTERM (or SIGINT) reaches process 0, which sends SIGTERM to the others; each drains
its own streams (--drain-seconds), and only when all have exited does process 0 stop the engine.
The others ignore SIGINT (a Ctrl-C reaches the whole process group; process 0 decides) and stop
by themselves when process 0 is gone.

A front-end process that exits while the server runs fails the whole server, loudly: process 0
logs which one and its exit code, drains the rest, stops the engine and exits non-zero (as
vLLM's API-server manager does). Restarting it in place would hide a crash loop from the
orchestrator, whose restart of the whole pod is the remedy it already knows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import msgpack

from meshserve.errors import ConfigError, UnavailableError

log = logging.getLogger("meshserve.serve")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
READY = b"ready\n"
WATCH_PERIOD_S = 0.2
EXIT_MARGIN_S = 5.0  # after the drain time, what a front-end process gets to exit before it is killed


@dataclass(frozen=True)
class FrontendProcess:
    """Which front-end process this is: index among count (--api-server-count), and the folder of
    the metrics files they share (None with one process)."""

    index: int = 0
    count: int = 1
    metrics_dir: str | None = None

    @property
    def shares_ports(self) -> bool:
        return self.count > 1


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_api_server_count(count: object, *, engine_process: bool) -> None:
    """--api-server-count: an integer in [1, usable cores]; above 1 only with --engine-process."""
    cores = usable_cores()
    if not isinstance(count, int) or not 1 <= count <= cores:
        raise ConfigError("api_server_count", count, f"an integer in [1, {cores}] (--api-server-count: front-end "
                                                     f"processes, at most one per core; this machine has {cores})")
    if count > 1 and not engine_process:
        raise ConfigError("api_server_count", count, "1 with --no-engine-process (several front-end processes "
                                                     "share one engine process: use --engine-process)")


def shared_metrics_dir() -> str:
    """A fresh 0700 folder for the processes' metrics files, set as PROMETHEUS_MULTIPROC_DIR for
    this process and the ones it starts. prometheus_client reads the variable at import."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before --api-server-count set PROMETHEUS_MULTIPROC_DIR: "
                           "its metrics would not be shared")
    path = tempfile.mkdtemp(prefix="meshserve-metrics-")
    os.environ[MULTIPROC_ENV] = path
    return path


def check_port_free(host: str, port: int | None, field: str) -> None:
    """A port to be shared (SO_REUSEPORT) must be held by nobody yet, not even by a server that would
    share it: bind it once without SO_REUSEPORT. Port 0 and None need no check."""
    if not port:
        return
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(field, port, f"a free port on {host} ({exc.strerror})") from None
    finally:
        sock.close()


class ApiServerGroup:
    """Front-end processes 1 .. count-1, seen from process 0: start, wait_ready, watch, terminate, wait.

    settings: the parsed `serve` flags (the model already resolved to its folder); engine: the
    EngineProcess whose address and channel key they use."""

    def __init__(self, settings: argparse.Namespace, *, count: int, engine, model_name: str | None,
                 metrics_dir: str) -> None:
        self.count = count
        self.metrics_dir = metrics_dir
        self._settings = {k: v for k, v in vars(settings).items() if k != "func"}
        self._engine = engine
        self._model_name = model_name
        self._procs: list[subprocess.Popen] = []
        self._stopping = False

    def start(self, *, http_port: int | None, grpc_port: int) -> None:
        """Start the other processes on the ports process 0 bound (port 0 resolved)."""
        for index in range(1, self.count):
            settings = {**self._settings, "http_port": http_port, "grpc_port": grpc_port}
            config = msgpack.packb({"args": settings, "model_name": self._model_name, "index": index,
                                    "count": self.count, "metrics_dir": self.metrics_dir,
                                    "address": self._engine.address, "key": self._engine.key.secret.key,
                                    "session": self._engine.key.session, "parent": os.getpid()})
            proc = subprocess.Popen([sys.executable, "-m", "meshserve.api.api_server_main"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)
            proc.stdin.write(config)
            proc.stdin.close()
            self._procs.append(proc)
        log.info("started %d more front-end process(es): pids %s", len(self._procs), [p.pid for p in self._procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    async def wait_ready(self) -> None:
        """Until every process has said it serves (its engine client connected, its ports bound);
        one that exits first raises UnavailableError naming it."""
        for index, proc in enumerate(self._procs, start=1):
            line = await asyncio.to_thread(proc.stdout.readline)
            if line != READY:
                code = await asyncio.to_thread(proc.wait)
                raise UnavailableError(f"front-end process {index} (pid {proc.pid}) exited with code {code} while "
                                       "starting (its log is above)")

    async def watch(self) -> str:
        """Returns, saying which and how, when a process exits while the server is not stopping."""
        while True:
            for index, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    return f"front-end process {index} (pid {proc.pid}) exited with code {code}"
            await asyncio.sleep(WATCH_PERIOD_S)

    def terminate(self) -> None:
        """SIGTERM to every process still running: each drains its own streams, then exits."""
        self._stopping = True
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    async def wait(self, drain_seconds: float) -> None:
        """Wait for every process to exit; one still there after the drain (+ EXIT_MARGIN_S) is killed."""
        for proc in self._procs:
            try:
                await asyncio.to_thread(proc.wait, drain_seconds + EXIT_MARGIN_S)
            except subprocess.TimeoutExpired:
                log.error("front-end process pid %d did not exit after the drain: killed", proc.pid)
                proc.kill()
                await asyncio.to_thread(proc.wait)

    def kill(self) -> None:
        self._stopping = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        """Remove the metrics folder (every process is gone)."""
        for proc in self._procs:
            if proc.stdout is not None:
                proc.stdout.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
