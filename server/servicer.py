"""The ``translation.v1.Translator`` servicer: the RPC handlers.

A handler reads as from_pb -> work -> to_pb: :mod:`server.convert` turns the ``TranslateRequest`` into
a :class:`server.types.TranslateCall` and the translations into the response; :mod:`server.validation`
checks the call against the configured limits and the model's defaults; the resolved model version's
scheduler tokenizes and translates. Every handler is wrapped by :func:`server.errors.grpc_errors`, so
they simply raise typed errors.

Each request gets a request id (the ``x-request-id`` metadata when given, else a fresh one), echoed
in trailing metadata and written in the request's JSON log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from server.config import ServerConfig
from server.convert import from_pb, model_list_pb, to_pb
from server.errors import Unavailable, grpc_errors, status_of
from server.metrics import ServerMetrics
from server.repository import ModelRepository
from server.scheduler import RequestHandle
from server.validation import check_texts, resolve_options

log = logging.getLogger("nmt.server")

REQUEST_ID_KEY = "x-request-id"
STREAM_WINDOW = 32  # requests of one stream translated concurrently


# ---- the servicer ----------------------------------------------------------------------------------


@dataclass
class _Record:
    """What one request's log line and metrics say."""

    method: str
    request_id: str
    model: str = ""
    version: str = ""
    texts: int = 0
    start: float = field(default_factory=time.perf_counter)


def _deadline_passed(context: Any) -> bool:
    remaining = context.time_remaining() if context is not None else None
    return remaining is not None and remaining <= 0


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return str(value)[:128]
    return uuid.uuid4().hex


class TranslatorService:
    """``Translate``, ``TranslateStream`` and ``ListModels`` over the repository's model versions."""

    def __init__(self, *, repository: ModelRepository, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.repository = repository
        self.config = config
        self.metrics = metrics
        self.draining = False
        self._draining = asyncio.Event()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- shutdown support --------------------------------------------------------------------------

    def start_draining(self) -> None:
        """From now on new requests get UNAVAILABLE; in-flight ones carry on."""
        self.draining = True
        self._draining.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no RPC is in flight (True) or ``timeout`` passes (False)."""
        if self._inflight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()
        self.metrics.inflight.inc()

    def _exit(self) -> None:
        self._inflight -= 1
        self.metrics.inflight.dec()
        if self._inflight == 0:
            self._idle.set()

    def _begin(self, context: grpc.aio.ServicerContext) -> str:
        request_id = request_id_of(context)
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
        return request_id

    def _finish(self, record: _Record, error: BaseException | None, context: Any = None) -> None:
        seconds = time.perf_counter() - record.start
        if error is None:
            code = "OK"
        elif isinstance(error, asyncio.CancelledError) and _deadline_passed(context):
            code = "DEADLINE_EXCEEDED"  # gRPC cancels a handler whose deadline passed
        else:
            code = status_of(error)[0].name
        self.metrics.requests.labels(record.model, record.method, code).inc()
        if record.method != "ListModels":
            self.metrics.request_duration.labels(record.model, record.method).observe(seconds)
        fields = {"request_id": record.request_id, "method": record.method, "model": record.model,
                  "version": record.version, "texts": record.texts, "code": code,
                  "seconds": round(seconds, 6)}
        if error is not None and not isinstance(error, asyncio.CancelledError):
            fields["error"] = status_of(error)[1]
        log.info("request", extra={"fields": fields})

    # ---- RPCs ------------------------------------------------------------------------------------------

    @grpc_errors
    async def Translate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        request_id = self._begin(context)
        self._enter()
        try:
            return await self._translate_one(request, context, _Record("Translate", request_id))
        finally:
            self._exit()

    @grpc_errors
    async def TranslateStream(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Requests are translated concurrently (at most ``STREAM_WINDOW`` ahead); responses go out in order."""
        request_id = self._begin(context)
        self._enter()
        window = asyncio.Semaphore(STREAM_WINDOW)
        tasks: asyncio.Queue[asyncio.Task | None] = asyncio.Queue()

        async def read() -> None:
            try:
                index = 0
                async for request in request_iterator:
                    await window.acquire()
                    record = _Record("TranslateStream", f"{request_id}/{index}")
                    tasks.put_nowait(asyncio.create_task(self._translate_one(request, context, record)))
                    index += 1
            finally:
                tasks.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (task := await self._next_stream_task(tasks)) is not None:
                response = await task
                window.release()
                yield response
            await reader  # a failure reading the requests surfaces here
        finally:
            reader.cancel()
            while not tasks.empty():
                task = tasks.get_nowait()
                if task is not None:
                    task.cancel()
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieve the outcome
            self._exit()

    async def _next_stream_task(self, tasks: asyncio.Queue) -> asyncio.Task | None:
        """The stream's next request; while draining, a stream idle between requests is closed (UNAVAILABLE)."""
        while True:
            if self.draining and tasks.empty():
                raise Unavailable("server is shutting down; reopen the stream on another replica")
            getter = asyncio.ensure_future(tasks.get())
            drain = asyncio.ensure_future(self._draining.wait())
            done, _ = await asyncio.wait({getter, drain}, return_when=asyncio.FIRST_COMPLETED)
            drain.cancel()
            if getter in done:
                return getter.result()
            getter.cancel()

    @grpc_errors
    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        record = _Record("ListModels", self._begin(context))
        response = model_list_pb(self.repository, max_beam=self.config.max_beam)
        self._finish(record, None)
        return response

    # ---- one translation request -----------------------------------------------------------------------

    async def _translate_one(self, request: Any, context: grpc.aio.ServicerContext, record: _Record) -> Any:
        error: BaseException | None = None
        try:
            if self.draining:
                raise Unavailable("server is shutting down; retry on another replica")
            call = from_pb(request)
            record.texts = len(call.texts)
            check_texts(call.texts, self.config)
            model = self.repository.resolve(call.model, call.model_version)
            record.model, record.version = model.name, model.version
            options = resolve_options(call.options, model.defaults, self.config)
            handle = RequestHandle.with_timeout(context.time_remaining())
            translations = await model.scheduler.translate(call.texts, options, handle)
            return to_pb(translations, model, call.options)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(record, error, context)
