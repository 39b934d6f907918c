"""The HTTP/1.1 connection protocol of the OpenAI-compatible server: uvicorn's h11 protocol
with two changes.

Protocol errors (a bad Content-Length, headers over h11's 16 KiB, a broken request line) are
answered in OpenAI's JSON error shape instead of uvicorn's plain text. Such a request never
reaches the ASGI app: uvicorn's h11 protocol answers it itself. This subclass keeps its
behaviour (answer, then close the connection) and only changes the body, and the status to
h11's hint (431 for headers too large, else 400).

Every connection gets TCP_NODELAY. asyncio sets it only on sockets whose `proto` is
IPPROTO_TCP, and a socket accepted from a listener made with `socket.socket(family,
SOCK_STREAM)` (proto 0, as server.py binds it, and as most callers do) has proto 0 too: Nagle's
algorithm then held each stream's first SSE chunk, written just after the response headers,
until the client's delayed ACK came back (~40 ms on Linux), and every later small chunk behind
unacknowledged data the same way (docs/performance.md, issue 41: HTTP's time to first token).
"""

from __future__ import annotations

import contextlib
import json
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from meshserve.api.http.errors import error_body


class JsonErrorH11Protocol(H11Protocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def traced_next_event():  # remembers why h11 refused the request, for the body below
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._protocol_error = exc
                raise

        self.conn.next_event = traced_next_event

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a socket that takes no TCP options is served as it is
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)

    def send_400_response(self, msg: str) -> None:
        exc = self._protocol_error
        status = getattr(exc, "error_status_hint", 400) if exc is not None else 400
        status = status if status in (400, 413, 414, 431) else 400
        if status == 431:
            detail = f"the request line and headers are over {self.conn._max_incomplete_event_size} bytes ({exc})"
        else:
            detail = f"the request is not valid HTTP/1.1: {exc}" if exc is not None else msg
        body = json.dumps(error_body(status, detail, error_type="invalid_request_error")).encode()
        reason = {400: b"Bad Request", 413: b"Content Too Large", 414: b"URI Too Long",
                  431: b"Request Header Fields Too Large"}[status]
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, reason, len(body)))
        self.transport.write(head + body)  # h11's state machine is in ERROR: write the bytes ourselves
        self.transport.close()
