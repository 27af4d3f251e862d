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
from typing import Any

from server.protos import pb2
from server.text import TextCodec

log = logging.getLogger("nmt.server")


class StableStream:
    """The deltas of one streamed text. :meth:`on_stable` may be called from any thread. Reports that arrive
    while the last delta is still being sent are merged: the next delta carries everything since."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._latest: tuple[list[int], list[float]] | None = None  # the newest report not yet sent
        self._wake = asyncio.Event()
        self.codec: TextCodec | None = None
        self.scores = False  # return_scores: deltas carry token_scores
        self._sent = 0  # pieces sent
        self._text = ""  # text sent

    def bind(self, codec: TextCodec, *, scores: bool) -> None:
        """The model version the request resolved to (its tokenizer and word starts) and its options."""
        self.codec, self.scores = codec, scores

    def on_stable(self, tokens: list[int], scores: list[float]) -> None:
        """The engine's report of the sentence's stable prefix (token ids and their log-probabilities)."""
        self._loop.call_soon_threadsafe(self._arrive, tokens, scores)

    def _arrive(self, tokens: list[int], scores: list[float]) -> None:
        self._latest = (tokens, scores)
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

    def _delta(self, tokens: list[int], scores: list[float]) -> Any | None:
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
        self._sent, self._text = len(tokens), self._text + added
        return delta

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
