"""Time stamps of a request's way through `meshserve serve`, hop by hop (bench/serve_latency.py).

Off unless the environment's MESHSERVE_HOP_TRACE names a file when this module is imported:
then every `mark(stage, *keys)` appends one line "<ns> <pid> <stage>[ <key>...]" to it
(CLOCK_MONOTONIC, which every process of the machine shares, so the front-end's and the
engine's marks line up with the client's `time.perf_counter_ns()`). Off, a mark is one global
read and a return. The serving processes inherit the environment, so one variable traces all
of them; each line is one O_APPEND write, whole even with several processes writing.

The keys say which requests a mark is about, so that a reader attributes marks by identity,
not by their order among other streams' marks. A per-request mark carries its request's id:
the face's marks the client's (gRPC's request_id, HTTP's x-request-id), the front-end's and
the endpoint's the service's, the replica's the engine's; a mark that knows two carries both,
which links them (grpc.write, http.tokenized, coordinator.submitted). A per-step or per-pass
mark (step.end, engine.batch, frontend.batch_received) carries the ids of the requests whose
first token it carried (only those: rarely more than a few). A key that costs work to compute
is computed only under `enabled()`.

The marks are placed where a request crosses from one part to the next (api/, the front-end
channel, the coordinator, the replica's loop and step thread; in disaggregated serving the
hand-over's steps, `handover.*`, and a rank's step, offer and pull, `rank.*`, unkeyed);
docs/performance.md ("Served time to first token, hop by hop"; "The first token before the KV
offer", with bench/disagg_hops.py) lists them and what each interval costs.
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


def _key(key: str | bytes | int) -> str:
    """One key as one word of the line (a client's id could hold a space or a newline)."""
    text = key.decode("ascii", "replace") if isinstance(key, bytes) else str(key)
    return "".join(text.split())


def mark(stage: str, key: str | bytes | int | None = None, /, *more: str | bytes | int | None) -> None:
    """Record that the requests `key`, `*more` name (request ids; None and "" are left out)
    reached `stage`. (The first key is a parameter of its own: off, a mark with one key builds
    no tuple and costs what a mark without one does.)"""
    if _fd is None:
        return
    now = time.perf_counter_ns()
    words = [_key(k) for k in (key, *more) if k]
    line = f"{now} {os.getpid()} {stage}" + "".join(f" {w}" for w in words if w)
    os.write(_fd, (line + "\n").encode())
