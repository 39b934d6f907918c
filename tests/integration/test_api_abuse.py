"""No request takes over the server (issue 40): cost limits, fair queueing, bodies counted while
read, text edge cases, over HTTP and gRPC on one demo-model Coordinator with two callers (tokens).

Timing is not asserted (bench/abuse.py measures it); bounds here only keep a hang from passing.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import grpc
import pytest

from meshserve.api.client import InferenceClient
from meshserve.api.convert import ApiLimits
from meshserve.api.http.server import HttpServer
from meshserve.errors import MAX_QUOTED_CHARS
from meshserve.v1 import inference_pb2 as pb
from tests.integration.api_harness import ServerLoop, demo_service, raw_generate, rpc_error, wait_for, wait_idle

pytestmark = pytest.mark.timeout(240)

TOKEN_A, TOKEN_B = "abuse-caller-a", "abuse-caller-b"
LIMITS = ApiLimits()  # the defaults: 64 prompts, 256 sequences per request


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("abuse")
    (folder / "tokens").write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    service = demo_service(max_model_len=256, num_kv_blocks=256, max_num_seqs=64, max_queue=1024)
    loop = ServerLoop()
    grpc_server = loop.serve(service, auth_token_file=str(folder / "tokens"), limits=LIMITS)
    http_server = HttpServer(loop.front(service), port=0, tokens=grpc_server.tokens, limits=LIMITS)
    loop.run(http_server.start())
    client = InferenceClient(grpc_server.address, token=TOKEN_A)
    free = client.server_info().stats.num_free_kv_blocks
    yield {"service": service, "grpc": grpc_server, "http": http_server, "client": client, "free": free,
           "loop": loop}
    client.close()
    loop.run(http_server.stop(grace=0))
    loop.close(service)


def _connection(env) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", env["http"].port, timeout=120)


def _post(env, body: dict | bytes, token: str = TOKEN_A, path: str = "/v1/completions"):
    conn = _connection(env)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, json.loads(payload) if payload else {}, {k.lower(): v for k, v in response.getheaders()}


def _sse(env, body: dict, token: str = TOKEN_B):
    """An open SSE stream: (connection, response) after its 200."""
    conn = _connection(env)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return conn, response


def _events(response):
    """Each SSE event's data (the JSON decoded; "[DONE]" as is), as they come."""
    for line in response:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            yield data if data == "[DONE]" else json.loads(data)


# -- cost limits and fair queueing ---------------------------------------------------------------

def test_fan_out_over_the_limits_is_refused_naming_them(env):
    status, body, _ = _post(env, {"prompt": [f"Number {i}" for i in range(200)], "n": 64, "max_tokens": 1})
    assert status == 400, body
    assert "max_prompts_per_request=64" in body["error"]["message"]
    status, body, _ = _post(env, {"prompt": [f"Number {i}" for i in range(64)], "n": 8, "max_tokens": 1})
    assert status == 400 and "max_sequences_per_request=256" in body["error"]["message"], body
    tight = env["loop"].serve(env["service"], limits=ApiLimits(max_sequences_per_request=4,
                                                                max_tokens_per_request=100))
    with InferenceClient(tight.address) as client:  # gRPC: one prompt of 5 sequences; a budget of 100 tokens
        exc = rpc_error(client.generate, "Hi", n=1, best_of=5, max_tokens=1)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_sequences_per_request=4" in exc.details()
        exc = rpc_error(client.generate, "Hi", n=2, max_tokens=60)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens_per_request=100" in exc.details()
        assert len(client.generate("Hi", n=2, max_tokens=40).choices) == 2  # 2 x (1 + 40) tokens fit
    wait_idle(env["client"], env["free"])


def test_a_heavy_caller_does_not_starve_a_light_one(env):
    """Caller A fills its share (4 requests x 64 prompts = 256 sequences, the per-caller limit
    here: four waves of the 64 running slots); one more is 429 with Retry-After. Caller B's
    requests, sent after all of A's are queued, each wait only for running sequences to end
    (first come first served would put them behind all 256), so they finish before A's last."""
    ledger = env["service"].callers
    ledger.max_sequences = 256
    heavy = {"prompt": [f"Count to {i}:" for i in range(64)], "max_tokens": 8, "ignore_eos": True}
    results = []
    senders = [threading.Thread(target=lambda: results.append(_post(env, heavy, token=TOKEN_A)), daemon=True)
               for _ in range(4)]
    try:
        for sender in senders:
            sender.start()
        wait_for(lambda: ledger.busiest() == 256, timeout=60,
                 what="caller A's 256 sequences in flight")
        status, body, headers = _post(env, {**heavy, "prompt": "one more"}, token=TOKEN_A)
        assert status == 429 and "max_sequences_per_caller=256" in body["error"]["message"], body
        assert headers.get("retry-after") == "1"
        light_done_while_heavy_ran = []
        for _ in range(2):
            status, body, _ = _post(env, {"prompt": "Hello there", "max_tokens": 4}, token=TOKEN_B)
            assert status == 200, body
            light_done_while_heavy_ran.append(len(results) < 4)
        for sender in senders:
            sender.join(180)
    finally:
        ledger.max_sequences = 512
    assert [r[0] for r in results] == [200] * 4  # the heavy caller was served too
    assert all(len(r[1]["choices"]) == 64 for r in results)
    assert all(light_done_while_heavy_ran), light_done_while_heavy_ran
    wait_idle(env["client"], env["free"])


