"""The server interceptor: the work every call shares, done around the handlers (as TGI's server does).

For every method of every service: the standard ``grpc_server_started_total``,
``grpc_server_handled_total`` and ``grpc_server_handling_seconds`` (the go-grpc-prometheus names),
and the parsing of request messages: a message that does not parse (garbage bytes, invalid UTF-8, a
truncated field) becomes an :class:`Undecodable` value instead of gRPC's ``UNKNOWN "Unexpected
<class DecodeError>"``; it is counted in ``nmt_undecodable_messages_total{grpc_service,grpc_method}``
and logged, a unary call gets INVALID_ARGUMENT (counted and logged like any failed call), and in
``TranslateStream`` (:data:`PER_MESSAGE_ERRORS`) the handler answers that one message with an error
while the stream goes on. Other streams end with INVALID_ARGUMENT.

With an :class:`~server.frontend.auth.Authenticator`, every call of every service but those of
:data:`server.frontend.auth.OPEN_SERVICES` (health) is authenticated first, inside the instrumented call: a
missing or unknown bearer token ends it with UNAUTHENTICATED through :func:`server.errors.abort` (the
one mapping), so it is counted, timed and logged like any failed call; the call's
:class:`~server.frontend.auth.Grant` goes on its record for the handler. A refused call of another service
(reflection) is logged too ("request denied"), as the Translator's are by their "request" line.

For the methods of the accounted service (the Translator), besides:
    * a request id, the ``x-request-id`` metadata when given, else a fresh one, echoed in trailing metadata;
    * ``nmt_requests_total{model,method,code}`` (``method="http:Translate"`` for the HTTP face's calls,
      :meth:`RequestInterceptor.http_behavior`) and one JSON log line ("request") per call: request id,
      method, model, version, texts, code, seconds and, for a failure, its message; the HTTP face's requests
      that reach no method are counted and logged the same way (:meth:`RequestInterceptor.http_refused`);
    * for the calls that translate (all but ``ListModels``): ``nmt_request_duration_seconds`` and the
      in-flight count (``nmt_inflight_requests``), whose return to zero :meth:`RequestInterceptor.wait_idle`
      awaits for the graceful drain.

The interceptor does not know models: a handler writes the model version it resolved and the number of
texts on the call's :class:`CallRecord` (:func:`current_call`, a context variable the interceptor sets
for the call; tasks the handler starts see it too). A ``TranslateStream`` is one call: one count, one
duration and one log line for the whole stream, with the texts of all its requests and the model of the
last one resolved.

:func:`code_name` alone decides the status code of a finished call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc

from server.errors import InvalidArgument, ServingError, abort, status_of
from server.frontend.auth import ANYONE, OPEN_SERVICES, Authenticator, Grant
from server.metrics import HTTP_LABEL_PREFIX, HTTP_UNROUTED, LOOKUP_METHODS, Children, ServerMetrics

log = logging.getLogger("nmt.server")

REQUEST_ID_KEY = "x-request-id"
PER_MESSAGE_ERRORS = frozenset({"TranslateStream"})  # request streams whose handler answers Undecodable itself


@dataclass(frozen=True)
class Undecodable:
    """A request message that did not parse, in place of the message (see the module docstring)."""

    size: int  # bytes received
    reason: str

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"the request message could not be parsed ({self.size} bytes): {self.reason}; "
                               "send a valid serialized message of the method's request type")


def _parse_failure(error: Exception) -> str:
    """A plain reason for a parse failure (no type names, no internals)."""
    if isinstance(error, UnicodeDecodeError):
        return "a string field is not valid UTF-8"
    text = str(error).strip().rstrip(".")
    return text if text and "<" not in text and len(text) < 200 else "malformed protobuf message"


@dataclass
class CallRecord:
    """What one call's log line and request metrics say; the handler fills in the model part."""

    method: str
    request_id: str
    model: str = ""
    version: str = ""
    texts: int = 0
    grant: Grant = ANYONE  # what the call's token may use (authentication off: everything)


# Each RPC runs in its own task, so the variable set at the start of a call is that call's.
_CALL: ContextVar[CallRecord | None] = ContextVar("nmt_call", default=None)


