"""Prometheus metrics of one server, on their own registry, served as text at /metrics.

Gauges and counters of the engine are read from `service.stats()` and `service.health()` at
scrape time (nothing to keep in sync); latency histograms are observed by the API per
request, as the client sees it (from the request's arrival at the server). Names and meanings
are listed in docs/api.md; `METRICS` below is that list, checked by a test.

Under `serve --api-server-count N` (N > 1) each front-end process observes its own requests and any
of them may answer a scrape, so the API's counters and histograms live in prometheus_client's
multiprocess mode (a file per process in the server's PROMETHEUS_MULTIPROC_DIR; a scrape sums
them), and the engine's series come once, from the answering process's copy of the engine's
report. `meshserve_api_server_requests_total{api_server}` tells the processes apart.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from meshserve.api.auth import bearer_of, is_known
from meshserve.cluster.service import InferenceService, ServiceStats

PREFIX = "meshserve_"
METRICS = {
    "meshserve_requests_running": "gauge: requests holding KV blocks and being stepped",
    "meshserve_requests_waiting": "gauge: accepted requests not running (queued or preempted)",
    "meshserve_kv_cache_usage_ratio": "gauge: fraction of KV cache blocks held by requests",
    "meshserve_kv_cache_free_blocks": "gauge: KV cache blocks free or holding reusable prefixes",
    "meshserve_prefix_cache_hit_rate": "gauge: prefix-hit tokens / prompt tokens since start",
    "meshserve_prefix_cache_hit_tokens_total": "counter: prompt tokens served from the prefix cache",
    "meshserve_prompt_tokens_total": "counter: prompt tokens of accepted requests",
    "meshserve_generation_tokens_total": "counter: tokens generated",
    "meshserve_preemptions_total": "counter: requests preempted (KV freed, recomputed later)",
    "meshserve_replicas_healthy": "gauge: replicas able to serve",
    "meshserve_replicas": "gauge: replicas configured",
    "meshserve_unserving_seconds": "gauge: seconds since the service last served (a ready replica in every pool); "
                                   "0 while it does, absent until it first has",
    "meshserve_degraded_seconds": "gauge: seconds since every replica was last healthy; 0 while all are, absent "
                                  "until they first were",
    "meshserve_replica_rebuilds_total": "counter: failed replicas rebuilt and serving again",
    "meshserve_replica_rebuild_failures_total": "counter: rebuild attempts that failed (retried with backoff)",
    "meshserve_migrations_total": "counter: requests that moved on to another replica, from the tokens already "
                                  "streamed, when theirs died or hung",
    "meshserve_migrations_refused_total": "counter: requests that failed instead (UNAVAILABLE): already moved "
                                          "--max-migrations times",
    "meshserve_hung_replicas_total": "counter: replicas declared hung (a step past its deadline) and killed",
    "meshserve_hung_detection_seconds_total": "counter: seconds the hung steps had run when declared (divide by "
                                              "meshserve_hung_replicas_total for the mean time to detect)",
    "meshserve_grammar_compiles_stuck": "gauge: grammar compiles written off past grammar_compile_timeout_s and "
                                        "still running (xgrammar cannot stop them; at MAX_STUCK_COMPILES grammars are "
                                        "refused) (labels pool, replica)",
    "meshserve_grammar_compiles_written_off_total": "counter: grammar compiles written off: past "
                                                    "grammar_compile_timeout_s, or every request waiting for them "
                                                    "left (labels pool, replica)",
    "meshserve_grammar_compiles_refused_total": "counter: grammars refused without compiling: MAX_STUCK_COMPILES "
                                                "written-off compiles running, or the same grammar still stuck "
                                                "(labels pool, replica)",
    "meshserve_moe_expert_tokens": "gauge: rows routed to each expert since its replica started (labels layer, "
                                   "expert; MoE models)",
    "meshserve_kv_handovers_total": "counter: KV hand-overs: on a prefill replica the requests it handed over, on a "
                                    "decode replica those it adopted (labels pool, replica; disaggregated pools)",
    "meshserve_kv_imported_bytes_total": "counter: KV cache bytes a decode replica's ranks pulled, imports that "
                                         "succeeded (labels pool, replica; disaggregated pools)",
    "meshserve_kv_transfer_seconds": "histogram: one request's KV pull on the importing replica, imports that "
                                     "succeeded (labels pool, replica; disaggregated pools)",
    "meshserve_kv_recomputes_total": "counter: adopted requests whose prompt was recomputed instead of imported "
                                     "(labels pool, replica, reason; disaggregated pools)",
    "meshserve_kv_transport_info": "gauge: 1 for the KV transport between the pools as configured and resolved at "
                                   "start: nixl, zmq, cuda_ipc, or cuda_ipc|zmq when chosen per hand-over (label "
                                   "transport; disaggregated pools)",
    "meshserve_kv_imports_total": "counter: KV imports that succeeded, by the transport that moved them (labels "
                                  "pool, replica, transport; disaggregated pools)",
    "meshserve_requests_total": "counter: finished Generate calls by gRPC status code (label code)",
    "meshserve_api_server_requests_total": "counter: finished Generate calls (gRPC and HTTP) per front-end process "
                                           "(label api_server: 0 .. --api-server-count - 1)",
    "meshserve_time_to_first_token_seconds": "histogram: arrival to first token",
    "meshserve_time_per_output_token_seconds": "histogram: (last token - first token) / (tokens - 1), per request",
    "meshserve_e2e_request_latency_seconds": "histogram: arrival to last token, requests that finished",
}

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0)


class _ServiceCollector(Collector):
    """Reads the service's snapshot at each scrape."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def collect(self) -> Iterator:
        s = self.service.stats()
        h = self.service.health()
        doc = {name: text.split(": ", 1)[1] for name, text in METRICS.items()}

        def gauge(name: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc[name], value=value)

        def counter(name: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name.removesuffix("_total"), doc[name], value=value)

        yield gauge("meshserve_requests_running", s.num_running)
        yield gauge("meshserve_requests_waiting", s.num_waiting)
        yield gauge("meshserve_kv_cache_usage_ratio", s.kv_usage)
        yield gauge("meshserve_kv_cache_free_blocks", s.num_free_kv_blocks)
        yield gauge("meshserve_prefix_cache_hit_rate", min(1.0, s.prefix_hit_tokens / max(1, s.prompt_tokens)))
        yield counter("meshserve_prefix_cache_hit_tokens_total", s.prefix_hit_tokens)
        yield counter("meshserve_prompt_tokens_total", s.prompt_tokens)
        yield counter("meshserve_generation_tokens_total", s.generated_tokens)
        yield counter("meshserve_preemptions_total", s.num_preemptions)
        yield gauge("meshserve_replicas_healthy", h.healthy_replicas)
        yield gauge("meshserve_replicas", h.total_replicas)
        if h.unserving_s is not None:
            yield gauge("meshserve_unserving_seconds", h.unserving_s)
        if h.degraded_s is not None:
            yield gauge("meshserve_degraded_seconds", h.degraded_s)
        yield counter("meshserve_replica_rebuilds_total", h.num_rebuilds)
        yield counter("meshserve_replica_rebuild_failures_total", h.num_rebuild_failures)
        yield counter("meshserve_migrations_total", s.num_migrations)
        yield counter("meshserve_migrations_refused_total", s.num_migrations_refused)
        yield counter("meshserve_hung_replicas_total", s.num_hung_replicas)
        yield counter("meshserve_hung_detection_seconds_total", s.hung_detection_s)
        if s.expert_tokens:
            experts = GaugeMetricFamily("meshserve_moe_expert_tokens", doc["meshserve_moe_expert_tokens"],
                                        labels=["layer", "expert"])
            for layer, row in enumerate(s.expert_tokens):
                for expert, rows in enumerate(row):
                    experts.add_metric([str(layer), str(expert)], rows)
            yield experts
        if s.kv_transport:
            transport = GaugeMetricFamily("meshserve_kv_transport_info", doc["meshserve_kv_transport_info"],
                                          labels=["transport"])
            transport.add_metric([s.kv_transport], 1)
            yield transport
        yield from _handover_families(s, doc)
        yield from _grammar_families(s, doc)


