"""Bad input over a real gRPC connection: each case gets its status code and a message naming the
field, the value and what is allowed; afterwards the server still serves and every KV block is
free again. Also: queue full, duplicate request ids, Tokenize/Abort refusals.

The server: the demo model with max_model_len 256 and a KV cache of 23 usable blocks of 16
tokens, 2 running and 2 waiting requests at most, 1 MiB messages. (A prompt beyond the KV cache
is beyond max_model_len too: the worker sizes the cache for at least one full sequence.)
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import grpc
import pytest

from meshserve.api.client import InferenceClient
from meshserve.v1 import inference_pb2 as pb
from tests.integration.api_harness import ServerLoop, demo_service, raw_generate, rpc_error, wait_for, wait_idle

# A hung server or stream fails the test in minutes, not at the suite's 10-minute limit.
pytestmark = pytest.mark.timeout(180)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def served():
    service = demo_service(max_model_len=256, num_kv_blocks=24, max_num_seqs=2, max_queue=2)
    loop = ServerLoop()
    server = loop.serve(service, max_message_bytes=1 << 20)
    client = InferenceClient(server.address, max_message_bytes=4 << 20)
    free_at_start = client.server_info().stats.num_free_kv_blocks
    assert free_at_start == 23
    yield client, server.address, free_at_start
    client.close()
    loop.close(service)


def ids(n: int, start: int = 10) -> list[int]:
    return [start + i % 3000 for i in range(n)]


def req(prompt=(5, 6, 7, 8, 9, 10, 11, 12), **sampling) -> pb.GenerateRequest:
    return InferenceClient.request(list(prompt) if not isinstance(prompt, str) else prompt, **sampling)


@dataclass
class Case:
    name: str
    request: pb.GenerateRequest | bytes
    code: grpc.StatusCode
    fragments: tuple[str, ...]


def bad_utf8() -> bytes:
    return pb.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xff\xfe")


CASES = [
    Case("empty text", req(""), INVALID, ("text=''", "a non-empty UTF-8 string")),
    Case("no prompt", pb.GenerateRequest(), INVALID, ("prompt=None", "one of text or token_ids")),
    Case("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID, ("token_ids=[]", "non-empty")),
    Case("text too long for the model", req("The for statement is used to " * 100), INVALID,
         ("prompt=", "tokens", "fewer than max_model_len=256")),
    Case("token ids too long for the model", req(ids(300)), INVALID,
         ("prompt='300 tokens'", "fewer than max_model_len=256")),
    Case("token ids as long as the model", req(ids(256), max_tokens=1), INVALID,
         ("prompt='256 tokens'", "fewer than max_model_len=256")),
    Case("prompt plus max_tokens beyond the model", req(ids(200), max_tokens=100), INVALID,
         ("max_tokens=100", "an integer in [1, 56]", "minus the prompt's 200 tokens")),
    Case("max_tokens 0", req(max_tokens=0), INVALID, ("max_tokens=0", "an integer >= 1")),
    Case("max_tokens negative", req(max_tokens=-5), INVALID, ("max_tokens=-5", "an integer >= 1")),
    Case("max_tokens huge", req(max_tokens=2**31 - 1), INVALID,
         ("max_tokens=2147483647", "an integer in [1, 248]", "max_model_len=256")),
    Case("temperature NaN", req(temperature=math.nan), INVALID, ("temperature=nan", "a finite number >= 0")),
    Case("temperature negative", req(temperature=-0.5), INVALID, ("temperature=-0.5", "a finite number >= 0")),
    Case("temperature infinite", req(temperature=math.inf), INVALID, ("temperature=inf", "a finite number")),
    Case("top_p 0", req(top_p=0.0), INVALID, ("top_p=0.0", "(0, 1]")),
    Case("top_p above 1", req(top_p=1.5), INVALID, ("top_p=1.5", "(0, 1]")),
    Case("top_p NaN", req(top_p=math.nan), INVALID, ("top_p=nan", "(0, 1]")),
    Case("top_k below -1", req(top_k=-2), INVALID, ("top_k=-2", "-1 or 0 (off), or an integer >= 1")),
    Case("min_p above 1", req(min_p=1.5), INVALID, ("min_p=1.5", "[0, 1]")),
    Case("min_p negative", req(min_p=-0.1), INVALID, ("min_p=-0.1", "[0, 1]")),
    Case("seed negative", req(seed=-1), INVALID, ("seed=-1", "[0, 2**63)")),
    Case("repetition_penalty 0", req(repetition_penalty=0.0), INVALID, ("repetition_penalty=0.0", "> 0")),
    Case("presence_penalty too big", req(presence_penalty=2.5), INVALID, ("presence_penalty=2.5", "[-2, 2]")),
    Case("frequency_penalty too small", req(frequency_penalty=-3.0), INVALID, ("frequency_penalty=-3.0", "[-2, 2]")),
    Case("logprobs above 20", req(logprobs=21), INVALID, ("logprobs=21", "[0, 20]")),
    Case("logprobs negative", req(logprobs=-1), INVALID, ("logprobs=-1", "[0, 20]")),
    Case("token id negative", req([5, -1, 7]), INVALID, ("token_ids=[-1]", "[0, 4096)")),
    Case("token id beyond the vocabulary", req([5, 4096, 9999]), INVALID, ("token_ids=[4096, 9999]", "[0, 4096)")),
    Case("too many stop strings", req(stop=[f"s{i}" for i in range(17)]), INVALID,
         ("stop='17 strings'", "at most 16 stop strings")),
    Case("empty stop string", req(stop=["ok", ""]), INVALID, ("stop=''", "strings of 1 to 256 characters")),
    Case("stop string too long", req(stop=["x" * 300]), INVALID, ("(300 characters)", "1 to 256 characters")),
    Case("too many stop token ids", req(stop_token_ids=list(range(65))), INVALID,
         ("stop_token_ids='65 ids'", "at most 64 ids")),
    Case("stop token id beyond the vocabulary", req(stop_token_ids=[3, 5000]), INVALID,
         ("stop_token_ids=[5000]", "[0, 4096)")),
    Case("stop token id negative", req(stop_token_ids=[-3]), INVALID, ("stop_token_ids=[-3]", "[0, 4096)")),
    Case("request id with spaces", pb.GenerateRequest(text="Hi", request_id="a b/c"), INVALID,
         ("request_id='a b/c'", "letters, digits and ._:-")),
    Case("request id too long", pb.GenerateRequest(text="Hi", request_id="r" * 129), INVALID,
         ("request_id=", "at most 128 characters")),
    Case("unknown model", pb.GenerateRequest(text="Hi", model="nope"), grpc.StatusCode.NOT_FOUND,
         ("model='nope'", "meshserve-demo")),
    Case("invalid UTF-8 text", bad_utf8(), INVALID, ("request=", "UTF-8")),
    Case("bytes that are not a message", b"\xff\xff\xff\xff", INVALID, ("does not parse", "valid protobuf")),
    Case("message larger than the server takes", req("a" * (2 << 20)), EXHAUSTED, ("larger than max",)),
]


def assert_still_serves(client: InferenceClient, free_at_start: int) -> None:
    out = client.generate([5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    wait_idle(client, free_at_start)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_and_leaves_nothing(served, case):
    client, address, free_at_start = served
    body = case.request if isinstance(case.request, bytes) else case.request.SerializeToString()
    exc = rpc_error(raw_generate, address, body)
    assert exc.code() == case.code, exc.details()
    for fragment in case.fragments:
        assert fragment in exc.details(), (fragment, exc.details())
    assert_still_serves(client, free_at_start)


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


def test_tokenize_and_abort_refusals(served):
    client, address, free_at_start = served
    exc = rpc_error(client.tokenize, "Hi", model="other")
    assert exc.code() == grpc.StatusCode.NOT_FOUND and "model='other'" in exc.details()
    with grpc.insecure_channel(address) as channel:
        tokenize = channel.unary_unary("/meshserve.v1.Inference/Tokenize", request_serializer=lambda b: b,
                                       response_deserializer=pb.TokenizeResponse.FromString)
        body = pb.TokenizeRequest(text="ab").SerializeToString().replace(b"ab", b"\xc3\x28")
        exc = rpc_error(tokenize, body)
    assert exc.code() == INVALID and "UTF-8" in exc.details()
    exc = rpc_error(client.abort, "no-such-request")
    assert exc.code() == grpc.StatusCode.NOT_FOUND and "request_id='no-such-request'" in exc.details()
    exc = rpc_error(client.abort, "")
    assert exc.code() == INVALID and "request_id=''" in exc.details()
    assert_still_serves(client, free_at_start)


def _first_tokens(stream) -> pb.GenerateResponse:
    """The first response of a stream that carries tokens."""
    return next(r for r in stream if r.token_ids)


def test_duplicate_request_id_and_full_queue(served):
    """2 requests run (max_num_seqs=2), 2 may wait (max_queue=2): of 3 more, exactly one is refused."""
    client, _, free_at_start = served
    runners = [client.stream([5 + i, 6, 7, 8], request_id=f"runner-{i}", max_tokens=150, ignore_eos=True)
               for i in range(2)]
    for stream in runners:
        _first_tokens(stream)
    exc = rpc_error(client.generate, "Hi", request_id="runner-0")
    assert exc.code() == INVALID and "request_id='runner-0'" in exc.details() and "not in use" in exc.details()
    results: list[object] = [None] * 3
    streams = [client.stream([20 + i, 21], request_id=f"waiter-{i}", max_tokens=2) for i in range(3)]

    def first(i: int) -> None:
        try:
            results[i] = _first_tokens(streams[i])
        except grpc.RpcError as err:
            results[i] = err

    threads = [threading.Thread(target=first, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(isinstance(r, grpc.RpcError) for r in results) >= 1, what="a refusal", timeout=30)
    for stream in runners:
        stream.close()  # cancel the runners: the waiting requests get their turn
    for t in threads:
        t.join(60)
    refused = [r for r in results if isinstance(r, grpc.RpcError)]
    assert len(refused) == 1, results
    assert refused[0].code() == EXHAUSTED and "queue is full" in refused[0].details()
    assert "max_queue=2" in refused[0].details()
    assert sum(isinstance(r, pb.GenerateResponse) for r in results) == 2
    for stream in streams:
        stream.close()
    assert_still_serves(client, free_at_start)
