"""Every HTTP connection of the OpenAI-compatible server runs with TCP_NODELAY, with either
connection protocol (api/http/protocol_errors.py): without it Nagle's algorithm held each stream's
first SSE chunk until the client's delayed ACK (~40 ms). Read back from the server's own accepted
socket."""

from __future__ import annotations

import asyncio
import importlib.util
import socket

import pytest

from meshserve.api.http.protocol_errors import PROTOCOLS
from meshserve.api.http.server import HttpServer


class _NoService:
    """A connection is accepted before the service is asked anything."""


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.skipif(name == "httptools" and importlib.util.find_spec("httptools") is None,
                                                reason="httptools is not installed")) for name in PROTOCOLS])
def test_accepted_connections_have_tcp_nodelay(name):
    async def run() -> list[int]:
        server = HttpServer(_NoService(), port=0, http_protocol_name=name)
        await server.start()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            for _ in range(200):  # until uvicorn has made the connection's protocol
                connections = list(server._server.server_state.connections)
                if connections:
                    break
                await asyncio.sleep(0.01)
            flags = [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                     for c in connections]
            writer.close()
            return flags
        finally:
            await server.stop(grace=0)

    flags = asyncio.run(run())
    assert len(flags) == 1 and flags[0] != 0, flags
