"""Worker stand-ins for the fault tests (cluster/migration.py), loaded by rank processes and threads
by their "module:Class" name.

PacedNullWorker / PacedWorker: a step takes at least STEP_S, as a real model's does, so that a
stream runs long enough to be interrupted by a fault. FlakyNullWorker: start() fails while
`start_failures` > 0 (ranks on threads share the class, so a test sets it).
"""

from __future__ import annotations

import time

from meshserve.cluster.null_worker import NullWorker
from meshserve.workers.worker import Worker

STEP_S = 0.02


class PacedNullWorker(NullWorker):
    def execute_step(self, plan_bytes: bytes) -> bytes:
        time.sleep(STEP_S)
        return super().execute_step(plan_bytes)


class PacedWorker(Worker):
    def execute_step(self, plan_bytes: bytes) -> bytes:
        time.sleep(STEP_S)
        return super().execute_step(plan_bytes)


class FlakyNullWorker(NullWorker):
    start_failures = 0

    def start(self):
        if FlakyNullWorker.start_failures > 0:
            FlakyNullWorker.start_failures -= 1
            raise RuntimeError("injected start failure")
        return super().start()
