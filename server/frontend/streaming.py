"""``TranslateStreaming``: the stable prefix the engine reports, turned into ``TranslationDelta`` messages.

The engine calls a streaming sentence's ``on_stable`` from its worker thread after each step that grew the
sentence's stable prefix (:meth:`server.engine.decode.RunningDecode._report_stable`), with the whole prefix;
in a split server the core forwards those calls to the front-end (:mod:`server.ipc`). A :class:`StableStream`
hands them to the event loop and turns each that closes a word into a delta: the pieces added since the last
delta, their log-probabilities and the text of the words they closed. A word is closed when a later piece
starts a word (``TextCodec.words.starts``): until then its last piece may still be followed by more of the
same word, so its text is held, and so are its pieces (a message that shows no new word would cost the server
CPU and the reader nothing). The text of closed words is the tokenizer's own decoding of the pieces before the
last word start, so the deltas' texts join to what ``Translate`` decodes for the whole hypothesis; the last
message sends what is left of it and the whole response.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np

from server.protos import pb2
from server.text import TextCodec
from server.types import ScoredSequence, SearchResult, SentenceRequest, StableReport

log = logging.getLogger("nmt.server")


class StableStream:
    """The deltas of one streamed text. :meth:`on_stable` may be called from any thread. Reports that arrive
    while the last delta is still being sent are merged: the next delta carries everything since."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._latest: tuple[list[int], list[float], np.ndarray | None] | None = None  # the newest report unsent
        self._wake = asyncio.Event()
        self.codec: TextCodec | None = None
        self.scores = False  # return_scores: deltas carry token_scores
        self.attention = False  # return_attention: deltas carry the closed words' attention rows
        self.source: SentenceRequest | None = None  # the sentence followed (its source words label the rows)
        self._lead = 0  # the model's target-language tokens the reports start with (TargetPrefix.lead)
        self._sent = 0  # pieces sent
        self._text = ""  # text sent
        self._words = 0  # target words whose attention rows were sent

    def bind(self, codec: TextCodec, *, scores: bool, attention: bool) -> None:
        """The model version the request resolved to (its tokenizer and word starts) and its options."""
        self.codec, self.scores, self.attention = codec, scores, attention

    def follow(self, index: int, sentence: SentenceRequest) -> StableReport | None:
        """The sentence whose stable prefix this streams (the first, the one a request streams); returns its
        ``on_stable``."""
        if index:
            return None
        self._lead = sentence.target_prefix.lead
        self.source = replace(sentence, target_prefix=replace(sentence.target_prefix, lead=0))  # rows come led off
        return self.on_stable

    def done(self, index: int, translation: object) -> None:
        """The whole response comes from the request (:meth:`deltas`)."""

    def on_stable(self, tokens: list[int], scores: list[float], attention: np.ndarray | None) -> None:
        """The engine's report of the sentence's stable prefix (:data:`server.types.StableReport`)."""
        if lead := self._lead:
            tokens, scores = tokens[lead:], scores[lead:]
            attention = None if attention is None else attention[lead:]
        self._loop.call_soon_threadsafe(self._arrive, tokens, scores, attention)

    def _arrive(self, tokens: list[int], scores: list[float], attention: np.ndarray | None) -> None:
        self._latest = (tokens, scores, attention)
        self._wake.set()

    async def deltas(self, translate: asyncio.Future) -> AsyncIterator[Any]:
        """The deltas as the prefix grows, then the last one with ``translate``'s response (its error, if it
        failed, is raised); a report still unsent when the translation ends goes out in that last one."""
        translate.add_done_callback(lambda _: self._wake.set())
        while True:
            await self._wake.wait()
            self._wake.clear()
            if translate.done():
                break
            if self._latest is not None:
                latest, self._latest = self._latest, None
                if (delta := self._delta(*latest)) is not None:
                    yield delta
        yield self._last(translate.result())

    def _delta(self, tokens: list[int], scores: list[float], attention: np.ndarray | None) -> Any | None:
        assert self.codec is not None
        if len(tokens) <= self._sent:
            return None
        starts = self.codec.words.starts
        closed = max((i for i in range(1, len(tokens)) if starts[tokens[i]]), default=0)  # pieces of closed words
        text = self.codec.tokenizer.decode(tokens[:closed]) if closed else ""
        added = text[len(self._text):] if len(text) > len(self._text) and text.startswith(self._text) else ""
        if not added:  # no word closed: its pieces wait for the message that closes one (a message costs the
            return None  # server ~0.1 ms of CPU; words, not pieces, are what a reader sees)
        delta = pb2.TranslationDelta(subword_tokens=self.codec.tokenizer.pieces(tokens[self._sent:]), text=added)
        if self.scores:
            delta.token_scores.extend(scores[self._sent:])
        if attention is not None and self.attention and self.source is not None:
            self._add_attention(delta.attention, tokens[:closed], attention[:closed], text)
        self._sent, self._text = len(tokens), self._text + added
        return delta

    def _add_attention(self, message: Any, closed: list[int], rows: np.ndarray, text: str) -> None:
        """The word-level attention rows of the words closed since the last delta (the merge of
        :meth:`TextCodec.to_translation`, over the closed pieces), into ``message``."""
        assert self.codec is not None and self.source is not None
        sequence = ScoredSequence(tokens=closed, score=0.0, token_scores=[], attention=rows)
        attention = self.codec.to_translation(self.source, SearchResult([sequence])).hypotheses[0].attention
        assert attention is not None
        new = attention.weights[self._words:]
        message.target_length, message.source_length = int(new.shape[0]), int(new.shape[1])
        message.weights.extend(new.astype(float).ravel(order="C").tolist())
        pairs = [a for a in attention.alignments if a.target_index >= self._words]
        message.word_alignments.extend(pb2.WordAlignment(source_index=a.source_index, target_index=a.target_index)
                                       for a in pairs)
        message.pharaoh = " ".join(f"{a.source_index}-{a.target_index}" for a in pairs)
        self._words = int(attention.weights.shape[0])

    def _last(self, response: Any) -> Any:
        if not response.translations[0].hypotheses:  # no hypothesis met the request's constraints
            return pb2.TranslationDelta(final=response)
        best = response.translations[0].hypotheses[0]
        if not best.text.startswith(self._text):  # cannot happen with a tokenizer that decodes piece by piece
            log.error("streamed text is not a prefix of the translation", extra={"fields": {
                "sent": self._text, "translation": best.text}})
        delta = pb2.TranslationDelta(subword_tokens=best.subword_tokens[self._sent:],
                                     text=best.text[len(self._text):], final=response)
        if self.scores:
            delta.token_scores.extend(best.token_scores[self._sent:len(best.subword_tokens)])
        return delta
