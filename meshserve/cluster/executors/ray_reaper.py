"""A watchdog that stops the embedded Ray cluster's processes when the server that started them
dies, however it dies (SIGKILL included).

Ray's GCS and raylet share the fate of the process that started them, but its dashboard and
runtime-env agents do not (measured with Ray 2.60: both still ran 40 s after a SIGKILL of the
driver, re-parented to init). They rename themselves (`ray::DashboardAgent`), so they cannot be
found by their command line afterwards. The watchdog is a small process of its own: it notes the
server's descendants every WATCH_PERIOD_S and, once its stdin reaches end of file (the server
closed it, or died and the kernel closed it), stops every noted process that still runs.

    reaper = start_reaper()      # after ray.init, in the server
    ...
    reaper.close()               # after ray.shutdown(): stops whatever Ray left behind
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

WATCH_PERIOD_S = 0.5
STOP_GRACE_S = 3.0


class Reaper:
    """The server's end of a watchdog: closing it (or dying) makes the watchdog act."""

    def __init__(self, proc: subprocess.Popen, pipe: int) -> None:
        self.proc, self._pipe = proc, pipe

    def close(self, *, timeout_s: float = 10.0) -> None:
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_reaper() -> Reaper:
    """Start a watchdog over this process's descendants (see the module docstring)."""
    read_end, write_end = os.pipe()  # write_end is not inherited: Ray's children do not hold it open
    try:
        code = "from meshserve.cluster.executors.ray_reaper import main; main()"
        proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=read_end, start_new_session=True)
    finally:
        os.close(read_end)
    return Reaper(proc, write_end)


def main() -> None:
    import psutil

    server = psutil.Process(int(sys.argv[1]))
    noted: dict[int, psutil.Process] = {}
    fd = sys.stdin.fileno()
    while True:
        try:
            for child in server.children(recursive=True):
                noted.setdefault(child.pid, child)  # a psutil.Process knows its start time: no pid reuse
        except psutil.NoSuchProcess:
            pass
        ready, _, _ = select.select([fd], [], [], WATCH_PERIOD_S)
        if ready and not os.read(fd, 4096):
            break
    alive = [p for p in noted.values() if p.pid != os.getpid() and p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    for p in still:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(still, timeout=STOP_GRACE_S)
