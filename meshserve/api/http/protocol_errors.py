"""The HTTP/1.1 connection protocols of the OpenAI-compatible server: uvicorn's, with two changes.

Two protocols: uvicorn's httptools protocol (llhttp, a C parser; api/http/protocol_httptools.py)
where httptools is installed, the default, and uvicorn's h11 protocol (pure Python) where it is
not. `http_protocol()` picks; `PROTOCOLS` names both (the tests run each).

Protocol errors (a bad Content-Length, a request line and headers over HEAD_LIMIT_BYTES, a
broken request line) are answered in OpenAI's JSON error shape instead of uvicorn's plain text.
Such a request never reaches the ASGI app: uvicorn's protocol answers it itself, through
`send_400_response`. The mixin below keeps that behaviour (answer, then close the connection)
and only changes the body, and the status to what the parser says (431 for a head too large,
else 400).

Every connection gets TCP_NODELAY. asyncio sets it only on sockets whose `proto` is
IPPROTO_TCP, and a socket accepted from a listener made with `socket.socket(family,
SOCK_STREAM)` (proto 0, as server.py binds it, and as most callers do) has proto 0 too: Nagle's
algorithm then held each stream's first SSE chunk, written just after the response headers,
until the client's delayed ACK came back (~40 ms on Linux), and every later small chunk behind
unacknowledged data the same way (docs/performance.md, issue 41: HTTP's time to first token).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import socket
import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from meshserve.api.http.errors import error_body
from meshserve.errors import ConfigError

# The most bytes a request line and headers may take before they end (h11's default for an
# incomplete event; server.py gives it to h11, and the httptools protocol counts it itself).
HEAD_LIMIT_BYTES = 16 * 1024
_REASONS = {400: b"Bad Request", 413: b"Content Too Large", 414: b"URI Too Long",
            431: b"Request Header Fields Too Large"}


class OpenAIProtocolErrors:
    """Mixed in before one of uvicorn's HTTP protocols: TCP_NODELAY on every connection, and the
    protocol errors the parser raises answered in OpenAI's JSON shape."""

    transport: asyncio.Transport

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a socket that takes no TCP options is served as it is
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)

    def send_400_response(self, msg: str) -> None:
        # Both of uvicorn's protocols call this from inside their `except` for the parser's error
        # (and for nothing else): the exception being handled is why the request was refused.
        status, detail = self.refusal(sys.exc_info()[1], msg)
        self.answer_and_close(status, detail)

    def refusal(self, exc: BaseException | None, msg: str) -> tuple[int, str]:
        """The status and message for the parser's error `exc` (None: uvicorn's own `msg`)."""
        return 400, (f"the request is not valid HTTP/1.1: {exc}" if exc is not None else msg)

    def answer_and_close(self, status: int, detail: str) -> None:
        body = json.dumps(error_body(status, detail, error_type="invalid_request_error")).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)))
        self.transport.write(head + body)  # the parser is in its error state: write the bytes ourselves
        self.transport.close()


def head_too_large(limit: int) -> str:
    return f"the request line and headers are over {limit} bytes"


class JsonErrorH11Protocol(OpenAIProtocolErrors, H11Protocol):
    def refusal(self, exc: BaseException | None, msg: str) -> tuple[int, str]:
        if not isinstance(exc, h11.RemoteProtocolError):
            return super().refusal(exc, msg)
        status = exc.error_status_hint if exc.error_status_hint in _REASONS else 400
        if status == 431:
            return 431, f"{head_too_large(self.conn._max_incomplete_event_size)} ({exc})"
        return status, f"the request is not valid HTTP/1.1: {exc}"


# name -> "module:class", imported when asked for (httptools may be absent)
PROTOCOLS = {"httptools": "meshserve.api.http.protocol_httptools:JsonErrorHttpToolsProtocol",
             "h11": "meshserve.api.http.protocol_errors:JsonErrorH11Protocol"}


def http_protocol(name: str = "auto") -> type[asyncio.Protocol]:
    """The connection protocol `name` ("auto": httptools where it is installed, else h11)."""
    if name == "auto":
        try:
            return http_protocol("httptools")
        except ImportError:
            return JsonErrorH11Protocol
    if name not in PROTOCOLS:
        raise ConfigError("http_protocol", name, f"one of auto, {', '.join(PROTOCOLS)}")
    module, _, attr = PROTOCOLS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
