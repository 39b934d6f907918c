"""A watchdog that stops the embedded Ray cluster's processes when the server that started them
dies, however it dies (SIGKILL included).

Ray's GCS and raylet share the fate of the process that started them, but its dashboard and
runtime-env agents do not (measured with Ray 2.60: both still ran 40 s after a SIGKILL of the
driver, re-parented to init). They rename themselves (`ray::DashboardAgent`), so they cannot be
found by their command line afterwards. The watchdog is a small process of its own: it notes
Ray's processes (those ray.init started: `roots`) and their descendants every WATCH_PERIOD_S
and, once its stdin reaches end of file (the server closed it, or died and the kernel closed
it), stops every noted process that still runs. Only Ray's: the server's other children (an
application that embeds meshserve, multiprocessing's resource tracker) are none of its business.

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(...)
    reaper = start_reaper(pids_ray_init_added)   # in the server
    ...
    reaper.close()               # after ray.shutdown(): stops whatever Ray left behind
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Iterable

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


def start_reaper(roots: Iterable[int]) -> Reaper:
    """Start a watchdog over the processes `roots` (pids: what ray.init started) and their
    descendants (see the module docstring)."""
    read_end, write_end = os.pipe()  # write_end is not inherited: Ray's children do not hold it open
    try:
        code = "from meshserve.cluster.executors.ray_reaper import main; main()"
        proc = subprocess.Popen([sys.executable, "-c", code, *map(str, sorted(roots))], stdin=read_end,
                                start_new_session=True)
    finally:
        os.close(read_end)
    return Reaper(proc, write_end)


def main() -> None:
    import psutil

    noted: dict[int, psutil.Process] = {}  # a psutil.Process knows its start time: no pid reuse
    for pid in sys.argv[1:]:
        try:
            noted[int(pid)] = psutil.Process(int(pid))
        except psutil.NoSuchProcess:
            pass
    fd = sys.stdin.fileno()
    while True:
        for proc in list(noted.values()):  # their children as they come (Ray's workers and agents)
            try:
                for child in proc.children(recursive=True):
                    noted.setdefault(child.pid, child)
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
