"""What the compatible APIs share: calling the servicer through the interceptor, their errors, and reading
a request's parameters from JSON or a form."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import grpc
from aiohttp import web

from server.errors import InvalidArgument
from server.frontend.http_face import MAX_BODY_BYTES, TIMEOUT_HEADER, HttpContext, parse_timeout
from server.frontend.interceptor import RequestInterceptor
from server.protos import SERVICE_NAME

# a native call's status -> the HTTP status both APIs answer it with (the rest: 500)
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 403,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


class CompatError(Exception):
    """A request the API refuses before any call: its HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Failed:
    """A native call that ended with a gRPC status other than OK."""

    code: grpc.StatusCode
    message: str

    @property
    def status(self) -> int:
        """The HTTP status the compatible APIs answer it with (:data:`STATUS`)."""
        return STATUS.get(self.code, 500)


def deadline(request: web.Request) -> float | None:
    """The seconds of a ``grpc-timeout`` header (None: none); a malformed one is a 400."""
    try:
        return parse_timeout(request.headers[TIMEOUT_HEADER]) if TIMEOUT_HEADER in request.headers else None
    except InvalidArgument as error:
        raise CompatError(400, str(error)) from None


class Caller:
    """The servicer's methods wrapped by the interceptor, one per (method, label)."""

    def __init__(self, servicer: Any, interceptor: RequestInterceptor) -> None:
        self.servicer = servicer
        self.interceptor = interceptor
        self._behaviors: dict[tuple[str, str], Callable[[Any, Any], Any]] = {}

    async def call(self, method: str, message: Any, label: str, headers: Mapping[str, str],
                   timeout: float | None = None) -> tuple[Any, HttpContext]:
        """The response of ``method`` to ``message`` (or :class:`Failed`), and the call's context."""
        behavior = self._behaviors.get((method, label))
        if behavior is None:
            behavior = self._behaviors[(method, label)] = self.interceptor.http_behavior(
                f"/{SERVICE_NAME}/{method}", getattr(self.servicer, method), label=label)
        context = HttpContext(headers, timeout)
        try:
            return await behavior(message, context), context
        except grpc.aio.AbortError:
            return Failed(context.code() or grpc.StatusCode.UNKNOWN, context.details() or ""), context


async def form_or_json(request: web.Request) -> dict[str, Any]:
    """The parameters of a request: its JSON object body, or its form (urlencoded or multipart) and query
    string; a parameter given several times is a list."""
    params: dict[str, list[Any]] = {}
    for key, value in request.query.items():
        params.setdefault(key, []).append(value)
    try:
        if request.content_type == "application/json":
            try:
                document = json.loads(await request.read() or b"{}")
            except (ValueError, UnicodeDecodeError) as error:
                raise CompatError(400, f"the body is not JSON: {error}") from error
            if not isinstance(document, dict):
                raise CompatError(400, "the JSON body must be an object")
            return {**{k: v if len(v) > 1 else v[0] for k, v in params.items()}, **document}
        if request.method == "GET":  # a form in a GET's body, as libretranslatepy sends its api_key
            body = (await request.read()).decode() if request.can_read_body else ""
            form: Any = parse_qsl(body, keep_blank_values=True)
        else:
            form = (await request.post()).items()  # urlencoded or multipart
        for key, value in form:
            params.setdefault(key, []).append(value if isinstance(value, str) else value.file.read().decode())
    except web.HTTPRequestEntityTooLarge as error:
        raise CompatError(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes") from error
    except UnicodeDecodeError as error:
        raise CompatError(400, "the form is not UTF-8") from error
    return {k: v if len(v) > 1 else v[0] for k, v in params.items()}


@functools.cache
def language_name(code: str) -> str:
    """The English name of a language code (Babel's CLDR data), or the code itself."""
    from babel import Locale, UnknownLocaleError

    try:
        return Locale.parse(code.replace("-", "_")).english_name or code
    except (UnknownLocaleError, ValueError, TypeError):
        return code
