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
(``/``, static files of ``server/static`` shipped as package data).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from google.api import annotations_pb2
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.rpc import status_pb2

from server.config import split_host_port
from server.errors import InvalidArgument
from server.interceptor import REQUEST_ID_KEY, RequestInterceptor, Undecodable

STATIC_DIR = Path(__file__).resolve().parent / "static"
TIMEOUT_HEADER = "grpc-timeout"
CORS_HEADERS = "authorization, content-type, grpc-timeout, x-request-id"
STOP_SECONDS = 1.0  # how long open HTTP connections get once the server stops

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
_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


@dataclass(frozen=True)
class Route:
    """One ``google.api.http`` rule: ``verb path`` -> the unary RPC ``method``."""

    verb: str  # "GET", "POST", ...
    path: str
    method: MethodDescriptor
    body: str  # "*": the whole JSON body is the request; "": the query string is


def http_routes(service: ServiceDescriptor) -> list[Route]:
    """The routes the proto declares for ``service``'s unary methods (streaming methods have none)."""
    routes = []
    for method in service.methods:
        rule = method.GetOptions().Extensions[annotations_pb2.http]
        verb = rule.WhichOneof("pattern")
        if verb is None or verb == "custom" or method.client_streaming or method.server_streaming:
            continue
        path = getattr(rule, verb)
        if "{" in path:
            raise ValueError(f"{method.full_name}: path variables are not supported ({path})")
        routes.append(Route(verb.upper(), path, method, rule.body))
    return routes


def parse_timeout(value: str) -> float:
    """A ``grpc-timeout`` header value (``100m``, ``5S``, ...) in seconds; InvalidArgument when malformed."""
    match = _TIMEOUT.fullmatch(value.strip())
    if match is None:
        raise InvalidArgument(f"{TIMEOUT_HEADER} header {value!r} is not a gRPC timeout: 1 to 8 digits and a unit "
                              "H, M, S, m (ms), u (µs) or n (ns), e.g. 500m or 2S")
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


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


def json_response(message: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """``message`` in the proto3 JSON mapping, every field printed (as grpc-gateway's default marshaler)."""
    body = json.dumps(json_format.MessageToDict(message, always_print_fields_with_no_presence=True),
                      separators=(",", ":"))
    return web.Response(text=body, status=status, content_type="application/json", headers=headers)


def error_response(code: grpc.StatusCode, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """A failed call: its HTTP status and the ``google.rpc.Status`` JSON ``{code, message, details}``."""
    status = status_pb2.Status(code=code.value[0], message=message)
    return json_response(status, status=HTTP_STATUS.get(code, 500), headers=headers)


def cors_origins(setting: str) -> frozenset[str]:
    """``--cors-origins``: comma-separated origins, or ``*``."""
    return frozenset(origin.strip().rstrip("/") for origin in setting.split(",") if origin.strip())


class HttpFace:
    """The aiohttp application and its site; :meth:`start` binds, :meth:`stop` closes."""

    def __init__(self, *, service: ServiceDescriptor, servicer: Any, interceptor: RequestInterceptor,
                 ready: Callable[[], tuple[bool, str]], cors: str = "") -> None:
        self.ready = ready  # (ready, why not)
        self.allowed_origins = cors_origins(cors)
        self.app = web.Application(middlewares=[self._cors], client_max_size=8 * 1024 * 1024)
        self.routes = http_routes(service)
        for route in self.routes:
            behavior = interceptor.http_behavior(f"/{service.full_name}/{route.method.name}",
                                                 getattr(servicer, route.method.name))
            self.app.router.add_route(route.verb, route.path, self._endpoint(route, behavior))
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/readyz", self._readyz)
        self.app.router.add_get("/", self._page)
        self.app.router.add_static("/static/", STATIC_DIR)
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, address: str) -> int:
        """Listen on ``address`` (host:port, port 0 picks one); returns the port."""
        host, port = split_host_port(address)
        # handler_cancellation: a client that disconnects cancels its handler, and with it the call's work
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=STOP_SECONDS)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
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
            timeout = None
            message: Any
            try:
                if TIMEOUT_HEADER in request.headers:
                    timeout = parse_timeout(request.headers[TIMEOUT_HEADER])
                message = await self._parse(request, request_class, route.body)
            except InvalidArgument as error:
                message = BadHttpRequest(request.content_length or 0, str(error))
            context = HttpContext(request.headers, timeout)
            try:
                response = await asyncio.wait_for(behavior(message, context), timeout)
            except grpc.aio.AbortError:
                code, details = context.code() or grpc.StatusCode.UNKNOWN, context.details() or ""
                return error_response(code, details, context.headers())
            except TimeoutError:
                return error_response(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", context.headers())
            return json_response(response, headers=context.headers())

        return endpoint

    @staticmethod
    async def _parse(request: web.Request, request_class: type, body: str) -> Any:
        """The request message: the JSON body (``body: "*"``) or the query string; InvalidArgument if neither parses."""
        message = request_class()
        try:
            if body == "*":
                text = await request.text()
                if text.strip():
                    json_format.Parse(text, message)
            elif request.query:
                json_format.ParseDict(dict(request.query), message)
        except (json_format.ParseError, UnicodeDecodeError) as error:
            raise InvalidArgument(f"the request body is not a {request_class.DESCRIPTOR.full_name} in the proto3 "
                                  f"JSON mapping: {error}") from error
        return message

    # ---- health, the page, CORS ------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, reason = self.ready()
        return web.json_response({"status": "ready" if ready else "not ready", "reason": reason},
                                 status=200 if ready else 503)

    async def _page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

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
        try:
            response = await handler(request)
        except web.HTTPException as error:
            error.headers.update(allow)
            raise
        response.headers.update(allow)
        return response
