"""`serve` opens its ports before the service starts: health answers (readiness NOT_SERVING,
liveness SERVING) while replicas load or wait for placement; a failed start stops everything."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.api.health import INFERENCE_SERVICE
from meshserve.api.serve import run_server
from meshserve.cluster.service import ModelCard, ServiceHealth, ServiceStats
from meshserve.config import ServerConfig
from meshserve.errors import UnavailableError


class SlowStartService:
    """start() waits for `go` (as a placement wait would), or raises `fail` when set."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.go = asyncio.Event()
        self.fail = fail
        self.started = False
        self.shut_down = False

    async def start(self):
        await self.go.wait()
        if self.fail is not None:
            raise self.fail
        self.started = True
        return self

    def health(self) -> ServiceHealth:
        if self.started:
            return ServiceHealth(True, 1, 1)
        return ServiceHealth(False, 0, 1, "unified-0: starting", unserving_s=None, degraded_s=None)

    def stats(self) -> ServiceStats:
        return ServiceStats(0, 0, 0.0, 0, 0, 0, 0, 0)

    def models(self) -> list[ModelCard]:
        if not self.started:
            raise UnavailableError("the service is starting")
        return [ModelCard("slow", 64, 100)]

    async def shutdown(self, *, drain: bool = True) -> None:
        self.shut_down = True


async def _check(address: str, service: str) -> str:
    """The health status; waits (up to 10 s) for the server to listen."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=10, wait_for_ready=True)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(service, body):
    lines: list[str] = []
    announced = asyncio.Queue()

    def announce(line: str) -> None:
        lines.append(line)
        announced.put_nowait(line)

    async def main():
        port = _free_port()
        config = ServerConfig(port=port, metrics_port=0, http_port=None)
        server = asyncio.ensure_future(run_server(service, config, max_queue=4, drain_seconds=0, announce=announce))
        try:
            await body(f"127.0.0.1:{port}", announced)
        finally:
            if not server.done():
                os.kill(os.getpid(), signal.SIGTERM)  # run_server's own handler stops it
        return await asyncio.wait_for(server, 10)

    asyncio.run(main())
    return lines


def test_health_answers_not_serving_while_the_service_starts_then_serving():
    service = SlowStartService()

    async def body(address, announced):
        assert await _check(address, INFERENCE_SERVICE) == "NOT_SERVING"
        assert await _check(address, "") == "SERVING"  # start-up never fails liveness
        service.go.set()
        assert (await asyncio.wait_for(announced.get(), 10)).startswith("meshserve: serving slow on ")
        assert await _check(address, INFERENCE_SERVICE) == "SERVING"

    lines = _run(service, body)
    assert lines[-1] == "meshserve: stopped" and service.shut_down


def test_status_calls_answer_while_starting_and_generate_is_unavailable():
    from meshserve.v1 import inference_pb2 as pb
    from meshserve.v1 import inference_pb2_grpc as pb_grpc

    service = SlowStartService()

    async def body(address, announced):
        await _check(address, INFERENCE_SERVICE)  # listening
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            info = await stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
            assert (info.serving, list(info.models), info.health_detail) == (False, [], "unified-0: starting")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListModels(pb.ListModelsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the service is starting" in refused.value.details()

    _run(service, body)


def test_a_failed_start_stops_the_server_and_raises():
    service = SlowStartService(fail=UnavailableError("unified-0: gave up after --placement-timeout=5 s"))

    async def body(address, announced):
        assert await _check(address, INFERENCE_SERVICE) == "NOT_SERVING"
        service.go.set()

    with pytest.raises(UnavailableError, match="placement-timeout=5"):
        _run(service, body)
    assert service.shut_down


def test_a_stop_while_starting_cancels_the_start():
    service = SlowStartService()

    async def body(address, announced):
        assert await _check(address, INFERENCE_SERVICE) == "NOT_SERVING"

    lines = _run(service, body)
    assert not service.started and service.shut_down and lines[-1] == "meshserve: stopped"
