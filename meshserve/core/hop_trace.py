"""Time stamps of a request's way through `meshserve serve`, hop by hop (bench/serve_latency.py).

Off unless the environment's MESHSERVE_HOP_TRACE names a file when this module is imported:
then every `mark(stage)` appends one line "<ns> <pid> <stage>" to it (CLOCK_MONOTONIC, which
every process of the machine shares, so the front-end's and the engine's marks line up with the
client's `time.perf_counter_ns()`). Off, a mark is one global read and a return. The serving
processes inherit the environment, so one variable traces all of them; each line is one
O_APPEND write, whole even with several processes writing.

The marks are placed where a request crosses from one part to the next (api/, the front-end
channel, the coordinator, the replica's loop and step thread; in disaggregated serving the
hand-over's steps, `handover.*`, and a rank's step, offer and pull, `rank.*`); docs/performance.md
("Served time to first token, hop by hop"; "The first token before the KV offer", with
bench/disagg_hops.py) lists them and what each interval costs.
"""

from __future__ import annotations

import os
import time

ENV = "MESHSERVE_HOP_TRACE"


def _open() -> int | None:
    path = os.environ.get(ENV)
    if not path:
        return None
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


_fd = _open()


def enabled() -> bool:
    return _fd is not None


def mark(stage: str) -> None:
    """Record that a request (the one in flight: the bench sends one at a time) reached `stage`."""
    if _fd is None:
        return
    os.write(_fd, f"{time.perf_counter_ns()} {os.getpid()} {stage}\n".encode())
