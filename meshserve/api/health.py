"""grpc.health.v1 for the server, the two answers Kubernetes probes ask for.

- "meshserve.v1.Inference" (readiness) is SERVING only while the service has a ready replica in
  every pool a request needs; NOT_SERVING while it starts (loading, waiting for Ray to place
  ranks), while a pool has no ready replica (failed replicas are being rebuilt), and on shutdown.
- "" (liveness) is SERVING while the server is up, unless the service, after serving once, has
  not served for `unhealthy_liveness_s`: rebuilding has not helped for that long, and a restart
  of the process (a fresh Ray driver, fresh placement) is the remedy left. Start-up never fails
  liveness: the startup probe and --placement-timeout bound it.

The service is polled (a cheap, in-memory read) every `interval` seconds and the status is set
when it changes, so Check answers at once and Watch streams see every flip. On shutdown both
turn NOT_SERVING before the server stops taking calls, so probes fail while it drains.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2

from meshserve.cluster.service import InferenceService
from meshserve.core.tasks import cancel_and_wait

INFERENCE_SERVICE = "meshserve.v1.Inference"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = logging.getLogger("meshserve.api")


class HealthReporter:
    def __init__(self, service: InferenceService, *, interval: float = 0.2,
                 unhealthy_liveness_s: float = 300.0) -> None:
        self.service = service
        self.interval = interval
        self.unhealthy_liveness_s = unhealthy_liveness_s
        self.servicer = health.aio.HealthServicer()
        self._task: asyncio.Task | None = None
        self._serving: bool | None = None
        self._live = True

    async def start(self) -> None:
        await self.servicer.set("", SERVING)
        await self.update()
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def update(self) -> None:
        """Read the service's health now and set both statuses (the poll does it every `interval`)."""
        state = self.service.health()
        live = state.unserving_s is None or state.unserving_s <= self.unhealthy_liveness_s
        if live != self._live:
            self._live = live
            if live:
                log.warning("liveness SERVING again: the service serves")
            else:
                log.error("liveness NOT_SERVING: the service has not served for %.0f s (more than "
                          "--unhealthy-liveness-seconds=%g): %s", state.unserving_s, self.unhealthy_liveness_s,
                          state.detail or "no replica ready")
            await self.servicer.set("", SERVING if live else NOT_SERVING)
        if state.serving != self._serving:
            if self._serving is not None:
                log.log(logging.INFO if state.serving else logging.WARNING, "health of %s: %s%s", INFERENCE_SERVICE,
                        "SERVING" if state.serving else "NOT_SERVING", f" ({state.detail})" if state.detail else "")
            self._serving = state.serving
            await self.servicer.set(INFERENCE_SERVICE, SERVING if state.serving else NOT_SERVING)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.update()

    async def stop(self) -> None:
        """Every service NOT_SERVING from now on (draining)."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self.servicer.enter_graceful_shutdown()
