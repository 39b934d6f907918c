"""Real gRPC servers on loopback for the API tests, and helpers to talk to them.

A `ServerLoop` is an event loop in a daemon thread; ApiServers over one Coordinator (the default
`serve` stack: one in-process replica) run on it (one service may sit behind several servers,
e.g. with and without TLS). Clients are the real ones (meshserve.api.client, or raw grpc
channels for bytes a client would never send).

MESHSERVE_TEST_ENGINE_PROCESS=1 puts the front-end channel of `serve --engine-process` between
the servers and the Coordinator (`ServerLoop.front`: an EngineClient over a ServiceEndpoint, on
a real ipc socket), so that the same tests check the split.

The loop is asyncio's, as `meshserve serve` runs by default; MESHSERVE_TEST_UVLOOP=1 runs the same
tests on uvloop's (`serve --uvloop`, api/event_loop.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import grpc

from meshserve.api.client import InferenceClient, ServerStats
from meshserve.api.convert import ApiLimits
from meshserve.api.event_loop import loop_factory
from meshserve.api.server import ApiServer
from meshserve.cluster.coordinator import ClusterConfig, Coordinator
from meshserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine.engine_config import EngineConfig
from meshserve.v1 import inference_pb2 as pb


def demo_service(*, max_model_len: int = 512, num_kv_blocks: int | None = 200, max_num_seqs: int = 64,
                 max_queue: int = 256, block_size: int = 16) -> Coordinator:
    """The bundled demo model, float32 on CPU, TORCH attention, as `meshserve serve` runs it
    (not started: `ServerLoop.serve` starts it on the server's loop)."""
    from meshserve.config import AttentionConfig

    config = EngineConfig(
        model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, max_queue=max_queue),
        attention=AttentionConfig(backend="TORCH"),
    )
    return Coordinator(ClusterConfig(engine=config, runtime="in-process", device="cpu"))


SPLIT = os.environ.get("MESHSERVE_TEST_ENGINE_PROCESS") == "1"
LOOP_FACTORY = loop_factory(use_uvloop=os.environ.get("MESHSERVE_TEST_UVLOOP") == "1") or asyncio.new_event_loop


class ServerLoop:
    """An asyncio loop in a thread that hosts ApiServers; `run(coro)` from the test thread."""

    def __init__(self) -> None:
        self.loop = LOOP_FACTORY()
        self.thread = threading.Thread(target=self.loop.run_forever, name="api-test-loop", daemon=True)
        self.thread.start()
        self.servers: list[ApiServer] = []
        self._fronts: dict[int, tuple] = {}  # id(service) -> (client, endpoint, its task, socket folder)

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, service, *, limits: ApiLimits = ApiLimits(), **server_config) -> ApiServer:
        """An ApiServer over `service` (started here the first time it is served)."""
        if isinstance(service, Coordinator) and not service.pools:
            self.run(service.start())
        config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, **server_config)
        server = ApiServer(self.front(service), config, max_queue=service.max_queue, limits=limits,
                           health_interval=0.05)
        self.run(server.start())
        self.servers.append(server)
        return server

    def front(self, service):
        """What the front-ends of `service` talk to: the service itself, or with SPLIT (a started
        Coordinator) an EngineClient over a ServiceEndpoint of it (one per service)."""
        if not SPLIT or not isinstance(service, Coordinator):
            return service
        if id(service) in self._fronts:
            return self._fronts[id(service)][0]
        from meshserve.api.engine_client import EngineClient
        from meshserve.cluster.service_endpoint import ServiceEndpoint
        from meshserve.cluster.service_wire import ChannelKey
        from meshserve.core.secret import ClusterSecret

        if not service.pools:
            self.run(service.start())
        folder = tempfile.mkdtemp(prefix="meshserve-split-")
        address = f"ipc://{folder}/engine.sock"
        key = ChannelKey(ClusterSecret.generate(), secrets.token_bytes(16))

        async def up():
            endpoint = ServiceEndpoint(service, address, key)
            task = asyncio.get_running_loop().create_task(endpoint.run(start=False))
            client = EngineClient(address, key, model_dir=service.config.engine.model.model,
                                  max_queue=service.max_queue)
            await client.start()
            return client, endpoint, task, folder

        self._fronts[id(service)] = self.run(up())
        return self._fronts[id(service)][0]

    def close(self, *services: Coordinator) -> None:
        for server in self.servers:
            self.run(server.stop(grace=0))
        for client, endpoint, task, folder in self._fronts.values():
            async def down(client=client, endpoint=endpoint, task=task):
                async def engine_side():
                    endpoint.stop()
                    await task
                    await endpoint.close()
                await asyncio.gather(client.shutdown(drain=False), engine_side())
            self.run(down())
            shutil.rmtree(folder, ignore_errors=True)
        for service in services:
            self.run(service.shutdown(drain=False))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def wait_for(predicate: Callable[[], bool], *, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll until `predicate()` holds (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def wait_idle(client: InferenceClient, free_blocks: int, *, timeout: float = 60.0) -> ServerStats:
    """Wait until nothing runs or waits and the KV free-block count is `free_blocks` again."""
    last = {}

    def idle() -> bool:
        s = client.server_info().stats
        last["stats"] = s
        return s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == free_blocks

    try:
        wait_for(idle, timeout=timeout, what=f"an idle server with {free_blocks} free KV blocks")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last stats: {last.get('stats')}") from None
    return last["stats"]


def raw_generate(address: str, body: bytes, *, metadata=(), timeout: float = 30.0) -> list[pb.GenerateResponse]:
    """Send `body` as the Generate request bytes, unchecked (for what clients cannot build)."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_stream("/meshserve.v1.Inference/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        return list(call(body, metadata=metadata, timeout=timeout))


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """The RpcError `fn(*args, **kwargs)` ends with (iterating it when it is a stream)."""
    try:
        result = fn(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} succeeded; an error was expected")
