"""uvicorn's httptools protocol (llhttp, a C parser) with OpenAI-shaped protocol errors and a
limit on the request head.

llhttp parses in C what h11 parses in Python: on the H100 host, client to ASGI app took 0.72 ms
at p50 with h11 (bench/serve_latency.py's http.asgi; docs/performance.md has the CPU numbers
with both). httptools itself sets no limit on a request line and headers: a client could send
headers that never end and the parser would keep them all. h11 refuses a head still incomplete
at 16 KiB with 431; so does this protocol (HEAD_LIMIT_BYTES), counting the bytes read from the
start of a request until its headers are complete. Bytes of the next request that arrive in
the same read as the end of the previous one are not counted: one read (256 KiB) at most more.
"""

from __future__ import annotations

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from meshserve.api.http.protocol_errors import HEAD_LIMIT_BYTES, OpenAIProtocolErrors, head_too_large


class JsonErrorHttpToolsProtocol(OpenAIProtocolErrors, HttpToolsProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # bytes of the request head read so far; None: its headers are complete

    def refusal(self, exc: BaseException | None, msg: str) -> tuple[int, str]:
        if isinstance(exc, httptools.HttpParserError):
            return 400, f"the request is not valid HTTP/1.1: {exc}"
        return super().refusal(exc, msg)

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is not None:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_bytes is not None and self._head_bytes > HEAD_LIMIT_BYTES and not self.transport.is_closing():
            self.answer_and_close(431, head_too_large(HEAD_LIMIT_BYTES))

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_bytes = 0  # a next request on this connection starts its own head
        super().on_message_complete()