def _grammar_families(s: ServiceStats, doc: dict[str, str]) -> Iterator:
    """Per pool and replica: the driver rank's grammar compiles written off and still running,
    written off, refused."""
    if not s.grammar_compiles:
        return
    labels = ["pool", "replica"]
    stuck = GaugeMetricFamily("meshserve_grammar_compiles_stuck", doc["meshserve_grammar_compiles_stuck"],
                              labels=labels)
    written_off = CounterMetricFamily("meshserve_grammar_compiles_written_off",
                                      doc["meshserve_grammar_compiles_written_off_total"], labels=labels)
    refused = CounterMetricFamily("meshserve_grammar_compiles_refused",
                                  doc["meshserve_grammar_compiles_refused_total"], labels=labels)
    for row in s.grammar_compiles:
        key = [row.pool, row.replica]
        stuck.add_metric(key, row.num_stuck)
        written_off.add_metric(key, row.num_written_off)
        refused.add_metric(key, row.num_refused)
    yield from (stuck, written_off, refused)


def _handover_families(s: ServiceStats, doc: dict[str, str]) -> Iterator:
    """Per pool and replica: hand-overs, bytes, pull seconds, recomputes by reason."""
    if not s.handovers:
        return
    labels = ["pool", "replica"]
    handovers = CounterMetricFamily("meshserve_kv_handovers", doc["meshserve_kv_handovers_total"], labels=labels)
    imported = CounterMetricFamily("meshserve_kv_imported_bytes", doc["meshserve_kv_imported_bytes_total"],
                                   labels=labels)
    seconds = HistogramMetricFamily("meshserve_kv_transfer_seconds", doc["meshserve_kv_transfer_seconds"],
                                    labels=labels)
    recomputes = CounterMetricFamily("meshserve_kv_recomputes", doc["meshserve_kv_recomputes_total"],
                                     labels=[*labels, "reason"])
    by_transport = CounterMetricFamily("meshserve_kv_imports", doc["meshserve_kv_imports_total"],
                                       labels=[*labels, "transport"])
    for row in s.handovers:
        key, h = [row.pool, row.replica], row.stats
        handovers.add_metric(key, h.handovers)
        if row.pool == "prefill":
            continue  # the importing end has the rest
        imported.add_metric(key, h.kv_bytes)
        seconds.add_metric(key, h.cumulative_buckets(), h.transfer_seconds)
        for reason, n in h.recomputes.items():
            recomputes.add_metric([*key, reason], n)
        for transport, n in sorted(h.transports.items()):
            by_transport.add_metric([*key, transport], n)
    yield from (handovers, imported, seconds, recomputes, by_transport)


