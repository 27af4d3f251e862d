"""Prometheus metrics of the translation server and the standard gRPC server metrics interceptor.

Every metric lives in an injected :class:`CollectorRegistry` (tests use a fresh one); names follow
``nmt_<thing>_<unit>``; label values are bounded (model names and versions, method names, status
codes, stages) and never carry texts or request ids. The ``grpc_server_*`` family matches the
go-grpc-prometheus / py-grpc-prometheus names so stock Grafana dashboards work.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from server.config import split_host_port
from server.errors import status_of

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
        # requests, seen by the servicer
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


def _grpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "BIDI_STREAMING"
    if handler.request_streaming:
        return "CLIENT_STREAMING"
    if handler.response_streaming:
        return "SERVER_STREAMING"
    return "UNARY"


def _code_of(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpcio versions return the raw cygrpc integer
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    if error is None:
        return "OK"
    if isinstance(error, asyncio.CancelledError):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return "DEADLINE_EXCEEDED"  # the server cancels a handler whose deadline has passed
    return status_of(error)[0].name


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """``grpc_server_started_total``, ``grpc_server_handled_total`` and ``grpc_server_handling_seconds``.

    The instrumented handler of each method is built once and reused (with its metric children), so
    a call pays two counter increments and one histogram observation, not a new handler.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        cached = self._wrapped.get(handler_call_details.method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[handler_call_details.method] = (handler, self._wrap(handler_call_details, handler))
        return cached[1]

    def _wrap(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        service, _, method = details.method.lstrip("/").rpartition("/")
        labels = (_grpc_type(handler), service, method)
        metrics = self.metrics
        started, handling = metrics.grpc_started.labels(*labels), metrics.grpc_handling.labels(*labels)

        def finish(context: grpc.aio.ServicerContext, start: float, error: BaseException | None) -> None:
            metrics.grpc_handled.labels(*labels, _code_of(context, error)).inc()
            handling.observe(time.perf_counter() - start)

        if handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                started.inc()
                start, error = time.perf_counter(), None
                try:
                    result = behavior(request, context)
                    if hasattr(result, "__aiter__"):
                        async for response in result:
                            yield response
                    elif inspect.isawaitable(result):  # a coroutine that writes with context.write()
                        await result
                    else:  # a plain iterator
                        for response in result:
                            yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, start, error)

            wrapped = streaming
        else:
            behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started.inc()
                start, error = time.perf_counter(), None
                try:
                    result = behavior(request, context)
                    return await result if inspect.isawaitable(result) else result
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, start, error)

            wrapped = unary

        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
