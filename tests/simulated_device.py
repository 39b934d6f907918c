"""A worker with a simulated device, for overlap scheduling on a CPU: NullWorker's deterministic
tokens, and each submitted step "on the device" for MESHSERVE_BENCH_DEVICE_MS after the step
before it ends (the host is free meanwhile, as with CUDA kernels queued); `collect` waits for it.
Read at construction, so a rank in a subprocess takes it from the environment too.

    worker_class = "tests.simulated_device:SimulatedDeviceWorker"
"""

from __future__ import annotations

import os
import time

from tests.null_worker import NullWorker

WORKER = "tests.simulated_device:SimulatedDeviceWorker"
DEVICE_ENV = "MESHSERVE_BENCH_DEVICE_MS"


class SimulatedDeviceWorker(NullWorker):
    """NullWorker (no agreement check: tp=1) whose steps take DEVICE_ENV ms of "device" time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device_s = float(os.environ.get(DEVICE_ENV, "0")) / 1e3
        self._busy_until = 0.0
        self._submitted: list[tuple[bytes, float]] = []

    def _queue(self) -> float:
        self._busy_until = max(self._busy_until, time.monotonic()) + self.device_s
        return self._busy_until

    def execute_step(self, plan_bytes: bytes) -> bytes:  # without overlap: the host waits for the step
        time.sleep(max(0.0, self._queue() - time.monotonic()))
        return super().execute_step(plan_bytes)

    def submit(self, plan) -> None:
        self._submitted.append((plan.to_msgpack(), self._queue()))

    def step_ready(self) -> bool:
        return not self._submitted or time.monotonic() >= self._submitted[0][1]

    def collect(self):
        from meshserve.workers.step import StepOutput

        plan, done = self._submitted.pop(0)
        time.sleep(max(0.0, done - time.monotonic()))
        return StepOutput.from_msgpack(NullWorker.execute_step(self, plan))
