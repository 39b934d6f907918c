"""grpc.health.v1 for the server: "" is SERVING while the server is up; "meshserve.v1.Inference"
is SERVING only while the service has a healthy replica for every pool a request needs.

The service is polled (a cheap, in-memory read) every `interval` seconds and the status is set
when it changes, so Check answers at once and Watch streams see every flip. On shutdown both
turn NOT_SERVING before the server stops taking calls, so probes fail while it drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from grpc_health.v1 import health, health_pb2

from meshserve.cluster.service import InferenceService

INFERENCE_SERVICE = "meshserve.v1.Inference"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = logging.getLogger("meshserve.api")


class HealthReporter:
    def __init__(self, service: InferenceService, *, interval: float = 0.2) -> None:
        self.service = service
        self.interval = interval
        self.servicer = health.aio.HealthServicer()
        self._task: asyncio.Task | None = None
        self._serving: bool | None = None

    async def start(self) -> None:
        await self.servicer.set("", SERVING)
        await self._update()
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _update(self) -> None:
        state = self.service.health()
        if state.serving != self._serving:
            if self._serving is not None:
                log.warning("health of %s: %s%s", INFERENCE_SERVICE, "SERVING" if state.serving else "NOT_SERVING",
                            f" ({state.detail})" if state.detail else "")
            self._serving = state.serving
            await self.servicer.set(INFERENCE_SERVICE, SERVING if state.serving else NOT_SERVING)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._update()

    async def stop(self) -> None:
        """Every service NOT_SERVING from now on (draining)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.servicer.enter_graceful_shutdown()
