"""grpc.health.v1 follows the replica: it dies (a step raises), health turns NOT_SERVING, the
stream it served ends UNAVAILABLE, new requests are refused UNAVAILABLE; the replica is rebuilt
and health turns SERVING again, and requests are served with every KV block accounted for.

The crash is injected into the worker of the live replica; the rebuild is held at a gate so
that the test sees the unhealthy state for as long as it needs.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.api.client import InferenceClient
from tests.integration.api_harness import ServerLoop, demo_service, rpc_error, wait_for, wait_idle

# A hung server or stream fails the test in minutes, not at the suite's 10-minute limit.
pytestmark = pytest.mark.timeout(180)

SERVICE = "meshserve.v1.Inference"


@pytest.fixture(scope="module")
def served():
    service = demo_service(max_model_len=256, num_kv_blocks=40)
    loop = ServerLoop()
    server = loop.serve(service)
    yield service, server
    loop.close(service)


class Watcher:
    """Records every status a grpc.health.v1 Watch stream sends, in a thread."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.seen: list[str] = []
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()


def test_health_flips_when_the_replica_dies_and_recovers(served):
    service, server = served
    client = InferenceClient(server.address)
    watcher = Watcher(server.address)
    try:
        wait_for(lambda: watcher.seen == ["SERVING"], what="the first health status", timeout=30)
        assert client.generate("Hello", max_tokens=3, temperature=0).finish_reason

        gate = threading.Event()
        make_core = service._make_core  # builds a replica's engine, in a thread
        service._make_core = lambda *a: (gate.wait(120), make_core(*a))[1]  # hold the rebuild while the test looks
        worker = service.replicas()[0].executor.worker  # the in-process rank's Worker

        def crash(plan):
            raise RuntimeError("simulated replica crash")

        worker.submit = crash  # how the in-process executor starts a step
        exc = rpc_error(client.generate, "Hello again", max_tokens=5)
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed" in exc.details() and "simulated replica crash" in exc.details()

        wait_for(lambda: watcher.seen[-1:] == ["NOT_SERVING"], what="NOT_SERVING on the Watch stream", timeout=30)
        assert client.health() == "NOT_SERVING" and client.health("") == "SERVING"
        refused = rpc_error(client.generate, "Anyone there?", max_tokens=2)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "no healthy replica" in refused.details()
        info = client.server_info()
        assert not info.serving and info.healthy_replicas == 0 and "simulated replica crash" in info.health_detail
        assert client.tokenize("Hi") and client.list_models()  # what needs no replica still answers

        gate.set()
        wait_for(lambda: watcher.seen[-1:] == ["SERVING"], what="SERVING again", timeout=120)
        assert watcher.seen == ["SERVING", "NOT_SERVING", "SERVING"]
        assert client.health() == "SERVING" and client.server_info().healthy_replicas == 1
        out = client.generate("The for statement is used to", max_tokens=6, temperature=0, ignore_eos=True)
        assert len(out.token_ids) == 6
        wait_idle(client, 39)  # the rebuilt replica's whole cache is free again
        assert client.server_info().stats.generated_tokens >= 3 + 6  # counters survive the rebuild
    finally:
        watcher.close()
        client.close()
