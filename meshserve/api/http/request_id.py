"""x-request-id on every HTTP response: the client's own (echoed), else a fresh one.

A proxy or client that sends `x-request-id` finds the same value on the answer; one that
does not gets an id it can quote in a report. Values are capped and limited to printable
ASCII, so a header cannot smuggle anything into the response.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshserve.core import hop_trace

HEADER = b"x-request-id"
_MAX_LEN = 256


def _acceptable(value: bytes) -> bool:
    return 0 < len(value) <= _MAX_LEN and all(0x21 <= c <= 0x7E for c in value)


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == HEADER]
        request_id = given[0] if len(given) == 1 and _acceptable(given[0]) else uuid.uuid4().hex.encode()
        hop_trace.mark("http.asgi", request_id)  # (keyed by the client's id: bench/serve_latency.py sends one)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
