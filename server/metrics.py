"""Prometheus metrics of the translation server, and the standard gRPC server metrics.

Every metric lives in an injected :class:`CollectorRegistry` (tests use a fresh one); names follow
``nmt_<thing>_<unit>``; label values are bounded (model names and versions, method names, status
codes, stages) and never carry texts or request ids. The ``grpc_server_*`` family matches the
go-grpc-prometheus / py-grpc-prometheus names so stock Grafana dashboards work. The request and
``grpc_server_*`` metrics are counted by :mod:`server.interceptor`, the others by the scheduler.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from server.config import split_host_port

# seconds: 1 ms .. 60 s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SENTENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class ServerMetrics:
    """The ``nmt_*`` and ``grpc_server_*`` metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # requests, seen by the interceptor
        self.requests = Counter("nmt_requests", "Translator requests by model, method and status code",
                                ["model", "method", "code"], registry=r)
        self.request_duration = Histogram("nmt_request_duration_seconds",
                                          "End-to-end request latency inside the server", ["model", "method"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("nmt_inflight_requests", "Translator requests being handled", registry=r)
        # scheduler
        self.queue_duration = Histogram("nmt_queue_duration_seconds",
                                        "Time a sentence waited between admission and the start of its batch",
                                        ["model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("nmt_queue_depth", "Sentences waiting for a batch", ["model", "version"], registry=r)
        self.inference_duration = Histogram("nmt_inference_duration_seconds", "Compute time of one batch by stage",
                                            ["model", "version", "stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_sentences = Histogram("nmt_batch_size_sentences", "Sentences per batch", ["model", "version"],
                                         buckets=SENTENCE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("nmt_batch_size_tokens",
                                      "Source positions per batch including padding (what the token budget limits)",
                                      ["model", "version"], buckets=TOKEN_BUCKETS, registry=r)
        self.padding_ratio = Histogram("nmt_batch_padding_ratio", "Padded positions / all positions of a batch",
                                       ["model", "version"], buckets=RATIO_BUCKETS, registry=r)
        self.generated_tokens = Counter("nmt_generated_tokens", "Target tokens generated (all returned hypotheses)",
                                        ["model", "version"], registry=r)
        self.source_tokens = Counter("nmt_source_tokens", "Source tokens encoded (EOS included, padding excluded)",
                                     ["model", "version"], registry=r)
        self.cancelled_sentences = Counter("nmt_cancelled_sentences",
                                           "Sentences that left a running batch because their request was "
                                           "cancelled or expired", ["model", "version"], registry=r)
        self.model_info = Gauge("nmt_model_info", "Loaded model versions (value 1)",
                                ["model", "version", "architecture", "provider"], registry=r)
        self.model_loads = Counter("nmt_model_loads", "Model version loads (start-up, hot reload and reloads of a "
                                   "failing version) by outcome: loaded, or refused (bad manifest or hash, "
                                   "load error, failed smoke translation)", ["model", "result"], registry=r)
        # standard gRPC server metrics
        self.grpc_started = Counter("grpc_server_started", "RPCs started on the server",
                                    ["grpc_type", "grpc_service", "grpc_method"], registry=r)
        self.grpc_handled = Counter("grpc_server_handled", "RPCs completed on the server, regardless of success",
                                    ["grpc_type", "grpc_service", "grpc_method", "grpc_code"], registry=r)
        self.grpc_handling = Histogram("grpc_server_handling_seconds", "Response latency of RPCs handled",
                                       ["grpc_type", "grpc_service", "grpc_method"], buckets=LATENCY_BUCKETS,
                                       registry=r)

    def serve_http(self, address: str) -> Any:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread; returns the HTTP server (``.server_port``)."""
        host, port = split_host_port(address)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
