"""``TranslateStreaming`` of a plain text read as a document: sentence after sentence, in order.

The text between sentences goes out as it is, in a delta of its own, before the sentence that follows it;
a sentence goes out as its stable prefix grows (one :class:`~server.frontend.streaming.StableStream` each,
the deltas of one sentence as a one-sentence stream has them), or, when it holds placeholders that the
alignments place, whole once it is decoded. All sentences decode at once; the stream shows them in order,
so a later sentence's words wait for the earlier ones. The last delta carries what follows the last sentence
and the whole response. The texts of all deltas join to the translated text. A delta's attention rows (with
``return_attention``) are those of its own sentence: its target words over its source words.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from server.frontend.documents.model import Run
from server.frontend.documents.transfer import SourceSentence, render_run, target_sentence
from server.frontend.streaming import StableStream
from server.protos import pb2
from server.text import TextCodec
from server.types import SentenceRequest, StableReport, Translation


class DocumentStream:
    """The deltas of one streamed text: bound to the model version (:meth:`bind`), given the text's plan by
    :func:`server.frontend.documents.translate.translate_documents` (:meth:`read`), then followed sentence by
    sentence (:meth:`follow`, :meth:`done`, the :class:`~server.frontend.translate.SentenceStream` protocol)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.codec: TextCodec | None = None
        self.scores = self.attention = False
        self._one: StableStream | None = None  # a request read as one model input (a target prefix)
        self._gaps: list[str] = []  # before each sentence, then after the last
        self._sentences: list[tuple[Run, SourceSentence]] = []
        self._streams: list[StableStream | None] = []  # None: the sentence goes out whole
        self._decoded: list[asyncio.Future] = []  # each sentence's one-sentence response
        self._read = asyncio.Event()

    def bind(self, codec: TextCodec, *, scores: bool, attention: bool) -> None:
        self.codec, self.scores, self.attention = codec, scores, attention

    def read(self, text: str, sentences: list[tuple[Run, SourceSentence]], spans: list[tuple[int, int]]) -> None:
        """The text's sentences (each with its run) and their ``[start, end)`` in ``text``."""
        starts = [0, *(end for _, end in spans)]
        self._gaps = [text[start:span[0]] for start, span in zip(starts, spans, strict=False)] + [text[starts[-1]:]]
        self._sentences = sentences
        self._decoded = [self._loop.create_future() for _ in sentences]
        for decoded in self._decoded:  # one that fails after the stream ended is not worth a warning
            decoded.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._streams = []
        for _, source in sentences:
            if source.needs_alignment:  # placeholders: placed once the sentence is decoded
                self._streams.append(None)
            else:
                stream = StableStream()
                assert self.codec is not None
                stream.bind(self.codec, scores=self.scores, attention=self.attention)
                self._streams.append(stream)
        self._read.set()

    # ---- the SentenceStream protocol, called by translate_texts -------------------------------------------

    def follow(self, index: int, sentence: SentenceRequest) -> StableReport | None:
        if not self._read.is_set():  # not a document: the request's one text, as StableStream streams it
            if self._one is None:
                self._one = StableStream()
                assert self.codec is not None
                self._one.bind(self.codec, scores=self.scores, attention=self.attention)
            self._read.set()
            return self._one.follow(index, sentence)
        stream = self._streams[index]
        return stream.follow(0, sentence) if stream is not None else None

    def done(self, index: int, translation: Translation) -> None:
        if self._one is not None or self._decoded[index].done():
            return
        best = translation.hypotheses[0] if translation.hypotheses else None
        hypothesis = pb2.Hypothesis()
        if best is not None:
            run, source = self._sentences[index]
            text = best.text
            if self._streams[index] is None:  # its placeholders put back, as the document has them
                rendered = render_run(run, [(source, target_sentence(source, translation))])
                start, end = rendered.sentence_spans[0]
                text = rendered.markup[start:end]
            hypothesis = pb2.Hypothesis(text=text, subword_tokens=best.tokens, token_scores=best.token_scores)
        response = pb2.TranslateResponse(translations=[pb2.Translation(hypotheses=[hypothesis] if best else [])])
        self._decoded[index].set_result(response)

    # ---- the deltas -----------------------------------------------------------------------------------------

    async def deltas(self, translate: asyncio.Future) -> AsyncIterator[Any]:
        """Every delta of the text, then the last with ``translate``'s response (its error, if it failed, is
        raised)."""
        translate.add_done_callback(self._fail_waiting)
        waiting = asyncio.ensure_future(self._read.wait())
        await asyncio.wait({waiting, translate}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if self._one is not None:
            async for delta in self._one.deltas(translate):
                yield delta
            return
        if not self._read.is_set():  # failed before the text was read
            translate.result()
        last = pb2.TranslationDelta()  # the last sentence's last delta goes out with the response
        for index, (gap, stream, decoded) in enumerate(zip(self._gaps, self._streams, self._decoded, strict=False)):
            if gap:
                yield pb2.TranslationDelta(text=gap)
            if stream is not None:
                async for delta in stream.deltas(decoded):
                    if delta.HasField("final"):  # the sentence's end: the rest of its text
                        delta.ClearField("final")
                        if index == len(self._streams) - 1:
                            last = delta
                            break
                    if delta.text or delta.subword_tokens:
                        yield delta
            else:
                hypotheses = (await decoded).translations[0].hypotheses
                if hypotheses:
                    best = hypotheses[0]
                    delta = pb2.TranslationDelta(subword_tokens=best.subword_tokens, text=best.text)
                    if self.scores:
                        delta.token_scores.extend(best.token_scores[:len(best.subword_tokens)])
                    if index == len(self._streams) - 1:
                        last = delta
                    else:
                        yield delta
        last.text += self._gaps[-1] if self._gaps else ""
        last.final.CopyFrom(await translate)
        yield last

    def _fail_waiting(self, translate: asyncio.Future) -> None:
        """A request that failed or was cancelled ends the sentences still awaited with it."""
        for decoded in self._decoded:
            if not decoded.done():
                if translate.cancelled():
                    decoded.cancel()
                else:
                    decoded.set_exception(translate.exception() or asyncio.CancelledError())