# -- bodies counted while read --------------------------------------------------------------------

def test_a_body_of_500k_prompts_is_refused_while_another_stream_goes_on(env):
    body = json.dumps({"prompt": [f"p{i:05d}" for i in range(500_000)], "max_tokens": 1}).encode()
    body += b" " * max(0, (10 << 20) - len(body))  # 10 MiB
    conn, stream = _sse(env, {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                              "temperature": 0})
    events = _events(stream)
    arrivals = [time.monotonic()]
    next(events)

    def read_rest() -> None:
        for event in events:
            arrivals.append(time.monotonic())
            if event == "[DONE]":
                return

    reader = threading.Thread(target=read_rest, daemon=True)
    reader.start()
    sent = time.monotonic()
    with socket.create_connection(("127.0.0.1", env["http"].port), timeout=30) as sock:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN_A}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        try:
            sock.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):  # refused before it was all sent
            pass
        reply = sock.recv(65536).decode(errors="replace")
    refused_in = time.monotonic() - sent
    assert reply.startswith("HTTP/1.1 413"), reply[:300]
    assert "JSON strings" in reply
    after_refusal = len(arrivals)
    reader.join(120)
    conn.close()
    assert len(arrivals) > after_refusal  # the other stream kept producing after the refusal
    assert arrivals and max(b - a for a, b in zip(arrivals, arrivals[1:])) < 5.0  # a hang guard, not a timing
    assert refused_in < 5.0
    wait_idle(env["client"], env["free"])


# -- text edge cases ------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["ok", "a\udc00"], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "stop": ["x\ud800"], "max_tokens": 2}),
])
def test_lone_surrogates_are_400_on_http(env, path, body):
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \\udXXX, as clients send it
    status, reply, _ = _post(env, raw, path=path)
    assert status == 400, reply
    assert "surrogate" in reply["error"]["message"]
    wait_idle(env["client"], env["free"])


def test_text_that_is_not_utf8_is_invalid_argument_on_grpc(env):
    body = pb.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xed\xa0")  # CESU-8's lone surrogate
    exc = rpc_error(raw_generate, env["grpc"].address, body, metadata=[("authorization", f"Bearer {TOKEN_A}")])
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()


@pytest.mark.parametrize("prompt", ["", [""], ["Hi", ""], []])
def test_empty_prompts_are_400_on_http(env, prompt):
    status, reply, _ = _post(env, {"prompt": prompt, "max_tokens": 2})
    assert status == 400 and reply["error"]["param"] == "prompt", reply


def test_empty_prompt_is_invalid_argument_on_grpc(env):
    exc = rpc_error(env["client"].generate, "", max_tokens=2)
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in exc.details()


def test_a_100kb_model_name_is_not_echoed(env):
    name = "m" * 100_000
    status, reply, _ = _post(env, {"model": name, "prompt": "Hi", "max_tokens": 2})
    assert status == 404 and len(reply["error"]["message"]) < MAX_QUOTED_CHARS + 200, len(reply["error"]["message"])
    assert "100000 characters" in reply["error"]["message"]
    exc = rpc_error(env["client"].generate, "Hi", model=name, max_tokens=2)
    assert exc.code() == grpc.StatusCode.NOT_FOUND
    assert len(exc.details()) < MAX_QUOTED_CHARS + 200 and "100000 characters" in exc.details()


def test_priority_is_checked(env):
    status, reply, _ = _post(env, {"prompt": "Hi", "max_tokens": 2, "priority": 1 << 40})
    assert status == 400 and reply["error"]["param"] == "priority", reply
    status, reply, _ = _post(env, {"prompt": "Hi", "max_tokens": 2, "priority": -5})
    assert status == 200, reply


def test_nothing_is_left_behind(env):
    wait_for(lambda: len(env["service"].callers) == 0, timeout=30, what="no caller in flight")
    wait_idle(env["client"], env["free"])