class RequestTimer:
    """Latency of one Generate call; `tokens(n)` as deltas arrive, `finish(code)` once."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self.last = self.start
        self.num_tokens = 0

    def tokens(self, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        self.num_tokens += n
        self.last = now

    def finish(self, code: str, *, completed: bool) -> None:
        """code: the call's status code name; completed: the request reached its last delta."""
        self.metrics.requests.labels(code=code).inc()
        self.metrics.api_server_requests.inc()
        if completed and self.first is not None:
            self.metrics.e2e.observe(self.last - self.start)
            if self.num_tokens > 1:
                self.metrics.tpot.observe((self.last - self.first) / (self.num_tokens - 1))


class _ModelNameLabel(Collector):
    """Every sample of `registry` with a model_name label (vLLM's; dashboards built for vLLM filter on it)."""

    def __init__(self, registry: CollectorRegistry, service: InferenceService) -> None:
        self.registry = registry
        self.service = service

    def _model_name(self) -> str:
        try:
            return self.service.models()[0].name
        except Exception:  # a service still starting may not know its model yet
            return ""

    def collect(self) -> Iterator:
        name = self._model_name()
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**s.labels, "model_name": name}) for s in family.samples]
            yield family


class ServerMetrics:
    """The server's metrics. api_server: this front-end process's index (--api-server-count);
    shared_dir: the multiprocess folder the front-end processes share (None: one process)."""

    def __init__(self, service: InferenceService, *, api_server: int = 0, shared_dir: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ServiceCollector(service))
        own = self.registry
        if shared_dir is not None:
            if not getattr(values.ValueClass, "_multiprocess", False):
                raise RuntimeError("ServerMetrics(shared_dir=...) needs PROMETHEUS_MULTIPROC_DIR set before "
                                   "prometheus_client is imported (api/api_servers.py sets it for each process)")
            # the API's own series are read back from every process's file, not from this process's objects
            MultiProcessCollector(self.registry, path=shared_dir)
            own = None
        # what the endpoints serve: the same samples, labelled model_name
        self.exposition = CollectorRegistry(auto_describe=False)
        self.exposition.register(_ModelNameLabel(self.registry, service))
        doc = {name: text.split(": ", 1)[1] for name, text in METRICS.items()}
        self.requests = Counter("meshserve_requests", doc["meshserve_requests_total"], ["code"], registry=own)
        self.api_server_requests = Counter("meshserve_api_server_requests", doc["meshserve_api_server_requests_total"],
                                           ["api_server"], registry=own).labels(api_server=str(api_server))
        self.ttft = Histogram("meshserve_time_to_first_token_seconds", doc["meshserve_time_to_first_token_seconds"],
                              buckets=_TTFT_BUCKETS, registry=own)
        self.tpot = Histogram("meshserve_time_per_output_token_seconds",
                              doc["meshserve_time_per_output_token_seconds"], buckets=_TPOT_BUCKETS,
                              registry=own)
        self.e2e = Histogram("meshserve_e2e_request_latency_seconds", doc["meshserve_e2e_request_latency_seconds"],
                             buckets=_E2E_BUCKETS, registry=own)
        self._http = None

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def serve_http(self, host: str, port: int, *, token: str | None = None) -> int:
        """Serve /metrics on host:port (0 = a free port) in a daemon thread; returns the port.
        With a token, a scrape without `Authorization: Bearer <token>` gets 401."""
        app = make_wsgi_app(self.exposition)
        if token is not None:
            app = _bearer_only(app, token)
        server_class = _MetricsServer6 if ":" in host else ThreadingWSGIServer
        self._http = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _MetricsServer6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # scrapes are not news
        pass


def _bearer_only(app, token: str):
    """A WSGI app that answers 401 unless the request carries `Authorization: Bearer <token>`."""
    expected = (token.encode(),)

    def guarded(environ, start_response):
        header = environ.get("HTTP_AUTHORIZATION")
        if is_known(bearer_of([("authorization", header)] if header is not None else []), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong bearer token: send the header 'Authorization: Bearer <token>'\n"]

    return guarded
