"""One request's texts -> translations, around the decoding: what every serving process does per request.

:func:`translate_texts` tokenizes the texts (on a worker thread when the request is large), puts the
target-language token before each, checks the token limit and the work and response budgets
(:mod:`server.frontend.validation`), submits the sentences as token ids to the model version's scheduler and
detokenizes the search results it returns (:class:`server.text.TextCodec`). The scheduler is in this
process (:meth:`server.core.scheduler.ModelScheduler.submit`) or in the engine core, reached through
:mod:`server.ipc`; either way ``submit`` has the same contract, so this is the one path for both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol

from server.frontend.glossary import TermCodec, constrained_beam
from server.frontend.validation import check_budget, tokenize_texts
from server.policy import BatchPolicy, RequestHandle
from server.text import NO_LANGUAGE_TOKENS, LanguageTokens, TextCodec
from server.types import (
    AppliedTerm,
    DecodingOptions,
    SearchResult,
    SentenceRequest,
    StableReport,
    TargetPrefix,
    Translation,
)

TOKENIZE_INLINE_CHARS = 8192  # larger requests are tokenized on a worker thread, off the event loop

# (sentences, each one's work, the request's handle) -> their search results, in order
Submit = Callable[[Sequence[SentenceRequest], Sequence[int], RequestHandle], Awaitable[list[SearchResult]]]


class SentenceStream(Protocol):
    """What follows a streamed request's sentences (:class:`server.frontend.streaming.StableStream`, or
    :class:`server.frontend.documents.streaming.DocumentStream` for a document's)."""

    def follow(self, index: int, sentence: SentenceRequest) -> StableReport | None:
        """Sentence ``index``'s ``on_stable`` (None: its stable prefix is not reported)."""

    def done(self, index: int, translation: Translation) -> None:
        """Sentence ``index`` is decoded."""


def source_span(tokenize: Callable[[str], list[int]], text: str, start: int, end: int, prefix: int,
                length: int) -> tuple[int, int]:
    """The source tokens ``[a, b)`` of ``text[start:end]`` (a glossary term's occurrence), counted as the
    tokenizer cuts the text up to each end (terms lie at word boundaries, where that matches the whole
    text's cut) after ``prefix`` language tokens, within the sentence's ``length`` tokens."""
    a = prefix + (len(tokenize(text[:start])) if text[:start].strip() else 0)
    b = prefix + len(tokenize(text[:end]))
    a = min(a, length - 1)
    return a, min(max(b, a + 1), length)


async def translate_texts(
    codec: TextCodec, submit: Submit, texts: Sequence[str], options: DecodingOptions,
    request: RequestHandle | None = None, *, policy: BatchPolicy | None = None,
    languages: LanguageTokens = NO_LANGUAGE_TOKENS, target_prefixes: Sequence[TargetPrefix] = (),
    aligned: Sequence[bool] = (),
    stream: SentenceStream | None = None, document: bool = False, names: Sequence[str] = (),
    tokenize: Callable[[str], list[int]] | None = None, terms: TermCodec | None = None,
) -> list[Translation]:
    """Translate the texts of one request: tokenize them with the ``languages``' tokens around each
    (:meth:`TextCodec.language_tokens`), force each text's decoding through the decoder's language token (a
    many-to-many model's) and its ``target_prefixes`` (none, or one per text), refuse a text over
    ``policy.max_tokens`` tokens and a request over the work or response-size budget (INVALID_ARGUMENT), decode
    them through ``submit`` and return their translations in order. ``aligned`` (none, or one per text): the
    texts whose attention is computed although the options do not ask for it (:mod:`server.frontend.documents`
    places markup with it); ``document``: the texts are a document's sentences, whose response also carries the
    document's text, words and alignments, bounded as one hypothesis more per sentence; ``names`` call the texts
    so in error messages (e.g. "texts[2] sentence 3"); ``tokenize``: the texts' ids when already known (default:
    the codec's).
    ``terms``: the request's glossary; a text holding its terms decodes under them as constraints
    (:mod:`server.engine.constraints`) with a beam widened by :func:`constrained_beam`, the others as without.
    ``stream`` (:class:`SentenceStream`) follows the sentences' stable prefixes and hears of each one's
    translation as soon as it is decoded (each is submitted alone; all at once, so they still batch
    together)."""
    policy = policy or BatchPolicy()
    where = "sentence" if document else "text"  # the min_length message

    ids_of = tokenize or codec.tokenize

    prefix = languages.source

    def with_prefix(text: str) -> list[int]:
        return [*prefix, *ids_of(text)]

    if sum(map(len, texts)) > TOKENIZE_INLINE_CHARS:  # keep the event loop responsive
        sources = await asyncio.to_thread(tokenize_texts, texts, with_prefix, policy.max_tokens, names)
    else:
        sources = tokenize_texts(texts, with_prefix, policy.max_tokens, names)
    forced = [target.led(languages.lead) for target in (list(target_prefixes) or [TargetPrefix() for _ in texts])]
    each = [options] * len(texts)
    applied: list[list[AppliedTerm]] = [[] for _ in texts]
    if terms is not None:
        for i, text in enumerate(texts):
            found, constraints = terms.constraints(text, names[i] if names else f"texts[{i}]")
            if constraints:
                spans = tuple(source_span(codec.tokenize, text, o.start, o.end, len(prefix), len(sources[i]))
                              for o in found)
                each[i] = replace(options, beam_size=constrained_beam(options.beam_size, len(constraints),
                                                                      terms.max_beam),
                                  controls=replace(options.controls, constraints=constraints,
                                                   constraint_sources=spans))
                applied[i] = [AppliedTerm(text[o.start:o.end], o.entry.target) for o in found]
    budget = replace(options, num_hypotheses=options.num_hypotheses + 1) if document else options
    work = check_budget(texts, sources, budget, piece_bytes=codec.tokenizer.max_piece_bytes,
                        max_work=policy.max_request_work, max_response_bytes=policy.max_response_bytes,
                        prefix_steps=[target.steps() for target in forced], where=where,
                        beams=[o.beam_size for o in each])
    flags = list(aligned) or [False] * len(texts)
    sentences = [SentenceRequest(ids, replace(o, return_attention=True) if align and not o.return_attention else o,
                                 None, text, target_prefix=target, source_end=languages.source_end)
                 for ids, text, target, align, o in zip(sources, texts, forced, flags, each, strict=True)]
    handle = request or RequestHandle()

    def translation(i: int, result: SearchResult) -> Translation:
        done = codec.to_translation(sentences[i], result)
        return replace(done, terms=applied[i]) if applied[i] else done

    if stream is None:
        results = await submit(sentences, work, handle)
        return [translation(i, result) for i, result in enumerate(results)]
    sentences = [replace(s, on_stable=stream.follow(i, s)) for i, s in enumerate(sentences)]

    async def one(i: int) -> Translation:  # a stream hears of each sentence as soon as it is decoded
        [result] = await submit([sentences[i]], [work[i]], handle)
        done = translation(i, result)
        stream.done(i, done)
        return done

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(sentences))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # after a failure the other sentences stop too
        for task in tasks:
            task.cancel()
