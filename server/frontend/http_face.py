"""The HTTP/JSON face of the Translator, beside gRPC on the same event loop (aiohttp), and the explorer page.

The routes are the proto's ``google.api.http`` annotations (:func:`http_routes`), so an external transcoder
(Envoy's gRPC-JSON transcoder, grpc-gateway) maps them the same way; bodies are the proto3 JSON mapping
of the same messages (``google.protobuf.json_format``: lowerCamelCase out, either spelling in, every field
printed). A route calls the servicer's own method through :meth:`RequestInterceptor.http_behavior`, so
validation, the scheduler, the error mapping (:mod:`server.errors`), authentication, request ids, logs and
the ``nmt_*`` request metrics are the gRPC path's, not copies. :class:`HttpContext` is the small part of
a gRPC servicer context they use.

Around the call, what gateways do: a failed call's status becomes the HTTP status of :data:`HTTP_STATUS`
(grpc-gateway's table) with the JSON of ``google.rpc.Status`` (``{code, message, details}``) as body; the
``grpc-timeout`` header (gRPC's format, e.g. ``500m``, ``2S``) is the call's deadline; a client that
disconnects cancels the call (aiohttp's handler cancellation), which stops its sentences in the batch loop;
``x-request-id`` is read and echoed; CORS answers only the ``--cors-origins``. Besides: ``/healthz``
(liveness), ``/readyz`` (every model's newest version serving and not draining) and the alignment explorer
(``/``, static files of ``server/frontend/static`` shipped as package data).

The errors aiohttp answers itself are Status JSON too, counted and logged by the interceptor
(:meth:`RequestInterceptor.http_refused`, ``method="http:unknown"``): its router's (an unknown path 404, a
wrong verb 405 with its ``Allow``) through a middleware, those of requests that are not valid HTTP (a
header over the limit, TLS sent to this port) and of exceptions no handler caught through :class:`_Runner`.
A body over :data:`MAX_BODY_BYTES` is the RPC's INVALID_ARGUMENT, like any request that does not parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from google.api import annotations_pb2
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.rpc import status_pb2

from server.config import split_host_port
from server.errors import InvalidArgument, report
from server.frontend.interceptor import REQUEST_ID_KEY, RequestInterceptor, Undecodable

STATIC_DIR = Path(__file__).resolve().parent / "static"
TIMEOUT_HEADER = "grpc-timeout"
CORS_HEADERS = "authorization, content-type, grpc-timeout, x-request-id"
STOP_SECONDS = 1.0  # how long open HTTP connections get once the server stops
MAX_BODY_BYTES = 8 * 1024 * 1024  # a request body over this is refused (INVALID_ARGUMENT)

# gRPC status -> HTTP status, as grpc-gateway's runtime.HTTPStatusFromCode (and Envoy's transcoder) map them
HTTP_STATUS: Mapping[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}
# HTTP status -> gRPC code, for the errors aiohttp answers itself (its router, its HTTP parser, a handler's uncaught
# exception or timeout): HTTP_STATUS the other way round, and a wrong verb UNIMPLEMENTED with its 405, as
# grpc-gateway answers it; another 4xx is INVALID_ARGUMENT, another 5xx INTERNAL
GRPC_CODE: Mapping[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    500: grpc.StatusCode.INTERNAL,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


@dataclass(frozen=True)
class Route:
    """One ``google.api.http`` rule: ``verb path`` -> the RPC ``method`` (unary, or server-streaming: its
    messages go out as server-sent events)."""

    verb: str  # "GET", "POST", ...
    path: str
    method: MethodDescriptor
    body: str  # "*": the whole JSON body is the request; "": the query string is

    @property
    def streaming(self) -> bool:
        return self.method.server_streaming


def http_routes(service: ServiceDescriptor) -> list[Route]:
    """The routes the proto declares for ``service``'s methods that take one request (client-streaming
    methods have none)."""
    routes = []
    for method in service.methods:
        rule = method.GetOptions().Extensions[annotations_pb2.http]
        verb = rule.WhichOneof("pattern")
        if verb is None or verb == "custom" or method.client_streaming:
            continue
        path = getattr(rule, verb)
        for name in re.findall(r"{([^}]*)}", path):
            if name not in method.input_type.fields_by_name or "=" in name or "." in name:
                raise ValueError(f"{method.full_name}: a path variable must be a top-level field of "
                                 f"{method.input_type.name} ({path})")
        routes.append(Route(verb.upper(), path, method, rule.body))
    return routes


def parse_timeout(value: str) -> float:
    """A ``grpc-timeout`` header value (``100m``, ``5S``, ...) in seconds; InvalidArgument when malformed."""
    match = _TIMEOUT.fullmatch(value.strip())
    if match is None:
        raise InvalidArgument(f"{TIMEOUT_HEADER} header {value!r} is not a gRPC timeout: 1 to 8 digits and a unit "
                              "H, M, S, m (ms), u (µs) or n (ns), e.g. 500m or 2S")
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


def code_of_http(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP error status aiohttp answered (:data:`GRPC_CODE`)."""
    return GRPC_CODE.get(status, grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL)


