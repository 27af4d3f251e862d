"""Sentence boundaries of a run of text (``sentencex``), and sentences too long for the model cut again.

``sentencex`` (MIT, rules for ~300 languages, offsets in code points) finds sentence ends and paragraph breaks
for the model's source language; newlines are boundaries too unless the request keeps them inside sentences.
A span holds its sentence only: the whitespace around it is the gap the document keeps verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import Enum

import sentencex


class Splitting(Enum):
    """How a run is cut into sentences (``TranslateRequest.sentence_splitting``)."""

    SENTENCES = "sentences"  # at sentence ends, paragraph breaks and every newline
    NO_NEWLINES = "no_newlines"  # at sentence ends and paragraph breaks (a blank line), not at single newlines
    OFF = "off"  # the run is one sentence


FALLBACK_LANGUAGE = "en"  # sentencex's rules for a language it has none for
_NEWLINES = re.compile(r"\n|\r\n?|\u2028|\u2029|\x0b|\x0c|\x85")
_CLAUSE_END = re.compile(r"[,;:\u2014\u2013\u3001\uff0c\uff1b](?=\s)|[\u3001\uff0c\uff1b]")
_SPACE = re.compile(r"\s+")


def sentence_spans(text: str, language: str, splitting: Splitting) -> list[tuple[int, int]]:
    """``[start, end)`` of each sentence of ``text``, in order, without the whitespace around it."""
    if splitting is Splitting.OFF:
        pieces = [(0, len(text))]
    else:
        lines = _line_spans(text) if splitting is Splitting.SENTENCES else [(0, len(text))]
        pieces = []
        for start, end in lines:
            for boundary in sentencex.get_sentence_boundaries(language or FALLBACK_LANGUAGE, text[start:end]):
                pieces.append((start + boundary["start_index"], start + boundary["end_index"]))
    return [span for span in (_strip(text, s, e) for s, e in pieces) if span[0] < span[1]]


def _line_spans(text: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    for newline in _NEWLINES.finditer(text):
        spans.append((start, newline.start()))
        start = newline.end()
    spans.append((start, len(text)))
    return spans


def _strip(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def cut_to_fit(text: str, start: int, end: int, fits: Callable[[str], bool]) -> list[tuple[int, int]]:
    """``[start, end)`` of ``text`` as spans that each ``fits`` the model: whole if it does, else cut after
    clause punctuation (commas, semicolons, colons, dashes), then between words, then between characters;
    nothing is dropped (every non-space character is in a span)."""
    if fits(text[start:end]):
        return [(start, end)]
    for pattern in (_CLAUSE_END, _SPACE):
        cuts = [m.end() for m in pattern.finditer(text, start, end) if start < m.end() < end]
        if cuts:
            return _pack(text, start, end, cuts, fits)
    middle = (start + end) // 2  # one word longer than the model takes
    return cut_to_fit(text, start, middle, fits) + cut_to_fit(text, middle, end, fits) if end - start > 1 else [
        (start, end)]


def _pack(text: str, start: int, end: int, cuts: list[int], fits: Callable[[str], bool]) -> list[tuple[int, int]]:
    """Greedily join the pieces between ``cuts`` into the longest spans that fit; a piece that does not fit
    alone is cut further (:func:`cut_to_fit`)."""
    bounds = [start, *cuts, end]
    spans: list[tuple[int, int]] = []
    first = 0
    while first < len(bounds) - 1:
        last = first + 1
        while last + 1 < len(bounds) and fits(text[bounds[first]:bounds[last + 1]]):
            last += 1
        s, e = _strip(text, bounds[first], bounds[last])
        if s < e:
            spans.extend(cut_to_fit(text, s, e, fits) if last == first + 1 else [(s, e)])
        first = last
    return spans
