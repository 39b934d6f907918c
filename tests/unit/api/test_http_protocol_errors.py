"""HTTP/1.1 protocol errors, which never reach the ASGI app, come in OpenAI's JSON error shape with
either connection protocol (api/http/protocol_errors.py: uvicorn's h11 one, and its httptools
one where httptools is installed) on either event loop (asyncio's, uvloop), and the httptools one
refuses a head over 16 KiB as h11 does.
The oracle is the raw bytes a socket reads back from a served HttpServer."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from meshserve.api import event_loop
from meshserve.api.http.protocol_errors import HEAD_LIMIT_BYTES, PROTOCOLS, http_protocol
from meshserve.api.http.server import HttpServer
from meshserve.cluster.service import ModelCard
from meshserve.errors import ConfigError


class _ModelsOnly:
    """The routes here ask the service for its models (a body's limits) and nothing else."""

    def models(self) -> list[ModelCard]:
        return [ModelCard(name="m", max_model_len=64, vocab_size=100)]


HAVE_HTTPTOOLS = importlib.util.find_spec("httptools") is not None
HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
# each protocol on each event loop `meshserve serve` may run (api/event_loop.py)
SERVED = [pytest.param(name, use_uvloop, id=f"{name}-{'uvloop' if use_uvloop else 'asyncio'}",
                       marks=pytest.mark.skipif((name == "httptools" and not HAVE_HTTPTOOLS)
                                                or (use_uvloop and not HAVE_UVLOOP), reason="not installed"))
          for name in PROTOCOLS for use_uvloop in (False, True)]


async def _exchange(port: int, request: bytes) -> bytes:
    """Everything the server sends back to `request` until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


def _responses(data: bytes) -> list[tuple[str, dict]]:
    """The status line and JSON body of each response in `data` (bodies with a content-length)."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.decode().lower().split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        out.append((lines[0].decode(), json.loads(rest[:length])))
        data = rest[length:]
    return out


def _served(name: str, use_uvloop: bool, *requests: bytes) -> list[bytes]:
    async def run() -> list[bytes]:
        server = HttpServer(_ModelsOnly(), port=0, http_protocol_name=name)
        await server.start()
        try:
            return [await _exchange(server.port, request) for request in requests]
        finally:
            await server.stop(grace=0)

    return event_loop.run(run(), use_uvloop=use_uvloop)


@pytest.mark.parametrize(("name", "use_uvloop"), SERVED)
def test_protocol_errors_are_openai_json_with_the_parsers_reason(name, use_uvloop):
    bad_length = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n"
    bad_line = b"NOT AN HTTP REQUEST\r\n\r\n"
    # one header never ended, over the limit (and all of it read by the server: a clean close)
    huge = b"GET /version HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * (HEAD_LIMIT_BYTES + 4000)
    answers = [_responses(data) for data in _served(name, use_uvloop, bad_length, bad_line, huge)]
    (status, body), = answers[0]
    assert status == "HTTP/1.1 400 Bad Request", status
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
    assert "not valid HTTP/1.1" in body["error"]["message"] and "Content-Length" in body["error"]["message"]
    (status, body), = answers[1]
    assert status == "HTTP/1.1 400 Bad Request" and "not valid HTTP/1.1" in body["error"]["message"], (status, body)
    (status, body), = answers[2]
    assert status == "HTTP/1.1 431 Request Header Fields Too Large", status
    assert body["error"]["code"] == 431 and str(HEAD_LIMIT_BYTES) in body["error"]["message"]


@pytest.mark.parametrize(("name", "use_uvloop"), SERVED)
def test_a_body_over_the_head_limit_and_pipelined_requests_are_served(name, use_uvloop):
    """The head limit counts the head alone: a big body in the same read reaches the app (whose
    own 400 for a broken JSON body comes back), and two requests sent at once both get answers."""
    body = b'{"prompt": "' + b"a" * (2 * HEAD_LIMIT_BYTES)  # never closed: the app's JSON error
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
    get = b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n"
    close = b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    posted, pipelined = _served(name, use_uvloop, post, get + close)
    (status, answer), = _responses(posted)
    assert status == "HTTP/1.1 400 Bad Request" and "not valid HTTP/1.1" not in answer["error"]["message"], answer
    assert [status for status, _ in _responses(pipelined)] == ["HTTP/1.1 200 OK"] * 2


def test_auto_is_httptools_where_installed_and_a_bad_name_is_refused():
    want = "httptools" if HAVE_HTTPTOOLS else "h11"
    assert http_protocol("auto") is http_protocol(want)
    with pytest.raises(ConfigError, match="http_protocol.*one of auto, httptools, h11"):
        http_protocol("zttp")