def not_http(error: HttpProcessingError) -> str:
    """What was wrong with a request aiohttp's parser refused (a line over the limit is not repeated: it may
    hold a token)."""
    if isinstance(error, LineTooLong):  # LineTooLong(line, limit, actual_size)
        return f"a request line or header is over the limit of {error.args[1]} bytes"
    return f"the request is not valid HTTP/1.1: {' '.join(error.message.split())[:200]}"


class BadHttpRequest(Undecodable):
    """A request the HTTP face could not turn into a message (bad JSON, a bad header): INVALID_ARGUMENT,
    answered by the interceptor as an undecodable gRPC message is, so it is logged and counted in
    ``nmt_requests_total`` (not in ``nmt_undecodable_messages_total``, which counts protobuf bytes)."""

    def error(self) -> InvalidArgument:
        return InvalidArgument(self.reason)


class HttpContext:
    """The part of ``grpc.aio.ServicerContext`` that the interceptor and the servicer use, for one HTTP call."""

    def __init__(self, headers: Mapping[str, str], timeout: float | None) -> None:
        self._metadata = tuple((key.lower(), value) for key, value in headers.items())
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._trailing: tuple[tuple[str, str], ...] = ()
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    def headers(self) -> dict[str, str]:
        """The response headers: the trailing metadata the call set (its request id)."""
        return {key: value for key, value in self._trailing if key == REQUEST_ID_KEY}


def _json(message: Any) -> str:
    """``message`` in the proto3 JSON mapping, every field printed (as grpc-gateway's default marshaler)."""
    return json.dumps(json_format.MessageToDict(message, always_print_fields_with_no_presence=True),
                      separators=(",", ":"))


