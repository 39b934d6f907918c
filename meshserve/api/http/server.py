"""HttpServer: uvicorn serving the OpenAI-compatible app on the server's own event loop.

The socket is bound here first (a busy port is a ConfigError naming the flag, before anything
runs; port 0 picks a free one, `port` says which). The connection protocol is uvicorn's httptools
one where httptools is installed, else its h11 one (`http_protocol_name`: "h11" or "httptools" to
choose; api/http/protocol_errors.py). uvicorn runs without its signal handlers
(the `meshserve serve` loop owns SIGINT/SIGTERM) and without its logging set-up (ours is one
format, see meshserve/logs.py). `stop(grace)` stops accepting, gives responses in flight
`grace` seconds, then cancels them (which aborts their requests).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence

import uvicorn

from meshserve.api.convert import ApiLimits
from meshserve.api.generation_defaults import SamplingDefaults
from meshserve.api.http.app import OpenAIFrontend
from meshserve.api.http.chat import ChatTemplate
from meshserve.api.http.protocol_errors import HEAD_LIMIT_BYTES, http_protocol
from meshserve.api.metrics import ServerMetrics
from meshserve.cluster.service import InferenceService
from meshserve.errors import ConfigError

log = logging.getLogger("meshserve.api")
# After the drain time, what responses still open get to send their error and end.
ENDING_S = 1.0


def bind(host: str, port: int, *, field: str = "http_port", reuse_port: bool = False) -> socket.socket:
    """A socket bound to host:port; reuse_port: shared with the other front-end processes of this
    server (SO_REUSEPORT: the kernel spreads the connections over them; --api-server-count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(field, port, f"a free port on {host} ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, service: InferenceService, *, host: str = "127.0.0.1", port: int = 8000,
                 metrics: ServerMetrics | None = None, limits: ApiLimits = ApiLimits(), tokens: Sequence[str] = (),
                 chat_template: ChatTemplate | None = None, max_body_bytes: int = 16 << 20,
                 tls_cert: str | None = None, tls_key: str | None = None, metrics_token: str | None = None,
                 sampling_defaults: SamplingDefaults = SamplingDefaults(), reuse_port: bool = False,
                 http_protocol_name: str = "auto") -> None:
        self.reuse_port = reuse_port
        self.frontend = OpenAIFrontend(service, metrics=metrics, limits=limits, tokens=tokens,
                                       chat_template=chat_template, max_body_bytes=max_body_bytes,
                                       metrics_token=metrics_token, sampling_defaults=sampling_defaults)
        self.host = host
        self.requested_port = port
        self.tls = tls_cert is not None
        self.config = uvicorn.Config(self.frontend.app, host=host, port=port, log_config=None, lifespan="off",
                                     # httptools' C parser where installed, else h11; protocol errors
                                     # in OpenAI's JSON shape either way (api/http/protocol_errors.py)
                                     http=http_protocol(http_protocol_name),
                                     h11_max_incomplete_event_size=HEAD_LIMIT_BYTES,
                                     access_log=False, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                     timeout_graceful_shutdown=30)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        sock = bind(self.host, self.requested_port, reuse_port=self.reuse_port)
        self.port = sock.getsockname()[1]
        config = self.config
        if not config.loaded:
            config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        if server.should_exit:  # startup failed (uvicorn logged why)
            sock.close()
            raise ConfigError("http_port", self.requested_port, f"a port uvicorn can serve on {self.host}")
        self._server, self._sock = server, sock
        self._task = asyncio.get_running_loop().create_task(server.main_loop())
        log.info("serving the OpenAI-compatible API on %s/v1", self.url)

    async def stop(self, grace: float | None = 30.0) -> None:
        """Stop accepting; responses in flight get `grace` seconds, then those still open end with
        an error (SSE: an error event and [DONE]; whole: 503) and, ENDING_S later, are cancelled."""
        server = self._server
        if server is None:
            return
        self._server = None
        grace = grace or 0.0
        server.config.timeout_graceful_shutdown = grace + ENDING_S
        server.should_exit = True
        await self._task
        expire = asyncio.get_running_loop().call_later(grace, self.frontend.drain.expire)
        try:
            await server.shutdown(sockets=[self._sock])
        finally:
            expire.cancel()
