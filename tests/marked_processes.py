"""The processes a test started, found by an environment variable it gave the first of them
(children inherit it), so that other processes on the machine (another Ray cluster) do not count.

    env = {**os.environ, MARK: uuid.uuid4().hex}   # the process the test starts
    assert left_running(env[MARK]) == []           # after it was stopped or killed
"""

from __future__ import annotations

import time

import psutil

MARK = "MESHSERVE_TEST_PROCESS_MARK"
GONE_WITHIN_S = 30  # bound of the wait for the processes to go; it ends as soon as they are gone


def marked(mark: str) -> list[psutil.Process]:
    """Running processes (zombies excluded) whose environment carries `mark`."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == mark:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def left_running(mark: str) -> list[str]:
    """'pid name' of each marked process still running after up to GONE_WITHIN_S seconds."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while (procs := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"{p.pid} {p.name()}" for p in procs if p.is_running()]
