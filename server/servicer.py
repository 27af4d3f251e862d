"""The ``translation.v1.Translator`` servicer: the only place protobufs meet the plain dataclasses.

``from_pb`` turns a ``TranslateRequest`` into a :class:`TranslateCall`; :func:`check_texts`,
:func:`resolve_options` and :func:`tokenize_texts` check it against the configured limits and the
model's defaults; the model's scheduler translates; ``to_pb`` builds the response. Every handler is wrapped by
:func:`server.errors.grpc_errors`, so they simply raise typed errors.

Each request gets a request id (the ``x-request-id`` metadata when given, else a fresh one), echoed
in trailing metadata and written in the request's JSON log line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from server.alignment import word_groups, words
from server.config import ServerConfig
from server.errors import InvalidArgument, Unavailable, grpc_errors, status_of
from server.metrics import ServerMetrics
from server.protos import pb2, pb2_grpc
from server.repository import ModelRepository, ModelVersion
from server.scheduler import ModelScheduler, RequestHandle
from server.types import DecodingOptions, Hypothesis, Translation

log = logging.getLogger("nmt.server")

REQUEST_ID_KEY = "x-request-id"
MAX_LENGTH_PENALTY = 10.0
STREAM_WINDOW = 32  # requests of one stream translated concurrently
TOKENIZE_INLINE_CHARS = 8192  # larger requests are tokenized on a worker thread, off the event loop


# ---- protobuf <-> dataclasses ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestedOptions:
    """Decoding options as sent (0 / 0.0 = the model's default), not yet validated."""

    beam_size: int = 0
    num_hypotheses: int = 0
    max_length: int = 0
    length_penalty: float = 0.0
    return_attention: bool = False
    return_scores: bool = False


@dataclass(frozen=True)
class TranslateCall:
    texts: list[str]
    model: str = ""
    model_version: str = ""
    options: RequestedOptions = field(default_factory=RequestedOptions)


def from_pb(request: Any) -> TranslateCall:
    """``TranslateRequest`` -> :class:`TranslateCall`."""
    o = request.options
    return TranslateCall(
        texts=list(request.texts),
        model=request.model,
        model_version=request.model_version,
        options=RequestedOptions(
            beam_size=o.beam_size, num_hypotheses=o.num_hypotheses, max_length=o.max_length,
            length_penalty=o.length_penalty, return_attention=o.return_attention, return_scores=o.return_scores,
        ),
    )


def _words(pieces: Sequence[str], text: str) -> list[str]:
    """Words of a tokenized text: ``text.split()`` when it agrees with the pieces' word boundaries
    (it keeps characters the tokenizer maps to ``<unk>``), else the pieces merged at word starts."""
    merged = words(list(pieces), word_groups(list(pieces)))
    split = text.split()
    return split if len(split) == len(merged) else merged


def source_words(translation: Translation, text: str) -> list[str]:
    """Source words of ``text`` (the attention's columns)."""
    for hypothesis in translation.hypotheses:
        if hypothesis.attention is not None:
            columns = list(hypothesis.attention.source_words)
            split = text.split()
            return split if len(split) == len(columns) else columns
    return _words(translation.source_tokens, text)


def hypothesis_to_pb(hypothesis: Hypothesis, *, return_scores: bool, return_attention: bool) -> Any:
    attention = hypothesis.attention
    if attention is not None:
        rows = list(attention.target_words)
        split = hypothesis.text.split()
        target_words = split if len(split) == len(rows) else rows
    else:
        target_words = _words(hypothesis.tokens, hypothesis.text)
    message = pb2.Hypothesis(text=hypothesis.text, tokens=target_words, subword_tokens=list(hypothesis.tokens))
    if return_scores:
        message.score = float(hypothesis.score)
        message.token_scores.extend(float(s) for s in hypothesis.token_scores)
    if return_attention and attention is not None:
        weights = attention.weights
        message.attention.target_length = int(weights.shape[0])
        message.attention.source_length = int(weights.shape[1])
        message.attention.weights.extend(weights.astype(float).ravel(order="C").tolist())
        message.attention.word_alignments.extend(
            pb2.WordAlignment(source_index=a.source_index, target_index=a.target_index) for a in attention.alignments
        )
        message.attention.pharaoh = attention.pharaoh()
    return message


def to_pb(translations: Sequence[Translation], texts: Sequence[str], model: ModelVersion,
          options: RequestedOptions) -> Any:
    """Translations of ``texts`` -> ``TranslateResponse``."""
    response = pb2.TranslateResponse(model=model.name, model_version=model.version)
    for translation, text in zip(translations, texts, strict=True):
        item = response.translations.add()
        item.source_tokens.extend(source_words(translation, text))
        item.hypotheses.extend(
            hypothesis_to_pb(h, return_scores=options.return_scores, return_attention=options.return_attention)
            for h in translation.hypotheses
        )
    return response


def model_info_pb(model: ModelVersion, *, is_default: bool, max_beam: int) -> Any:
    defaults, training = model.defaults, model.training
    bleu = training.get("test_bleu")
    return pb2.ModelInfo(
        name=model.name,
        version=model.version,
        architecture=str(model.manifest_value("architecture")),
        source_language=str(model.manifest_value("source_language")),
        target_language=str(model.manifest_value("target_language")),
        is_default=is_default,
        is_latest=model.is_latest,
        execution_provider=str(getattr(model.engine, "provider", "")),
        precision=str(model.manifest_value("precision")),
        default_beam_size=min(int(defaults.get("beam_size", 1) or 1), max_beam),
        max_beam_size=max_beam,
        test_bleu=float(bleu) if isinstance(bleu, int | float) else 0.0,
        training_corpus=str(training.get("corpus") or ""),
    )


# ---- validation ------------------------------------------------------------------------------------


def resolve_options(requested: RequestedOptions, defaults: dict[str, Any], config: ServerConfig) -> DecodingOptions:
    """Fill zeros from the model's defaults and check every option against the configured limits."""
    beam = requested.beam_size or min(int(defaults.get("beam_size", 1) or 1), config.max_beam)
    if beam > config.max_beam:
        raise InvalidArgument(f"beam_size {beam} is over the limit of {config.max_beam}")
    hypotheses = requested.num_hypotheses or 1
    if hypotheses > beam:
        raise InvalidArgument(f"num_hypotheses {hypotheses} is larger than the beam size {beam}"
                              + ("" if requested.beam_size else " (the model's default)"))
    max_length = requested.max_length or min(int(defaults.get("max_length", 256) or 256), config.max_length)
    if max_length > config.max_length:
        raise InvalidArgument(f"max_length {max_length} is over the limit of {config.max_length}")
    penalty = requested.length_penalty
    if not math.isfinite(penalty) or penalty < 0 or penalty > MAX_LENGTH_PENALTY:
        raise InvalidArgument(f"length_penalty {penalty} must be between 0 (the model's default) "
                              f"and {MAX_LENGTH_PENALTY}")
    if penalty == 0:
        penalty = float(defaults.get("length_penalty", 1.0))
    return DecodingOptions(beam_size=beam, num_hypotheses=hypotheses, max_length=max_length,
                           length_penalty=penalty, return_attention=requested.return_attention)


def check_texts(texts: Sequence[str], config: ServerConfig) -> None:
    """Count, emptiness and character limits (no model needed)."""
    if not texts:
        raise InvalidArgument("no texts: send at least one text to translate")
    if len(texts) > config.max_texts:
        raise InvalidArgument(f"too many texts: {len(texts)}, the limit is {config.max_texts} per request")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidArgument(f"texts[{i}] is empty or whitespace-only")
        if len(text) > config.max_chars:
            raise InvalidArgument(f"texts[{i}] has {len(text)} characters, the limit is {config.max_chars}")


def tokenize_texts(texts: Sequence[str], engine: Any, config: ServerConfig) -> list[list[int]]:
    ids = [engine.tokenize(text) for text in texts]
    for i, sentence in enumerate(ids):
        if len(sentence) > config.max_tokens:
            raise InvalidArgument(f"texts[{i}] has {len(sentence)} tokens, the limit is {config.max_tokens}")
        if not sentence:
            raise InvalidArgument(f"texts[{i}] has no tokens")
    return ids


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


class TranslatorService(pb2_grpc.TranslatorServicer):
    """``Translate``, ``TranslateStream`` and ``ListModels`` over the repository's schedulers."""

    def __init__(self, *, repository: ModelRepository, schedulers: dict[tuple[str, str], ModelScheduler],
                 config: ServerConfig, metrics: ServerMetrics) -> None:
        self.repository = repository
        self.schedulers = schedulers
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
        response = pb2.ListModelsResponse(models=[
            model_info_pb(mv, is_default=mv.name == self.repository.default_model, max_beam=self.config.max_beam)
            for mv in self.repository
        ])
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
            if sum(map(len, call.texts)) > TOKENIZE_INLINE_CHARS:  # keep the event loop responsive
                ids = await asyncio.to_thread(tokenize_texts, call.texts, model.engine, self.config)
            else:
                ids = tokenize_texts(call.texts, model.engine, self.config)
            handle = RequestHandle.with_timeout(context.time_remaining())
            translations = await self.schedulers[model.key].translate([(s, options) for s in ids], handle)
            return to_pb(translations, call.texts, model, call.options)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(record, error, context)