def json_response(message: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """``message`` as the JSON body of a response (:func:`_json`)."""
    return web.Response(text=_json(message), status=status, content_type="application/json", headers=headers)


def error_response(code: grpc.StatusCode, message: str, headers: Mapping[str, str] | None = None, *,
                   status: int | None = None) -> web.Response:
    """A failed call: the ``google.rpc.Status`` JSON ``{code, message, details}`` with ``status``, by default the
    HTTP status of ``code`` (:data:`HTTP_STATUS`)."""
    body = status_pb2.Status(code=code.value[0], message=message)
    return json_response(body, status=status or HTTP_STATUS.get(code, 500), headers=headers)


def cors_origins(setting: str) -> frozenset[str]:
    """``--cors-origins``: comma-separated origins, or ``*``."""
    return frozenset(origin.strip().rstrip("/") for origin in setting.split(",") if origin.strip())


Refuse = Callable[[web.BaseRequest, int, str], web.Response]  # (request, HTTP status, message) -> the answer


class _Protocol(web.RequestHandler):
    """aiohttp's HTTP/1.1 connection, whose own error answers are ``refuse``'s (see :class:`_Runner`)."""

    def __init__(self, manager: web.Server, *, refuse: Refuse, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.refuse = refuse

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The answer to a request that is not valid HTTP (400), or whose handler raised (500) or timed out (504)."""
        if request.writer.output_size > 0:  # as aiohttp: part of a response is out, the connection is broken
            raise ConnectionError("a response is already under way, cannot send the error")
        if isinstance(exc, HttpProcessingError):
            text = not_http(exc)
        elif isinstance(exc, Exception):
            text = report(exc)[1]  # INTERNAL, its traceback logged
        else:
            text = HTTPStatus(status).phrase
        response = self.refuse(request, status, text)
        response.force_close()  # as aiohttp: the connection may be out of step
        return response


class _Server(web.Server):
    """A copy of aiohttp's ``server`` whose connections are :class:`_Protocol`."""

    def __init__(self, server: web.Server, refuse: Refuse) -> None:
        super().__init__(server.request_handler, request_factory=server.request_factory,
                         handler_cancellation=server.handler_cancellation, **server._kwargs)
        self.refuse = refuse

    def __call__(self) -> web.RequestHandler:
        return _Protocol(self, loop=self._loop, refuse=self.refuse, **self._kwargs)


class _Runner(web.AppRunner):
    """An ``AppRunner`` whose connections answer the errors aiohttp answers itself with ``refuse``.

    A request that is not valid HTTP (a header over the limit, TLS sent to this port) fails in aiohttp's parser
    before any handler or middleware, and aiohttp answers it, and an exception no handler caught, in
    ``RequestHandler.handle_error``: text/plain, with a traceback on the ``aiohttp.server`` logger. aiohttp has no
    public hook for that answer (aio-libs/aiohttp#3287), so this runner overrides ``_make_server`` to serve with
    a ``RequestHandler`` that overrides ``handle_error`` (aiohttp 3.14; the server's ``_kwargs`` and ``_loop``
    are what ``web.Server`` builds its handler from). tests/test_http.py sends such requests: an aiohttp that
    changes these fails there.
    """

    def __init__(self, app: web.Application, *, refuse: Refuse, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.refuse = refuse

    async def _make_server(self) -> web.Server:
        return _Server(await super()._make_server(), self.refuse)


class HttpFace:
    """The aiohttp application and its site; :meth:`start` binds, :meth:`stop` closes."""

    def __init__(self, *, service: ServiceDescriptor, servicer: Any, interceptor: RequestInterceptor,
                 ready: Callable[[], tuple[bool, str]], cors: str = "") -> None:
        self.ready = ready  # (ready, why not)
        self.interceptor = interceptor
        self.allowed_origins = cors_origins(cors)
        self.app = web.Application(middlewares=[self._cors, self._errors], client_max_size=MAX_BODY_BYTES)
        self.routes = http_routes(service)
        for route in self.routes:
            method, handler = f"/{service.full_name}/{route.method.name}", getattr(servicer, route.method.name)
            endpoint = (self._events_endpoint(route, interceptor.http_stream_behavior(method, handler))
                        if route.streaming else self._endpoint(route, interceptor.http_behavior(method, handler)))
            self.app.router.add_route(route.verb, route.path, endpoint)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/readyz", self._readyz)
        self.app.router.add_get("/", self._page)
        self.app.router.add_get("/static/{name}", self._asset)
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, address: str, *, reuse_port: bool = False) -> int:
        """Listen on ``address`` (host:port, port 0 picks one; ``reuse_port``: shared with the server's other
        front-ends); returns the port."""
        host, port = split_host_port(address)
        # handler_cancellation: a client that disconnects cancels its handler, and with it the call's work
        self.runner = _Runner(self.app, refuse=self._refuse, handler_cancellation=True, access_log=None,
                              shutdown_timeout=STOP_SECONDS)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_port=reuse_port or None)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ---- the RPC routes --------------------------------------------------------------------------------

    def _endpoint(self, route: Route, behavior: Callable[[Any, Any], Any]) -> Callable[[web.Request], Any]:
        request_class = message_factory.GetMessageClass(route.method.input_type)

        async def endpoint(request: web.Request) -> web.Response:
            message, context, timeout = await self._read(request, request_class, route.body)
            try:
                response = await asyncio.wait_for(behavior(message, context), timeout)
            except grpc.aio.AbortError:
                code, details = context.code() or grpc.StatusCode.UNKNOWN, context.details() or ""
                return error_response(code, details, context.headers())
            except TimeoutError:
                return error_response(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", context.headers())
            return json_response(response, headers=context.headers())

        return endpoint

    def _events_endpoint(self, route: Route, behavior: Callable[[Any, Any], Any]) -> Callable[[web.Request], Any]:
        """A server-streaming RPC as server-sent events (``text/event-stream``): each message one ``data:``
        event in the proto3 JSON mapping. A call that fails before its first message answers as a unary one
        (the Status JSON and its HTTP status); after it, the stream ends with an ``event: error`` whose data
        is that Status JSON."""
        request_class = message_factory.GetMessageClass(route.method.input_type)

        async def endpoint(request: web.Request) -> web.StreamResponse:
            message, context, timeout = await self._read(request, request_class, route.body)
            events: web.StreamResponse | None = None
            failure: tuple[grpc.StatusCode, str] | None = None
            try:
                async with asyncio.timeout(timeout), contextlib.aclosing(behavior(message, context)) as items:
                    async for item in items:  # a client gone or the deadline closes the responses at once
                        if events is None:
                            events = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                                 "Cache-Control": "no-cache", **context.headers()})
                            await events.prepare(request)
                        await events.write(b"data: " + _json(item).encode() + b"\n\n")
            except grpc.aio.AbortError:
                failure = context.code() or grpc.StatusCode.UNKNOWN, context.details() or ""
            except TimeoutError:
                failure = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
            if events is None:
                code, details = failure or (grpc.StatusCode.INTERNAL, "the call sent no message")
                return error_response(code, details, context.headers())
            if failure is not None:
                status = status_pb2.Status(code=failure[0].value[0], message=failure[1])
                await events.write(b"event: error\ndata: " + _json(status).encode() + b"\n\n")
            await events.write_eof()
            return events

        return endpoint

    async def _read(self, request: web.Request, request_class: type, body: str) -> tuple[Any, HttpContext,
                                                                                       float | None]:
        """The call's request message (or the :class:`BadHttpRequest` the RPC answers with INVALID_ARGUMENT),
        its context and its deadline in seconds (``grpc-timeout``; None: none)."""
        timeout = None
        message: Any
        try:
            if TIMEOUT_HEADER in request.headers:
                timeout = parse_timeout(request.headers[TIMEOUT_HEADER])
            message = await self._parse(request, request_class, body)
        except InvalidArgument as error:
            message = BadHttpRequest(request.content_length or 0, str(error))
        return message, HttpContext(request.headers, timeout), timeout

    @staticmethod
    async def _parse(request: web.Request, request_class: type, body: str) -> Any:
        """The request message: the JSON body (``body: "*"``; an unknown field is refused) or the query string
        (parameters that are no field, e.g. a cache buster, are ignored); InvalidArgument if neither parses."""
        message = request_class()
        try:
            if body == "*":
                text = await request.text()
                if text.strip():
                    json_format.Parse(text, message)
            elif request.query:
                json_format.ParseDict(dict(request.query), message, ignore_unknown_fields=True)
            if request.match_info:  # path variables ({glossary_id}): fields of the message, over the body's
                json_format.ParseDict(dict(request.match_info), message)
        except web.HTTPRequestEntityTooLarge as error:
            raise InvalidArgument(f"the request body is over the limit of {MAX_BODY_BYTES} bytes") from error
        except (json_format.ParseError, UnicodeDecodeError) as error:
            raise InvalidArgument(f"the request body is not a {request_class.DESCRIPTOR.full_name} in the proto3 "
                                  f"JSON mapping: {error}") from error
        return message

    # ---- the errors aiohttp answers itself ---------------------------------------------------------------

    def _refuse(self, request: web.BaseRequest, status: int, message: str) -> web.Response:
        """An error aiohttp answered with ``status``: the Status JSON of its gRPC code (:func:`code_of_http`),
        with that status, counted and logged by the interceptor."""
        code = code_of_http(status)
        context = HttpContext(request.headers, None)
        self.interceptor.http_refused(context, code, message)
        return error_response(code, message, context.headers(), status=status)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """The errors aiohttp's router raises (an unknown path, a wrong verb) and a missing file of the page, as
        Status JSON."""
        try:
            return await handler(request)
        except web.HTTPError as error:
            response = self._refuse(request, error.status, f"{request.method} {request.path}: {error.reason}")
            if "Allow" in error.headers:  # a wrong verb: the ones the path takes
                response.headers["Allow"] = error.headers["Allow"]
            return response

    # ---- health, the page, CORS ------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, reason = self.ready()
        return web.json_response({"status": "ready" if ready else "not ready", "reason": reason},
                                 status=200 if ready else 503)

    async def _page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def _asset(self, request: web.Request) -> web.FileResponse:
        """A file of the page; a missing one is raised for :meth:`_errors` (aiohttp's static route answers it with
        an empty body)."""
        path = STATIC_DIR / request.match_info["name"]
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    def _allowed(self, origin: str | None) -> bool:
        return bool(origin) and ("*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins)

    @web.middleware
    async def _cors(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """CORS for the configured origins only: preflights answered here, the allow headers on every answer."""
        origin = request.headers.get("Origin")
        if not self._allowed(origin):
            return await handler(request)
        allow = {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                 "Access-Control-Expose-Headers": REQUEST_ID_KEY}
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={**allow, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                                                     "Access-Control-Allow-Headers": CORS_HEADERS,
                                                     "Access-Control-Max-Age": "600"})
        response = await handler(request)  # errors too: _errors answers them
        response.headers.update(allow)
        return response
