"""Typed serving errors and the one place that maps them to gRPC status codes.

Handlers, request validation, the model repository and the scheduler raise the exceptions below
(they never touch a gRPC context); :func:`grpc_errors` decorates every servicer method and turns them
into a status with the exception's message (the interceptor's authentication step uses :func:`abort`,
the same mapping, and the HTTP face :func:`report` for an exception no handler caught). Anything else
becomes INTERNAL, logged with its traceback, so an unexpected failure never leaks a stack trace to the
client nor kills the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger("nmt.server")


class ServingError(Exception):
    """A request failed for a reason the client should hear about; ``code`` is its gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ServingError):
    """Bad options, empty or oversized input."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServingError):
    """Unknown model or model version."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServingError):
    """What the call would create exists (a stored glossary's id)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServingError):
    """The server is not set up for the call (no glossary directory; a glossary file that does not parse)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServingError):
    """The model's queue is full, or the device had no memory for the batch."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeviceMemoryExhausted(ResourceExhausted):
    """The execution provider could not allocate memory for one batch (the model stays healthy)."""


class DeadlineExceeded(ServingError):
    """The deadline passed, or cannot be met by the estimate made at admission."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServingError):
    """The client cancelled the call."""

    code = grpc.StatusCode.CANCELLED


class Unavailable(ServingError):
    """The server is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ServingError):
    """No credentials, or credentials the server does not know (the message never repeats them)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServingError):
    """Valid credentials that may not do this (e.g. a token restricted to other models)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Internal(ServingError):
    """Inference failed (the batch's requests fail; the server carries on)."""

    code = grpc.StatusCode.INTERNAL


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message for ``error`` (the single mapping)."""
    if isinstance(error, ServingError):
        return error.code, str(error)
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "call cancelled"
    if isinstance(error, grpc.aio.AbortError):  # already aborted by the handler itself
        return grpc.StatusCode.UNKNOWN, "aborted"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__})"


def report(error: Exception) -> tuple[grpc.StatusCode, str]:
    """``error``'s status (:func:`status_of`), its traceback logged when it is no :class:`ServingError` (a bug)."""
    if not isinstance(error, ServingError):
        log.error("unexpected error in handler", exc_info=error)
    return status_of(error)


async def abort(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """End the call with ``error``'s status (:func:`report`); raises ``grpc.aio.AbortError``."""
    code, message = report(error)
    await context.abort(code, message, trailing_metadata=tuple(context.trailing_metadata() or ()))


def grpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an async servicer method (unary or async-generator) so typed errors become statuses.

    ``asyncio.CancelledError`` (the client went away) and ``grpc.aio.AbortError`` propagate untouched. A stream
    closed early closes the method's own generator (its clean-up runs then).
    """
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async with contextlib.aclosing(method(self, request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:  # noqa: BLE001 - the one catch-all of the server
                await abort(context, error)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - the one catch-all of the server
            await abort(context, error)

    return unary_wrapper
