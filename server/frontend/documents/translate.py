"""Texts read as documents -> their sentences decoded together -> each text put back together.

Every sentence of every text of a request is one sentence to the scheduler (:func:`translate_texts`): they
batch with each other and with other requests, leave the decode independently and share the request's
deadline, cancellation and work budget. A sentence is aligned (its attention computed) only when putting its
run back needs it, or when the request asks for attention.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from server.errors import InvalidArgument
from server.frontend.documents.markup import html_document, xml_document
from server.frontend.documents.model import ATOM, Atom, Document, Run, Tags, TextFormat, plain_document
from server.frontend.documents.segmenter import Splitting, cut_to_fit, sentence_spans
from server.frontend.documents.streaming import DocumentStream
from server.frontend.documents.transfer import SourceSentence, render_run, source_sentence, target_sentence, word_spans
from server.frontend.glossary import TermCodec
from server.frontend.translate import Submit, translate_texts
from server.policy import BatchPolicy, RequestHandle
from server.text import NO_LANGUAGE_TOKENS, LanguageTokens, TextCodec
from server.types import (
    DecodingOptions,
    DocumentAlignment,
    DocumentWord,
    Hypothesis,
    Segment,
    Translation,
    WordAlignment,
)

PARSE_INLINE_CHARS = 4096  # larger requests are read and segmented on a worker thread, off the event loop


@dataclass(frozen=True)
class Reading:
    """How a request's texts are read: their format, how runs are cut into sentences, the source language
    (for the segmenter's rules) and the most tokens one sentence may have."""

    format: TextFormat = TextFormat.PLAIN
    splitting: Splitting = Splitting.SENTENCES
    language: str = ""
    max_tokens: int = 256
    tags: Tags = Tags()  # noqa: RUF009 - frozen


@dataclass
class Plan:
    """One text read, and the sentences of each of its runs."""

    document: Document
    sentences: list[list[SourceSentence]]

    @property
    def flat(self) -> list[SourceSentence]:
        return [sentence for run in self.sentences for sentence in run]


def read_document(text: str, text_format: TextFormat, where: str, tags: Tags = Tags()) -> Document:  # noqa: B008
    if text_format is TextFormat.HTML:
        return html_document(text, where, tags)
    if text_format is TextFormat.XML:
        return xml_document(text, where, tags)
    return plain_document(text)


def plan_text(text: str, reading: Reading, fits: Callable[[str], bool], where: str = "text") -> Plan:
    """Read ``text`` and cut its runs into sentences that fit the model (:func:`cut_to_fit`, unless splitting is
    off); a stretch with
    no letter or digit (a bullet, a dash, atoms alone) is no sentence and stays as it is."""
    document = read_document(text, reading.format, where, reading.tags)
    sentences = []
    for run in document.runs:
        chars = run.text
        found = []
        for start, end in sentence_spans(chars, reading.language, reading.splitting):
            # not split: one sentence, whose length the token limit refuses
            pieces = [(start, end)] if reading.splitting is Splitting.OFF else cut_to_fit(chars, start, end, fits)
            for s, e in pieces:
                s, e = _trim_atoms(run, s, e)
                if any(char.isalnum() for char in chars[s:e]):
                    found.append(source_sentence(run, s, e))
        sentences.append(found)
    return Plan(document, sentences)


def _trim_atoms(run: Run, start: int, end: int) -> tuple[int, int]:
    """A sentence without the atoms and whitespace at its edges: they stay where they are in the gap."""
    while start < end and (start in run.atoms or run.chars[start].isspace()):
        start += 1
    while end > start and (end - 1 in run.atoms or run.chars[end - 1].isspace()):
        end -= 1
    return start, end


async def translate_documents(
    codec: TextCodec, submit: Submit, texts: Sequence[str], options: DecodingOptions,
    request: RequestHandle | None = None, *, reading: Reading, policy: BatchPolicy | None = None,
    languages: LanguageTokens = NO_LANGUAGE_TOKENS, max_sentences: int = 1024,
    stream: DocumentStream | None = None, terms: TermCodec | None = None,
) -> list[Translation]:
    """Translate each text as a document (see the module docstring); InvalidArgument for a request of more
    than ``max_sentences`` sentences; ``languages``: the language tokens of :func:`translate_texts`. ``stream``
    follows the sentences of a request's one text; ``terms``: the
    request's glossary, matched in each sentence as the model reads it (so never inside untranslated
    elements, which are not part of it)."""
    limit = reading.max_tokens - len(languages.source) - len(languages.source_end)

    pieces: dict[str, list[int]] = {}  # model text -> its ids, measured while cutting and reused to decode

    def tokenize(text: str) -> list[int]:
        if text not in pieces:
            pieces[text] = codec.tokenize(text)
        return pieces[text]

    def fits(span: str) -> bool:  # as the model will read it: without atoms, whitespace collapsed
        return len(tokenize(" ".join(span.replace(ATOM, " ").split()))) <= limit

    def plan_all() -> list[Plan]:
        return [plan_text(text, reading, fits, f"texts[{i}]") for i, text in enumerate(texts)]

    plans = await asyncio.to_thread(plan_all) if sum(map(len, texts)) > PARSE_INLINE_CHARS else plan_all()
    sentences = [sentence for plan in plans for sentence in plan.flat]
    if len(sentences) > max_sentences:
        raise InvalidArgument(f"request has {len(sentences)} sentences, the limit is {max_sentences} "
                              "(max_sentences, at most queue_size); send fewer or shorter texts")
    if stream is not None:
        [plan] = plans
        located = [(run, source) for run, sources in zip(plan.document.runs, plan.sentences, strict=True)
                   for source in sources]
        stream.read(texts[0], located, [(run.offsets[s.start], run.offsets[s.end - 1] + 1) for run, s in located])
    translations = await translate_texts(
        codec, submit, [s.text for s in sentences], options, request, policy=policy, languages=languages,
        aligned=[s.needs_alignment or options.return_attention for s in sentences], stream=stream,
        document=True, tokenize=tokenize, terms=terms,
        names=[f"texts[{i}] sentence {k}" for i, plan in enumerate(plans) for k in range(len(plan.flat))],
    ) if sentences else []
    results, position = [], 0
    for plan in plans:
        count = len(plan.flat)
        results.append(assemble(plan, translations[position:position + count], options.return_attention))
        position += count
    return results


def assemble(plan: Plan, translations: Sequence[Translation], words: bool) -> Translation:
    """One text's translation from its sentences' (in order): the document put back together, its segments
    and, with ``words``, the words and alignments of the whole text."""
    out: list[str] = []
    length = 0
    segments: list[Segment] = []
    source_words: list[DocumentWord] = []
    target_words: list[DocumentWord] = []
    pairs: list[WordAlignment] = []
    next_sentence = iter(translations)
    run_index = 0
    for part in plan.document.parts:
        if isinstance(part, str):
            out.append(part)
            continue
        if isinstance(part, Atom):
            out.append(part.markup)
            length += len(part.text)
            continue
        run_sentences = plan.sentences[run_index]
        run_index += 1
        targets = [(source, next(next_sentence)) for source in run_sentences]
        rendered = render_run(part, [(source, target_sentence(source, t)) for source, t in targets])
        for k, (source, translation) in enumerate(targets):
            start = part.offsets[source.start]
            end = part.offsets[source.end - 1] + 1
            span = rendered.sentence_spans[k]
            segments.append(Segment((start, end), (length + span[0], length + span[1]), translation))
            best = translation.hypotheses[0] if translation.hypotheses else None
            if words and best is not None and best.attention is not None:
                base_source, base_target = len(source_words), len(target_words)
                for (a, b), word in zip(word_spans(source.text, translation.source_words), translation.source_words,
                                        strict=True):
                    source_words.append(DocumentWord(word, *_content_span(part, source, a, b), len(segments) - 1))
                spans = rendered.word_spans[k]
                for i, word in enumerate(best.words):
                    a, b = spans.get(i, (span[1], span[1]))
                    target_words.append(DocumentWord(word, length + a, length + b, len(segments) - 1))
                pairs.extend(WordAlignment(base_source + a.source_index, base_target + a.target_index)
                             for a in best.attention.alignments)
        out.append(rendered.markup)
        length += rendered.length
    text = "".join(out)
    document = DocumentAlignment(source_words, target_words, pairs) if words else None
    if len(segments) == 1 and segments[0].translation.hypotheses and \
            segments[0].translation.hypotheses[0].text == text:  # one sentence, as it is without documents
        alone = segments[0].translation
        return replace(alone, segments=segments, document=document)
    return Translation(
        source_tokens=[t for s in segments for t in s.translation.source_tokens],
        source_words=[w for s in segments for w in s.translation.source_words],
        hypotheses=[document_hypothesis(text, [s.translation for s in segments])],
        segments=segments, document=document, terms=[term for s in segments for term in s.translation.terms],
    )


def _content_span(run: Run, source: SourceSentence, start: int, end: int) -> tuple[int, int]:
    """``[start, end)`` of ``source.text`` in the document's text content. An empty span (a word the text does
    not spell, e.g. ``<unk>`` pieces past the last character: :func:`word_spans`) sits at the boundary."""
    if start < end:
        return run.offsets[source.positions[start]], run.offsets[source.positions[end - 1]] + 1
    point = run.offsets[source.positions[start - 1]] + 1 if start else run.offsets[source.positions[0]]
    return point, point


def document_hypothesis(text: str, translations: Sequence[Translation]) -> Hypothesis:
    """The one hypothesis of a text of several sentences: the document's text, and its sentences' best
    hypotheses' pieces, words and token scores joined; ``score``: the mean of their scores."""
    best = [t.hypotheses[0] for t in translations if t.hypotheses]
    return Hypothesis(
        text=text, tokens=[p for h in best for p in h.tokens], words=[w for h in best for w in h.words],
        token_ids=[i for h in best for i in h.token_ids],
        score=sum(h.score for h in best) / len(best) if best else 0.0,
        token_scores=[s for h in best for s in h.token_scores], terms_met=all(h.terms_met for h in best),
    )
