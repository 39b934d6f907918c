"""A watchdog that ends the embedded Ray cluster's processes when the server ends, SIGKILL included.

`ray.init()` without an address starts Ray's own processes (gcs_server, raylet, the log and
dashboard agents, workers) as children of the server. When the server is SIGKILLed, nothing in
it runs to stop them, and some live on for a minute or more. The watchdog is a small separate
process holding the read end of a pipe whose write end only the server holds: the kernel closes
it when the server ends however it ends, the watchdog reads EOF, and then terminates the
processes it was told of (and whatever descendants they have by then), SIGKILLing any still
there GRACE_S later. Processes are named by (pid, create time), so a pid the system has since
reused is left alone. An orderly `ray.shutdown()` leaves nothing for it to do.

    before = RayReaper.children()
    ray.init()                     # starts an embedded cluster
    reaper = RayReaper.start(existing=before)
    ...
    reaper.close()                 # after ray.shutdown(): the watchdog sweeps what is left, exits
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

GRACE_S = 2.0  # SIGTERM, then this long before SIGKILL


class RayReaper:
    """The server's end of the watchdog: it names the processes to end (the children this process
    has now), and closing it (or this process ending) sets the watchdog off."""

    def __init__(self, process: subprocess.Popen, pipe: int) -> None:
        self.process = process
        self._pipe = pipe

    @staticmethod
    def children() -> set[int]:
        """Pids of this process's descendants now (taken before ray.init, to tell Ray's apart)."""
        return {p.pid for p in psutil.Process().children(recursive=True)}

    @classmethod
    def start(cls, *, existing: set[int] = frozenset()) -> RayReaper:
        """A watchdog over this process's descendants, except those in `existing`."""
        children = [p for p in psutil.Process().children(recursive=True) if p.pid not in existing]
        read, write = os.pipe()
        os.set_inheritable(write, False)
        # Its own session: a ^C to the server's group spares it. Not the server's stdout: a
        # script reading that to its end must not wait for the watchdog.
        process = subprocess.Popen([sys.executable, "-m", "meshserve.cluster.ray_reaper"], stdin=read,
                                   stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        os.close(read)
        reaper = cls(process, write)
        reaper.watch(children)
        return reaper

    def watch(self, processes) -> None:
        """Add processes (psutil.Process) for the watchdog to end."""
        lines = []
        for p in processes:
            with contextlib.suppress(psutil.Error):
                lines.append(f"{p.pid} {p.create_time()!r}\n")
        if lines and self._pipe >= 0:
            os.write(self._pipe, "".join(lines).encode())

    def close(self, *, wait_s: float = GRACE_S + 2) -> None:
        """Set the watchdog off now and wait for it."""
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(wait_s)


def _alive(pid: int, create_time: float) -> psutil.Process | None:
    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - create_time) < 1e-3 else None
    except psutil.Error:
        return None


def reap(named: list[tuple[int, float]], *, grace_s: float = GRACE_S) -> int:
    """Terminate the named processes and their descendants; SIGKILL what is left after grace_s.
    Returns how many were found alive."""
    targets: dict[int, psutil.Process] = {}
    for pid, created in named:
        p = _alive(pid, created)
        if p is None:
            continue
        targets[p.pid] = p
        with contextlib.suppress(psutil.Error):
            targets.update((c.pid, c) for c in p.children(recursive=True))
    targets.pop(os.getpid(), None)
    for p in targets.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(list(targets.values()), timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=1.0)
    return len(targets)


def main() -> int:
    named = []
    for line in sys.stdin:  # until EOF: the server closed its end, or ended
        with contextlib.suppress(ValueError):
            pid, created = line.split()
            named.append((int(pid), float(created)))
    started = time.monotonic()
    found = reap(named)
    if found:
        print(f"meshserve ray reaper: ended {found} leftover Ray process(es) in {time.monotonic() - started:.1f} s",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