def current_call() -> CallRecord:
    """The record of the call being handled (outside the interceptor: a detached one nobody reads)."""
    record = _CALL.get()
    return record if record is not None else CallRecord("", "")


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    """The call's ``x-request-id`` metadata (at most 128 characters), else a fresh id."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return str(value)[:128]
    return f"{random.getrandbits(128):032x}"  # an id, not a secret: no system call (uuid4: ~4 us a call)


def code_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status code of a finished call: the one set on the call (an abort), else OK without an error,
    DEADLINE_EXCEEDED for a cancellation once the deadline has passed (gRPC cancels such a handler),
    CANCELLED for a stream whose consumer stopped early (``GeneratorExit``), else the error's own code
    (:func:`server.errors.status_of`)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some grpcio versions return the raw cygrpc integer
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    if error is None:
        return "OK"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):  # GeneratorExit: the consumer stopped early
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return "DEADLINE_EXCEEDED"
        if isinstance(error, GeneratorExit):
            return "CANCELLED"
    return status_of(error)[0].name


async def _refuse(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
    """End the call with INVALID_ARGUMENT for an undecodable message (keeping the request id metadata)."""
    await abort(context, request.error())


def _error_message(context: grpc.aio.ServicerContext, error: BaseException | None) -> str | None:
    """What a failed call told its client (None for a success or a cancellation)."""
    if error is None or isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return None
    return context.details() or status_of(error)[1]


def _grpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "BIDI_STREAMING"
    if handler.request_streaming:
        return "CLIENT_STREAMING"
    if handler.response_streaming:
        return "SERVER_STREAMING"
    return "UNARY"


class RequestInterceptor(grpc.aio.ServerInterceptor):
    """Request ids, request logs, request metrics and the in-flight count (see the module docstring).

    The instrumented handler of each method is built once and reused (with its metric children), so
    a call pays a few counter increments and histogram observations, not a new handler.
    """

    def __init__(self, metrics: ServerMetrics, *, service: str, authenticator: Authenticator | None = None) -> None:
        self.metrics = metrics
        self.service = service  # the accounted service, e.g. "translation.v1.Translator"
        self.authenticator = authenticator  # None: no authentication
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._requests = Children(metrics.requests)  # by model, method label and code
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_arrival = float("-inf")  # time.monotonic() of the latest translating call

    async def wait_idle(self, timeout: float, *, quiet: float = 0.0) -> bool:
        """Wait until no translating call is in flight and none has arrived for ``quiet`` seconds (True), or
        ``timeout`` passes with calls still in flight (False; once idle, a timeout cuts the quiet wait short).

        The quiet wait closes a race at shutdown: a caller still routing to this server (its health watch or
        balancer not yet updated) would otherwise have a call land just as the gRPC server stops, which
        cancels it (CANCELLED, which clients must not retry) instead of refusing it (UNAVAILABLE, retried)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._inflight:
                try:
                    await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    return False
            now = time.monotonic()
            wait = min(self._last_arrival + quiet - now, deadline - now)
            if wait <= 0:
                return True
            await asyncio.sleep(wait)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        cached = self._wrapped.get(handler_call_details.method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[handler_call_details.method] = (handler, self._wrap(handler_call_details.method,
                                                                                       handler))
        return cached[1]

    def http_behavior(self, full_method: str, behavior: Callable[[Any, Any], Any], *,
                      label: str = "") -> Callable[[Any, Any], Any]:
        """A unary servicer method (``behavior(request, context)``) wrapped for the HTTP face (:mod:`server.http`):
        the same authentication, request id, log line, in-flight count and ``nmt_*`` request metrics as a gRPC
        call, under the method label ``label`` (default ``http:<Method>``; the compatible APIs name theirs, e.g.
        ``libretranslate:translate``); the ``grpc_server_*`` family counts gRPC calls only."""
        return self._wrap(full_method, grpc.unary_unary_rpc_method_handler(behavior), http=True,
                          label=label).unary_unary

    def http_stream_behavior(self, full_method: str, behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A server-streaming servicer method wrapped for the HTTP face's server-sent events, as
        :meth:`http_behavior` wraps a unary one."""
        return self._wrap(full_method, grpc.unary_stream_rpc_method_handler(behavior), http=True).unary_stream

    def http_refused(self, context: Any, code: grpc.StatusCode, message: str) -> None:
        """Count and log an HTTP request that reached no method (an unknown path, a wrong verb, a request that is
        not valid HTTP) as a call of ``method=`` :data:`~server.metrics.HTTP_UNROUTED`, ``model=""``, ended with
        ``code``; its request id (``x-request-id`` or a fresh one) goes on ``context``'s trailing metadata."""
        record = CallRecord(HTTP_UNROUTED, request_id_of(context))
        context.set_trailing_metadata(((REQUEST_ID_KEY, record.request_id),))
        self._account(record, code.name, 0.0, message)

    def _account(self, record: CallRecord, code: str, seconds: float, message: str | None) -> None:
        """A finished call's ``nmt_requests_total`` count and its "request" log line."""
        self._requests(record.model, record.method, code).inc()
        fields: dict[str, Any] = {"request_id": record.request_id, "method": record.method, "model": record.model,
                                  "version": record.version, "texts": record.texts, "code": code,
                                  "seconds": round(seconds, 6)}
        if message is not None:
            fields["error"] = message
        log.info("request", extra={"fields": fields})

    def _wrap(self, full_method: str, handler: grpc.RpcMethodHandler, *, http: bool = False,
              label: str = "") -> grpc.RpcMethodHandler:
        service, _, method = full_method.lstrip("/").rpartition("/")
        label = label or (f"{HTTP_LABEL_PREFIX}{method}" if http else method)  # the method label of the nmt_* families
        labels = (_grpc_type(handler), service, method)
        metrics = self.metrics
        started, handling = metrics.grpc_started.labels(*labels), metrics.grpc_handling.labels(*labels)
        handled = Children(metrics.grpc_handled, *labels)  # by code
        durations = Children(metrics.request_duration)  # by model and method label
        accounted = service == self.service
        translating = accounted and method not in LOOKUP_METHODS
        undecodable = metrics.undecodable.labels(service, method)
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            if parse is None:
                return data
            try:
                return parse(data)
            except Exception as error:  # noqa: BLE001 - DecodeError, UnicodeDecodeError, ...: the client's fault
                undecodable.inc()
                bad = Undecodable(len(data), _parse_failure(error))
                log.warning("undecodable message", extra={"fields": {
                    "method": f"{service}/{method}", "bytes": bad.size, "reason": bad.reason}})
                return bad

        async def refuse_undecodable(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await _refuse(request, context)
                yield request

        authenticator = self.authenticator if service not in OPEN_SERVICES else None

        async def authenticate(context: grpc.aio.ServicerContext, record: CallRecord | None) -> None:
            """The call's grant on its record, or the call ends here (UNAUTHENTICATED)."""
            if authenticator is None:
                return
            try:
                grant = authenticator.authenticate(context.invocation_metadata())
            except ServingError as error:
                if record is None:
                    log.warning("request denied", extra={"fields": {"service": service, "method": method,
                                                                    "code": error.code.name, "error": str(error)}})
                await abort(context, error)
            if record is not None:
                record.grant = grant

        refuses_in_stream = handler.request_streaming and method not in PER_MESSAGE_ERRORS

        async def admit(request: Any, context: grpc.aio.ServicerContext, record: CallRecord | None) -> Any:
            """Authenticate the call and refuse an undecodable message; the request (or stream) to handle."""
            await authenticate(context, record)
            if isinstance(request, Undecodable):
                await _refuse(request, context)
            return refuse_undecodable(request, context) if refuses_in_stream else request

        def begin(context: grpc.aio.ServicerContext) -> tuple[float, CallRecord | None]:
            if not http:
                started.inc()
            record = None
            if accounted:
                record = CallRecord(label, request_id_of(context))
                context.set_trailing_metadata(((REQUEST_ID_KEY, record.request_id),))
                _CALL.set(record)
            if translating:
                self._inflight += 1
                self._last_arrival = time.monotonic()
                self._idle.clear()
                metrics.inflight.inc()
            return time.perf_counter(), record

        def finish(context: grpc.aio.ServicerContext, start: float, record: CallRecord | None,
                   error: BaseException | None) -> None:
            seconds = time.perf_counter() - start
            code = code_name(context, error)
            if not http:
                handled(code).inc()
                handling.observe(seconds)
            if record is not None:
                if translating:
                    durations(record.model, label).observe(seconds)
                self._account(record, code, seconds, _error_message(context, error))
            if translating:
                self._inflight -= 1
                metrics.inflight.dec()
                if self._inflight == 0:
                    self._idle.set()

        if handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream

            async def responses(request: Any, context: Any) -> AsyncIterator[Any]:
                """The call's responses, accounted when they end; a consumer that stops early closes them
                (``contextlib.aclosing``), which closes the handler's own generator."""
                start, record = begin(context)
                error = None
                try:
                    result = behavior(await admit(request, context, record), context)
                    if hasattr(result, "__aiter__"):
                        try:
                            async for response in result:
                                yield response
                        finally:
                            if hasattr(result, "aclose"):
                                await result.aclose()
                    elif inspect.isawaitable(result):  # a coroutine that writes with context.write()
                        await result
                    else:  # a plain iterator
                        for response in result:
                            yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, start, record, error)

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> None:
                """gRPC's handler: a coroutine that writes each response. grpc.aio leaves an async generator
                that it stops iterating (a cancellation while it writes) to the garbage collector; here the
                cancellation lands in this coroutine and the responses are closed at once."""
                async with contextlib.aclosing(responses(request, context)) as items:
                    async for response in items:
                        await context.write(response)

            wrapped = responses if http else streaming
        else:
            behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, record = begin(context)
                error = None
                try:
                    result = behavior(await admit(request, context, record), context)
                    return await result if inspect.isawaitable(result) else result
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, start, record, error)

            wrapped = unary

        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return factory(
            wrapped,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )
