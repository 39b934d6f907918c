"""Worker stand-ins for the fault tests (cluster/migration.py), loaded by rank processes and threads
by their "module:Class" name.

PacedNullWorker / PacedWorker: a step takes at least STEP_S, as a real model's does, so that a
stream runs long enough to be interrupted by a fault. FlakyNullWorker: start() fails while
`start_failures` > 0. DyingWorker (the real model, paced): the first step that carries the
request `DyingWorker.doomed` (a client id) ends its rank's thread, as a process that dies ends
its rank: the launcher reports the rank gone. OverlapNullWorker: submit/collect as the Worker's
(overlap scheduling), the step computed at collect. Ranks on threads share these classes, so a
test sets the class attributes.
"""

from __future__ import annotations

import time

from meshserve.workers.step import StepOutput, StepPlan
from meshserve.workers.worker import Worker
from tests.null_worker import NullWorker

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


class DyingWorker(PacedWorker):
    doomed: str | None = None

    def execute_step(self, plan_bytes: bytes) -> bytes:
        target = DyingWorker.doomed
        if target is not None and any(s.request_id.endswith(f":{target}")
                                      for s in StepPlan.from_msgpack(plan_bytes).all_seqs()):
            DyingWorker.doomed = None  # once: the replica it moves to lives
            raise SystemExit(f"rank died under {target}")  # not an Exception: the rank loop ends
        return super().execute_step(plan_bytes)


class OverlapNullWorker(NullWorker):
    """A NullWorker with the Worker's submit/collect pair, computing each step at `collect`, so that
    a poisoned step fails at its collect (a submitted step's kernels failing on the device).
    DEVICE_S > 0: a step is "on the device" that long after its submit, as on a GPU: `step_ready`
    says False meanwhile and `collect` waits for it."""

    DEVICE_S = 0.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._submitted: list[tuple[StepPlan, float]] = []  # (plan, when its "device" work ends)

    def submit(self, plan: StepPlan) -> None:
        start = self._submitted[-1][1] if self._submitted else time.monotonic()  # behind the step before
        self._submitted.append((plan, max(start, time.monotonic()) + OverlapNullWorker.DEVICE_S))

    def step_ready(self) -> bool:
        return not self._submitted or time.monotonic() >= self._submitted[0][1]

    def collect(self) -> StepOutput:
        plan, done = self._submitted.pop(0)
        time.sleep(max(0.0, done - time.monotonic()))
        return StepOutput.from_msgpack(self.execute_step(plan.to_msgpack()))
