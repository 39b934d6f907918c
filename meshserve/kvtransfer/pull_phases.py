"""When each step of one KV pull ended: what `bench/kv_handover.py --phases` prints per transport.

    phases = PullPhases()
    puller.pull(target, endpoint, capability, ..., phases=phases)
    phases.durations()      # {"offer": s, "header": s, ..., "total": s}, in the order they ran

A puller marks the end of each step it takes (`phases.mark("post")`); a step's duration runs from
the previous mark (or the start) to its own. Pulls that nobody times take `UNTIMED`, whose `mark`
does nothing, so the pull path has no branch for it.

Steps the built-in pullers mark (a step a pull does not take is absent):
  offer    the direct offer opened (its MAC checked) and the capability spent here
  request  zmq: the pull request sent and the first answer in
  header   the header decoded and checked, blocks reserved (begin_import)
  peer     NIXL: the exporter's agent and prepared list found (loaded on first contact)
  indices  NIXL: our and the peer's descriptor indices of every block
  map      CUDA IPC: the exporter's allocations mapped (kept from earlier pulls) and the frames' views made
  prep     NIXL: the READ made from the two prepared lists and the index arrays (make_prepped_xfer)
  post     NIXL: the READ posted (on one host, CMA copies happen here; UCX queues CUDA IPC copies)
  launch   CUDA IPC: every copy queued on the importer's side stream
  frames   zmq: every frame received and written
  wait     the transfer polled (NIXL) or waited for (CUDA IPC: this pull's event) until done
  release  NIXL: the transfer handle released
  accept   the frames taken as written (sizes, order; the checksum where it is checked)
  notify   the exporter told that the pull ended (one zmq message, no answer)
  finish   the import finished (the driver's commit where the target does it)
"""

from __future__ import annotations

import time


class PullPhases:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        self.marks.append((step, time.perf_counter()))

    def durations(self) -> dict[str, float]:
        """Seconds per step (a step marked twice adds up), and "total": start to the last mark."""
        out: dict[str, float] = {}
        last = self.start
        for step, at in self.marks:
            out[step] = out.get(step, 0.0) + at - last
            last = at
        out["total"] = last - self.start
        return out


class _Untimed:
    """A PullPhases that records nothing (the default of every pull)."""

    def mark(self, step: str) -> None:
        pass


UNTIMED = _Untimed()
