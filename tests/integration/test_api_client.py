"""The Python clients: typed results, the asyncio client, wait_for_ready, and gRPC's own retries.

The typed results must carry what the server's protocol says (ServerInfo against the service's
cards and stats); the asyncio client must give what the synchronous one gives; the retry policy
is checked against a server that answers UNAVAILABLE a set number of times and counts the
attempts it saw (idempotent calls retried, Generate not).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import grpc
import pytest

from meshserve.api.client import AsyncInferenceClient, InferenceClient, ModelInfo, ServerInfo, ServerStats
from meshserve.api.server import ApiServer
from meshserve.config import ServerConfig
from meshserve.v1 import inference_pb2 as pb
from tests.integration.api_harness import ServerLoop, demo_service, wait_idle

pytestmark = pytest.mark.timeout(180)
PROMPT = "The for statement is used to"


@pytest.fixture(scope="module")
def served():
    service = demo_service(max_model_len=256, num_kv_blocks=64)
    loop = ServerLoop()
    server = loop.serve(service)
    client = InferenceClient(server.address)
    yield client, server, service, loop
    client.close()
    loop.close(service)


def test_typed_results(served):
    client, _, service, _ = served
    (card,) = service.models()
    assert client.list_models() == [ModelInfo(card.name, card.max_model_len, card.vocab_size, card.task)]
    info = client.server_info()
    assert isinstance(info, ServerInfo) and isinstance(info.stats, ServerStats)
    assert info.models == (ModelInfo(card.name, card.max_model_len, card.vocab_size, card.task),)
    assert info.stats.num_free_kv_blocks == service.stats().num_free_kv_blocks
    assert (info.serving, info.healthy_replicas, info.total_replicas) == (True, 1, 1)
    assert info.limits.max_logprobs == 20 and not info.auth_required
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.serving = False


def test_the_async_client_gives_what_the_sync_one_gives(served):
    client, server, _, _ = served
    free = client.server_info().stats.num_free_kv_blocks
    want = client.generate(PROMPT, max_tokens=16, temperature=0, logprobs=1)

    async def run():
        async with AsyncInferenceClient(server.address) as aclient:
            got = await aclient.generate(PROMPT, max_tokens=16, temperature=0, logprobs=1)
            pieces = [t async for t in aclient.stream_text(PROMPT, max_tokens=16, temperature=0)]
            async for _ in aclient.stream(PROMPT, max_tokens=200, ignore_eos=True):
                break  # leaving early cancels the call: the server aborts the request
            return (got, pieces, await aclient.tokenize(PROMPT), await aclient.list_models(),
                    await aclient.server_info(), await aclient.health())

    got, pieces, ids, models, info, health = asyncio.run(run())
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
    assert "".join(pieces) == want.text and ids == client.tokenize(PROMPT)
    assert models == client.list_models() and info.models == tuple(models) and health == "SERVING"
    stats = wait_idle(client, free)
    assert stats.num_running == 0


def test_wait_for_ready_waits_for_a_server_that_starts_later(served):
    client, _, service, loop = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with InferenceClient(address) as eager:  # without it: UNAVAILABLE at once
        with pytest.raises(grpc.RpcError) as info:
            eager.tokenize("Hi", timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    async def run() -> list[int]:
        async with AsyncInferenceClient(address, wait_for_ready=True) as patient:
            call = asyncio.ensure_future(patient.tokenize("Hi", timeout=60))
            state = patient.channel.get_state(try_to_connect=True)
            while state != grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # it tried, and found no server
                await patient.channel.wait_for_state_change(state)
                state = patient.channel.get_state()
            assert not call.done()  # waiting, not failed
            server = ApiServer(service, ServerConfig(port=port, metrics_port=0), max_queue=8, metrics=False)
            await asyncio.to_thread(loop.run, server.start())
            loop.servers.append(server)  # stopped with the others
            return await call

    assert asyncio.run(run()) == client.tokenize("Hi")


class _Flaky:
    """Answers UNAVAILABLE to the first `failures` Tokenize calls, and to every Generate."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = {"Tokenize": 0, "Generate": 0}

    async def Tokenize(self, request, context):
        self.calls["Tokenize"] += 1
        if self.calls["Tokenize"] <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb.TokenizeResponse(token_ids=[1, 2, 3])

    async def Generate(self, request, context):
        self.calls["Generate"] += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        yield pb.GenerateResponse()  # never reached: makes this a streaming handler

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler("meshserve.v1.Inference", {
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self.Tokenize, request_deserializer=pb.TokenizeRequest.FromString,
                response_serializer=pb.TokenizeResponse.SerializeToString),
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString)})


@pytest.mark.parametrize("failures,retries,ok,attempts", [
    (2, True, True, 3),     # retried until it answers
    (9, True, False, 5),    # at most maxAttempts
    (2, False, False, 1),   # retries=False: the first answer stands
])
def test_idempotent_calls_are_retried_on_unavailable_and_generate_is_not(failures, retries, ok, attempts):
    flaky = _Flaky(failures)
    loop = ServerLoop()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([flaky.handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    try:
        with InferenceClient(f"127.0.0.1:{port}", retries=retries) as client:
            if ok:
                assert client.tokenize("Hi", timeout=30) == [1, 2, 3]
            else:
                with pytest.raises(grpc.RpcError) as info:
                    client.tokenize("Hi", timeout=30)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as info:
                client.generate("Hi", timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert flaky.calls == {"Tokenize": attempts, "Generate": 1}
    finally:
        loop.run(server.stop(0))
        loop.close()
