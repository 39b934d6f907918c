"""What one caller can do to another, and the work a request may cost before admission.

One demo-model Coordinator (max_model_len 256, so texts over 256 x 32 = 8192 characters are
refused unread) behind a gRPC server with two tokens (two callers) and the HTTP API, plus a
server without tokens. The tokenizer is wrapped to record every text it is given: an oversized
prompt must be refused without a call. Request ids are per caller: the other caller's Abort of a
running id reads exactly as an unknown id, and the same id is free for the other caller.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import grpc
import pytest

from meshserve.api.auth import scope_of
from meshserve.api.client import InferenceClient
from meshserve.api.http.server import HttpServer
from meshserve.v1 import inference_pb2 as pb
from tests.integration.api_harness import ServerLoop, demo_service, rpc_error, wait_idle

pytestmark = pytest.mark.timeout(240)

TOKEN_A, TOKEN_B, METRICS_TOKEN = "caller-a-token", "caller-b-token", "scrape-token"
CAP = 256 * 32  # max_model_len x ApiLimits.max_chars_per_token
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("callers")
    (folder / "tokens").write_text(f"# two callers\n{TOKEN_A}\n\n{TOKEN_B}\n")
    (folder / "metrics").write_text(METRICS_TOKEN + "\n")
    service = demo_service(max_model_len=256, num_kv_blocks=64)
    loop = ServerLoop()
    authed = loop.serve(service, auth_token_file=str(folder / "tokens"), metrics_host="127.0.0.2",
                        metrics_token_file=str(folder / "metrics"))
    open_server = loop.serve(service)
    seen: list[int] = []  # the length of every text the tokenizer was given
    front = loop.front(service)  # where the front-ends tokenize
    tokenize = front.tokenize
    front.tokenize = lambda text: (seen.append(len(text)), tokenize(text))[1]
    http = HttpServer(front, port=0, tokens=authed.tokens)
    loop.run(http.start())
    clients = {name: InferenceClient(authed.address, token=token) for name, token in (("a", TOKEN_A), ("b", TOKEN_B))}
    clients["open"] = InferenceClient(open_server.address)
    free = clients["a"].server_info().stats.num_free_kv_blocks
    yield {"clients": clients, "authed": authed, "open": open_server, "http": http, "seen": seen, "free": free}
    for client in clients.values():
        client.close()
    loop.run(http.stop(grace=0))
    loop.close(service)


def _post(url: str, body: dict, token: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- bounded work before admission --------------------------------------------------------------


def test_oversized_text_is_refused_before_tokenizing_on_grpc(env):
    a, seen = env["clients"]["a"], env["seen"]
    seen.clear()
    for call in (lambda: a.generate("x" * (CAP + 1), max_tokens=2), lambda: a.tokenize("y" * (4 * CAP))):
        exc = rpc_error(call)
        assert exc.code() == INVALID, exc.details()
        assert exc.details().startswith("text='<") and f"at most {CAP} characters" in exc.details(), exc.details()
        assert "max_model_len=256" in exc.details()
    assert seen == []  # the tokenizer never saw them
    # at the cap the text is tokenized, and then refused by its token count (the cap is only a bound)
    exc = rpc_error(a.generate, "x" * CAP, max_tokens=2)
    assert exc.code() == INVALID and "fewer than max_model_len=256" in exc.details(), exc.details()
    assert seen == [CAP]
    wait_idle(a, env["free"])


def test_oversized_text_is_refused_before_tokenizing_on_http(env):
    seen, url = env["seen"], env["http"].url
    seen.clear()
    status, body = _post(f"{url}/v1/completions", {"model": "", "prompt": ["Hi", "x" * (CAP + 1)],
                                                   "max_tokens": 2}, TOKEN_B)
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert f"at most {CAP} characters" in body["error"]["message"]
    assert seen == []  # every prompt is checked before any is tokenized; nothing was queued
    status, body = _post(f"{url}/v1/completions", {"model": "", "prompt": "Hello", "max_tokens": 2,
                                                   "temperature": 0}, TOKEN_A)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    wait_idle(env["clients"]["a"], env["free"])


# -- request ids belong to their caller ---------------------------------------------------------


def test_abort_and_duplicate_probes_across_tokens_reveal_nothing(env):
    a, b = env["clients"]["a"], env["clients"]["b"]
    stream = a.stream([5, 6, 7], request_id="job-1", max_tokens=200, ignore_eos=True, temperature=0, timeout=120)
    first = next(stream)
    assert first.request_id == "job-1"
    # B's abort of A's running id reads exactly as an unknown id
    running, unknown = rpc_error(b.abort, "job-1"), rpc_error(b.abort, "job-0")
    assert running.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
    assert running.details() == unknown.details().replace("job-0", "job-1"), (running.details(), unknown.details())
    # the id is free for B (no duplicate error that would reveal A's ids) ...
    out = b.generate([5, 6, 7], request_id="job-1", max_tokens=3, ignore_eos=True, temperature=0)
    assert out.request_id == "job-1" and len(out.token_ids) == 3
    # ... and a duplicate for A, named as A gave it (not with the server's scope)
    exc = rpc_error(a.generate, "Hello", request_id="job-1", max_tokens=2)
    assert exc.code() == INVALID and exc.details().startswith("request_id='job-1' is not allowed"), exc.details()
    for token in (TOKEN_A, TOKEN_B):
        assert scope_of((("authorization", f"Bearer {token}"),), auth_required=True) not in exc.details()
    # A's stream was untouched by all of it; A can abort its own request
    a.abort("job-1")
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) < 200
    wait_idle(a, env["free"])


def test_without_tokens_callers_share_one_namespace(env):
    shared = env["clients"]["open"]
    stream = shared.stream([5, 6, 7], request_id="shared-1", max_tokens=200, ignore_eos=True, timeout=120)
    next(stream)
    with InferenceClient(env["open"].address) as other:  # another connection, no token
        other.abort("shared-1")
    assert list(stream)[-1].finish_reason == pb.FINISH_REASON_ABORT
    # the authenticated callers live in other namespaces: the same id there is unknown
    assert rpc_error(env["clients"]["a"].abort, "shared-1").code() == grpc.StatusCode.NOT_FOUND
    wait_idle(env["clients"]["a"], env["free"])


# -- strict bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ListModels", "ServerInfo", "Tokenize", "Abort", "Embed"])
def test_every_method_refuses_a_body_that_does_not_parse(env, method):
    with grpc.insecure_channel(env["authed"].address) as channel:
        call = channel.unary_unary(f"/meshserve.v1.Inference/{method}", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff", metadata=(("authorization", f"Bearer {TOKEN_A}"),), timeout=30)
    assert info.value.code() == INVALID and "does not parse" in info.value.details(), info.value.details()


# -- metrics: own host, own token ---------------------------------------------------------------


def test_metrics_bind_their_own_host_and_want_their_token(env):
    server = env["authed"]
    port = server.metrics_port
    assert server.metrics_url == f"http://127.0.0.2:{port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.metrics_url, timeout=30)
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"
    for wrong in (TOKEN_A, METRICS_TOKEN + "x"):
        request = urllib.request.Request(server.metrics_url, headers={"Authorization": f"Bearer {wrong}"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 401
    request = urllib.request.Request(server.metrics_url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200 and b"meshserve_requests_running" in response.read()
    # gRPC is on 127.0.0.1; the metrics port is not
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=30).close()
