"""ApiServer: the grpc.aio server in front of an InferenceService.

It carries meshserve.v1.Inference, grpc.health.v1 (open without the token), server reflection,
the optional bearer-token interceptor and TLS, message size limits both ways, and the
Prometheus endpoint. `stop(grace)` drains: health turns NOT_SERVING, new calls are refused,
calls in flight get `grace` seconds to finish and are then cancelled (which aborts their
requests).

    server = ApiServer(service, ServerConfig(port=0), max_queue=64)
    await server.start()          # server.port, server.metrics_port: the bound ports
    ...
    await server.stop(grace=30)
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_reflection.v1alpha import reflection

from meshserve.api.auth import BearerTokenInterceptor, read_token, read_tokens, server_credentials
from meshserve.api.convert import ApiLimits
from meshserve.api.generation_defaults import SamplingDefaults
from meshserve.api.health import INFERENCE_SERVICE, HealthReporter
from meshserve.api.metrics import ServerMetrics
from meshserve.api.servicer import InferenceServicer, method_handlers
from meshserve.cluster.service import InferenceService
from meshserve.config import ServerConfig
from meshserve.errors import ConfigError

log = logging.getLogger("meshserve.api")
ENDING_S = 1.0  # after the drain time, what calls still open get to send their status


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ApiServer:
    def __init__(self, service: InferenceService, config: ServerConfig, *, max_queue: int,
                 limits: ApiLimits = ApiLimits(), metrics: bool = True, health_interval: float = 0.2,
                 sampling_defaults: SamplingDefaults = SamplingDefaults(), api_server: int = 0,
                 shared_metrics_dir: str | None = None, reuse_port: bool = False) -> None:
        """api_server, shared_metrics_dir, reuse_port: this front-end process among several
        (--api-server-count; api/api_servers.py): its index, the metrics files they share, and the
        gRPC port shared with the others (SO_REUSEPORT)."""
        self.service = service
        self.reuse_port = reuse_port
        self.config = config
        self.tokens = (read_tokens(config.auth_token_file) if config.auth_token_file else ()) + tuple(config.api_keys)
        self.metrics_token = (read_token(config.metrics_token_file, field="metrics_token_file")
                              if config.metrics_token_file else None)
        self.tls = config.tls_cert is not None
        self.metrics = ServerMetrics(service, api_server=api_server, shared_dir=shared_metrics_dir)
        self.servicer = InferenceServicer(service, metrics=self.metrics, limits=limits,
                                          max_message_bytes=config.max_message_bytes, max_queue=max_queue,
                                          auth_required=bool(self.tokens), tls=self.tls,
                                          sampling_defaults=sampling_defaults)
        self.health = HealthReporter(service, interval=health_interval,
                                     unhealthy_liveness_s=config.unhealthy_liveness_s)
        self._serve_metrics = metrics
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None

    async def start(self) -> None:
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # a second server on the same port must fail, not share it; only this server's own
            # front-end processes share it (api/api_servers.py checks the port was free first)
            ("grpc.so_reuseport", int(self.reuse_port)),
        ]
        interceptors = [BearerTokenInterceptor(self.tokens)] if self.tokens else []
        server = grpc.aio.server(options=options, interceptors=interceptors)
        server.add_generic_rpc_handlers([method_handlers(self.servicer)])
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        names = (INFERENCE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = _address(cfg.host, cfg.port)
        try:
            if self.tls:
                port = server.add_secure_port(address, server_credentials(cfg.tls_cert, cfg.tls_key))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError("port", cfg.port, f"a free port on {cfg.host} ({exc})") from None
        if port == 0:
            raise ConfigError("port", cfg.port, f"a free port on {cfg.host}")
        # before anything runs: a busy port leaves nothing to clean up
        if self._serve_metrics and cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve_http(cfg.metrics_host, cfg.metrics_port,
                                                            token=self.metrics_token)
            except OSError as exc:
                raise ConfigError("metrics_port", cfg.metrics_port,
                                  f"a free port on {cfg.metrics_host} ({exc})") from None
        await self.health.start()
        await server.start()
        self._server, self.port = server, port
        log.info("serving %s on %s (tls=%s, auth=%s tokens)", INFERENCE_SERVICE, _address(cfg.host, port), self.tls,
                 len(self.tokens))

    @property
    def address(self) -> str:
        return _address(self.config.host, self.port)

    @property
    def metrics_url(self) -> str | None:
        """The metrics port's /metrics; None without one (then /metrics is on the HTTP API's port)."""
        if self.metrics_port is None:
            return None
        return f"http://{_address(self.config.metrics_host, self.metrics_port)}/metrics"

    async def stop(self, grace: float | None = 30.0) -> None:
        """Health NOT_SERVING, refuse new calls, give calls in flight `grace` seconds; then Generate
        streams still open end UNAVAILABLE with the reason, and ENDING_S later the rest is cancelled."""
        await self.health.stop()
        if self._server is not None:
            grace = grace or 0.0
            expire = asyncio.get_running_loop().call_later(grace, self.servicer.expire_streams)
            try:
                await self._server.stop(grace + ENDING_S)
            finally:
                expire.cancel()
            self._server = None
        await asyncio.to_thread(self.metrics.stop_http)  # waits for the HTTP thread's poll to end

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
