"""The ``translation.v1.Translator`` servicer: the RPC handlers, and nothing else.

A handler reads as from_pb -> work -> to_pb: :mod:`server.frontend.convert` turns the ``TranslateRequest`` into
a :class:`server.types.TranslateCall` and the translations into the response; :mod:`server.frontend.validation`
checks the call against the configured limits and the model's defaults;
:func:`server.frontend.translate.translate_texts` tokenizes, decodes through the resolved model version's
scheduler (in this process or in the engine core) and detokenizes. The handler holds the version
(:meth:`ModelRepository.acquire`) until the response is built, so hot reload never closes a version
under a request. Every handler is wrapped by :func:`server.errors.grpc_errors`, so they simply raise
typed errors.

Request ids, log lines, request metrics and the in-flight count are the interceptor's
(:mod:`server.frontend.interceptor`); a handler only writes the model version it resolved and the number of
texts on the call's record (:func:`server.frontend.interceptor.current_call`), and checks the models it uses
against the record's grant (:mod:`server.frontend.auth`: PERMISSION_DENIED for a model the token may not use).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import grpc

from common.model_format.decoding import normalized_score
from server.config import ServerConfig
from server.errors import FailedPrecondition, InvalidArgument, ServingError, Unavailable, grpc_errors, status_of
from server.frontend.cache import TranslationCache
from server.frontend.convert import (
    TEXT_FORMATS,
    deleted_glossary_pb,
    detection_pb,
    entries_from_pb,
    error_response_pb,
    from_pb,
    glossary_list_pb,
    glossary_pb,
    language_list_pb,
    model_list_pb,
    score_from_pb,
    to_pb,
)
from server.frontend.detection import Detection, LanguageDetector, detect_texts, model_text
from server.frontend.documents.markup import local_name
from server.frontend.documents.model import Tags, TextFormat
from server.frontend.documents.segmenter import Splitting
from server.frontend.documents.streaming import DocumentStream
from server.frontend.documents.translate import Reading, translate_documents
from server.frontend.glossary import MAX_REQUEST_ENTRIES, Glossary, TermCodec, check_entries
from server.frontend.glossary_store import GlossaryStore
from server.frontend.interceptor import Undecodable, current_call
from server.frontend.translate import TOKENIZE_INLINE_CHARS, translate_texts
from server.frontend.validation import check_texts, resolve_options, target_prefixes
from server.metrics import ServerMetrics
from server.policy import BatchPolicy, RequestHandle
from server.routing import AUTO, Router, primary
from server.text import TextCodec
from server.types import DecodingOptions, GlossaryEntry, TranslateCall, Translation
from server.versions import VersionIndex

log = logging.getLogger("nmt.server")

STREAM_WINDOW = 32  # requests of one stream translated concurrently
MAX_NAMED_ELEMENTS, MAX_ELEMENT_NAME = 64, 64  # a request's untranslated_elements and block_elements


class TranslatorService:
    """``Translate``, ``TranslateStream``, ``TranslateStreaming``, ``ListModels``, ``Score`` and the rest over
    the repository's model versions, and the glossary RPCs over the glossary store."""

    def __init__(self, *, repository: VersionIndex, config: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        self.repository = repository
        self.config = config
        self.metrics = metrics  # TranslateStreaming's word timings
        self.policy = BatchPolicy.from_config(config)  # the token, work and response limits of a request
        self.router = Router(repository, default_model=lambda: repository.default_model,
                             pair_models=config.pair_models)
        self.detector = LanguageDetector()
        self.cache = TranslationCache.from_config(config, metrics)
        self.glossaries = GlossaryStore(config.glossary_dir) if config.glossary_dir else None
        self.draining = False
        self._draining = asyncio.Event()

    async def close(self) -> None:
        """Release what the service holds beyond its requests (the shared cache's connections)."""
        if self.cache is not None:
            await self.cache.close()

    def start_draining(self) -> None:
        """From now on new requests get UNAVAILABLE, and streams idle between requests are closed;
        requests being translated carry on."""
        self.draining = True
        self._draining.set()

    # ---- RPCs ------------------------------------------------------------------------------------------

    @grpc_errors
    async def Translate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return await self._translate(request, context)

    @grpc_errors
    async def TranslateStream(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Requests are translated concurrently (at most ``STREAM_WINDOW`` ahead); responses go out in order.
        A request that fails gets a response carrying its error, and the stream goes on."""
        window = asyncio.Semaphore(STREAM_WINDOW)
        index = itertools.count()
        tasks: asyncio.Queue[asyncio.Task | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await window.acquire()
                    tasks.put_nowait(asyncio.create_task(self._stream_item(request, context, next(index))))
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

    @grpc_errors
    async def TranslateStreaming(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """One text as the search decides it (:mod:`server.frontend.streaming`); a client that goes away
        cancels the translation, whose rows leave the decode at its next step."""
        stream = DocumentStream()
        translate = asyncio.ensure_future(self._run(request, from_pb, context, stream=stream))
        start, last = time.monotonic(), None
        try:
            async for delta in stream.deltas(translate):
                if delta.text and self.metrics is not None:
                    now, model = time.monotonic(), current_call().model
                    if last is None:
                        self.metrics.stream_first_word.labels(model).observe(now - start)
                    else:
                        self.metrics.stream_word_gap.labels(model).observe(now - last)
                    last = now
                yield delta
        finally:
            translate.cancel()
            translate.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieve the outcome

    async def _stream_item(self, request: Any, context: grpc.aio.ServicerContext, index: int) -> Any:
        """One stream request's response: its translations, or its error (logged) when it failed."""
        try:
            return await self._translate(request, context)
        except Exception as error:  # noqa: BLE001 - one request's failure must not end the stream
            code, message = status_of(error)
            fields = {"request_id": current_call().request_id, "index": index, "code": code.name, "error": message}
            if isinstance(error, ServingError):
                log.info("stream request failed", extra={"fields": fields})
            else:
                log.error("stream request failed", exc_info=error, extra={"fields": fields})
            return error_response_pb(code, message)

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
        """The loaded versions of the models the call's token may use (all without authentication)."""
        return model_list_pb(self.repository, max_beam=self.config.max_beam, allows=current_call().grant.allows)

    @grpc_errors
    async def ListLanguages(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """The language pairs served by the models the call's token may use, each with its model."""
        return language_list_pb(self.router.routes(current_call().grant.allows))

    @grpc_errors
    async def DetectLanguage(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """Each text's candidate source languages with their confidence (:mod:`server.frontend.detection`)."""
        texts = list(request.texts)
        current_call().texts += len(texts)
        check_texts(texts, self.config)
        candidates = self.router.sources_to(request.target_language, current_call().grant.allows)
        text_format = TextFormat(TEXT_FORMATS.get(request.text_format, "text"))

        def rank() -> list[list[Detection]]:
            return [self.detector.rank(model_text(text, text_format), candidates) for text in texts]

        ranked = await asyncio.to_thread(rank) if sum(map(len, texts)) > TOKENIZE_INLINE_CHARS else rank()
        return detection_pb(ranked)

    @grpc_errors
    async def Score(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """Given translations scored by forced decoding, through the same scheduler as Translate."""
        return await self._run(request, score_from_pb, context)

    @grpc_errors
    async def CreateGlossary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        current_call().grant.check_glossary_write()
        g = request.glossary
        entries = entries_from_pb(g.entries)
        if g.case_insensitive:
            entries = [replace(e, case_insensitive=True) for e in entries]
        stored = await asyncio.to_thread(self._store().create, g.glossary_id, g.source_language, g.target_language,
                                         entries, g.name)
        return glossary_pb(stored, entries=False)

    @grpc_errors
    async def ListGlossaries(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        stored = await asyncio.to_thread(self._store().list)
        return glossary_list_pb(stored)

    @grpc_errors
    async def GetGlossary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        return glossary_pb(await asyncio.to_thread(self._store().get, request.glossary_id), entries=True)

    @grpc_errors
    async def DeleteGlossary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        current_call().grant.check_glossary_write()
        await asyncio.to_thread(self._store().delete, request.glossary_id)
        return deleted_glossary_pb()

    def _store(self) -> GlossaryStore:
        if self.glossaries is None:
            raise FailedPrecondition("this server keeps no glossaries: start it with --glossary-dir (inline "
                                     "glossaries need none)")
        return self.glossaries

    # ---- one translation request -----------------------------------------------------------------------

    async def _translate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """One ``TranslateRequest`` -> its ``TranslateResponse``."""
        return await self._run(request, from_pb, context)

    async def _run(self, request: Any, parse: Callable[[Any], TranslateCall], context: grpc.aio.ServicerContext,
                   stream: DocumentStream | None = None) -> Any:
        """One request, read by ``parse`` -> its ``TranslateResponse``; with ``stream``, its one text's stable
        prefix is reported there as the search goes."""
        if self.draining:
            raise Unavailable("server is shutting down; retry on another replica")
        if isinstance(request, Undecodable):
            raise request.error()
        call = parse(request)
        record = current_call()
        record.texts += len(call.texts)
        if call.model:  # checked before resolving, so a restricted token cannot probe which models exist
            record.grant.check(call.model)
        check_texts(call.texts, self.config)
        if stream is not None and len(call.texts) != 1:
            raise InvalidArgument(f"TranslateStreaming translates exactly one text per request, not {len(call.texts)}")
        call, detections = await self._route(call, record.grant.allows)
        with self.repository.acquire(call.model, call.model_version) as model:  # held until translated
            record.grant.check(model.name)  # the default model, when the request names none
            source = str(model.manifest_value("source_language"))
            many = bool(model.manifest_value("source_languages", []))  # its codec checks the source's code
            if call.source_language and not many and primary(call.source_language) != primary(source):
                raise InvalidArgument(f"model {model.name!r} translates from {source!r}, not "
                                      f"{call.source_language!r}; leave model empty to choose by language pair")
            record.model, record.version = model.name, model.version
            codec = model.codec
            options = resolve_options(call.options, model.defaults, self.config, max_positions=model.max_positions,
                                      target_ids=codec.tokenizer.encode_target, unk_id=codec.tokenizer.unk_id)
            languages = codec.language_tokens(call.source_language if many else "", call.target_language)
            forced = target_prefixes(call.texts, call.target_prefixes,
                                     lambda text, whole: codec.target_prefix(text, whole=whole),  # if any
                                     options.max_length, end_id=codec.eos_id if call.score else None)
            terms = await self._terms(call, model, codec, options)
            handle = RequestHandle.with_timeout(context.time_remaining(), record.request_id)
            submit = model.submit if self.cache is None else self.cache.through(model, model.submit)
            if stream is not None:
                stream.bind(codec, scores=call.options.return_scores, attention=options.return_attention)
            reading = self._reading(call, codec.manifest.source_language, stream is not None)
            if reading is not None:
                translations = await translate_documents(
                    codec, submit, call.texts, options, handle, reading=reading, policy=self.policy,
                    languages=languages, stream=stream, terms=terms,
                    max_sentences=min(self.config.max_sentences, self.config.queue_size))
                if self.metrics is not None:
                    self.metrics.observe_texts(model.name, reading.format.value,
                                               [len(t.segments) for t in translations])
            else:
                translations = await translate_texts(codec, submit, call.texts, options, handle,
                                                     policy=self.policy, languages=languages,
                                                     target_prefixes=forced, stream=stream, terms=terms)
            if terms is not None and self.metrics is not None:
                constrained = [s.translation for t in translations for s in t.segments] or translations
                self.metrics.observe_terms(model.name, sum(1 for t in constrained if t.terms),
                                           sum(len(t.terms) for t in constrained))
            if call.score:  # the search scores only the tokens it chose; here all are given
                translations = [scored_whole(t, options.length_penalty) for t in translations]
            if detections:
                translations = [replace(t, detected_language=d.language, detected_confidence=d.confidence)
                                for t, d in zip(translations, detections, strict=True)]
            return to_pb(translations, model, call.options)

    async def _route(self, call: TranslateCall, allows: Callable[[str], bool]) -> tuple[TranslateCall,
                                                                                         list[Detection]]:
        """The call with its model chosen by language pair where it names none (:mod:`server.routing`), its
        source language detected where it is "auto" (:mod:`server.frontend.detection`), and the detections."""
        detections: list[Detection] = []
        source = call.source_language
        if source.lower() == AUTO:
            if call.model:
                candidates = [str(self.repository.resolve(call.model, call.model_version)
                                  .manifest_value("source_language"))]
            else:
                candidates = self.router.sources_to(call.target_language, allows)
            detect = functools.partial(detect_texts, self.detector, call.texts, TextFormat(call.text_format or "text"),
                                       candidates, self.config.detect_default)
            detections = (await asyncio.to_thread(detect) if sum(map(len, call.texts)) > TOKENIZE_INLINE_CHARS
                          else detect())
            source = detections[0].language
        if call.model or not (source or call.target_language):
            return replace(call, source_language=source), detections
        route = self.router.route(source, call.target_language, allows)
        return replace(call, model=route.model, source_language=route.source,
                       target_language=route.target_code[route.model]), detections


    async def _terms(self, call: TranslateCall, model: Any, codec: TextCodec,
                     options: DecodingOptions) -> TermCodec | None:
        """The call's glossary bound to the model's target vocabulary (None: it has none): its inline entries
        and do-not-translate terms before the stored glossary's entries for the same source terms."""
        if not (call.glossary or call.glossary_id or call.do_not_translate):
            return None
        if len(call.glossary) + len(call.do_not_translate) > MAX_REQUEST_ENTRIES:
            raise InvalidArgument(f"{len(call.glossary) + len(call.do_not_translate)} glossary entries and "
                                  f"do-not-translate terms, the limit is {MAX_REQUEST_ENTRIES} per request; store a "
                                  "larger glossary (CreateGlossary) and name it in glossary_id")
        if options.controls.samples or options.return_alternatives:
            raise InvalidArgument("a glossary constrains the beam search: it excludes sampling (sampling_topk > 1 or "
                                  "sampling_topp < 1) and return_alternatives")
        inline = check_entries(call.glossary, "glossary") + check_entries(
            [GlossaryEntry(term, term) for term in call.do_not_translate], "do_not_translate")
        inline = check_entries(inline, "glossary and do_not_translate")
        glossary = Glossary(inline) if inline else None
        if call.glossary_id:
            stored = await asyncio.to_thread(self._store().get, call.glossary_id)
            source = str(model.manifest_value("source_language"))
            target = call.target_language or str(model.manifest_value("target_language"))
            if (primary(stored.source_language), primary(stored.target_language)) != (primary(source),
                                                                                      primary(target)):
                raise InvalidArgument(f"glossary {stored.glossary_id!r} is for {stored.source_language}->"
                                      f"{stored.target_language}; model {model.name!r} translates {source}->{target}")
            if inline:
                mine = {(e.source.casefold() if e.case_insensitive else e.source) for e in inline}
                glossary = Glossary(inline + [e for e in stored.entries
                                              if (e.source.casefold() if e.case_insensitive else e.source) not in mine])
            else:
                glossary = stored.glossary
        assert glossary is not None
        return TermCodec(glossary, codec.tokenizer.encode_target, codec.tokenizer.unk_id, self.config.max_beam)

    def _reading(self, call: TranslateCall, language: str, streaming: bool) -> Reading | None:
        """How the call's texts are read (:mod:`server.frontend.documents`), or None for one model input per
        text: a Score, and a call with target prefixes or alternatives, which apply to one sentence.
        ``streaming`` (TranslateStreaming) reads plain text only."""
        text_format = TextFormat(call.text_format or "text")
        one_sentence = ("target_prefixes" if any(call.target_prefixes) else
                        "return_alternatives" if call.options.return_alternatives else "")
        if call.score:
            return None
        if one_sentence:
            if call.splitting not in ("", Splitting.OFF.value) or text_format is not TextFormat.PLAIN:
                raise InvalidArgument(f"{one_sentence} applies to one sentence of plain text: send it without "
                                      "text_format and sentence_splitting (or with SPLIT_OFF)")
            return None
        if streaming and text_format is not TextFormat.PLAIN:
            raise InvalidArgument("TranslateStreaming streams plain text; send HTML and XML to Translate")
        splitting = Splitting(call.splitting or Splitting.SENTENCES.value)
        named = call.untranslated_elements + call.block_elements
        if named and text_format is TextFormat.PLAIN:
            raise InvalidArgument("untranslated_elements and block_elements apply to HTML and XML (text_format)")
        if any(not name.strip() or len(name) > MAX_ELEMENT_NAME for name in named) or len(named) > MAX_NAMED_ELEMENTS:
            raise InvalidArgument(f"untranslated_elements and block_elements: at most {MAX_NAMED_ELEMENTS} names of "
                                  f"1-{MAX_ELEMENT_NAME} characters")
        tags = Tags(frozenset(local_name(n) for n in call.untranslated_elements),
                    frozenset(local_name(n) for n in call.block_elements))
        return Reading(text_format, splitting, language, self.policy.max_tokens, tags)


def scored_whole(translation: Translation, length_penalty: float) -> Translation:
    """A Score result: its hypothesis' ``score`` is the whole given target's log-probability (end of
    sentence included) over length^length_penalty, as CTranslate2's score_batch sums its tokens_score."""
    hypotheses = [replace(h, score=normalized_score(sum(h.token_scores), len(h.token_scores), length_penalty))
                  for h in translation.hypotheses]
    return replace(translation, hypotheses=hypotheses)
