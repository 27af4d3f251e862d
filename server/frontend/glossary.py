"""Glossaries: source terms and the target terms a translation must use for them, found in each sentence.

A request's glossary is its inline entries, the entries of the stored glossary it names
(:mod:`server.frontend.glossary_store`) and its do-not-translate terms (entries whose target is their source).
:meth:`Glossary.find` looks for the source terms in a sentence as the model reads it: at word boundaries (no
letter, digit or ``_`` on either side), the longest term first where several start at one place, never
overlapping, case-sensitive unless the entry says otherwise; whitespace inside a term matches any run of
whitespace. Each occurrence becomes one constraint of the search (:mod:`server.engine.constraints`): the
term's target as the target tokenizer writes it at a word start, so every hypothesis holds it as written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from server.errors import InvalidArgument
from server.types import GlossaryEntry as Entry

MAX_TERM_CHARS = 256  # a source or target term
MAX_REQUEST_ENTRIES = 1024  # a request's inline entries and do-not-translate terms together
MAX_SENTENCE_TERMS = 16  # occurrences constrained in one sentence: beyond it the request is refused


@dataclass(frozen=True)
class Occurrence:
    """A glossary entry found in a sentence: ``[start, end)`` in its text."""

    entry: Entry
    start: int
    end: int


def check_entries(entries: Iterable[Entry], where: str) -> list[Entry]:
    """The entries, each term stripped; InvalidArgument for an empty or overlong term, a tab or line break in
    one (a stored glossary's file could not hold it), or one source given two targets."""
    checked: dict[tuple[str, bool], Entry] = {}
    for i, entry in enumerate(entries):
        source, target = entry.source.strip(), entry.target.strip()
        for name, term in (("source", source), ("target", target)):
            if not term:
                raise InvalidArgument(f"{where}[{i}] has an empty {name} term")
            if len(term) > MAX_TERM_CHARS:
                raise InvalidArgument(f"{where}[{i}]'s {name} term has {len(term)} characters, the limit is "
                                      f"{MAX_TERM_CHARS}")
            if any(c in term for c in "\t\r\n"):
                raise InvalidArgument(f"{where}[{i}]'s {name} term holds a tab or a line break")
        key = (source.casefold() if entry.case_insensitive else source, entry.case_insensitive)
        earlier = checked.get(key)
        if earlier is not None and earlier.target != target:
            raise InvalidArgument(f"{where}[{i}]: the source term {source!r} has two targets, {earlier.target!r} "
                                  f"and {target!r}")
        checked[key] = Entry(source, target, entry.case_insensitive)
    return list(checked.values())


class Glossary:
    """Entries, indexed by their first word (casefolded), so a sentence is searched in one pass over its words
    however large the glossary is."""

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = list(entries)
        self._by_first: dict[str, list[int]] = {}
        for i, entry in enumerate(self.entries):
            first = _WORD.search(entry.source)
            if first is not None:
                self._by_first.setdefault(first.group().casefold(), []).append(i)
        for candidates in self._by_first.values():  # the longest first
            candidates.sort(key=lambda i: -len(self.entries[i].source))
        self._patterns: dict[int, re.Pattern[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def find(self, text: str) -> list[Occurrence]:
        """The entries' occurrences in ``text``, left to right (see the module docstring)."""
        found: list[Occurrence] = []
        end = 0
        for word in _WORD.finditer(text):
            if word.start() < end:
                continue
            for i in self._by_first.get(word.group().casefold(), ()):
                match = self._pattern(i).match(text, word.start())
                if match is not None:
                    found.append(Occurrence(self.entries[i], match.start(), match.end()))
                    end = match.end()
                    break
        return found

    def _pattern(self, i: int) -> re.Pattern[str]:
        if i not in self._patterns:
            entry = self.entries[i]
            body = r"\s+".join(re.escape(word) for word in entry.source.split())
            self._patterns[i] = re.compile(rf"(?<!\w){body}(?!\w)", re.IGNORECASE if entry.case_insensitive else 0)
        return self._patterns[i]


_WORD = re.compile(r"\w+|[^\w\s]")  # a word, or one character of punctuation: where a term may start


class TermCodec:
    """A glossary bound to a model's target tokenizer: each sentence's constraints as token runs, and the
    widest beam a constrained sentence may search (the server's ``max_beam``)."""

    def __init__(self, glossary: Glossary, target_ids: Callable[[str], list[int]], unk_id: int,
                 max_beam: int) -> None:
        self.glossary = glossary
        self.max_beam = max_beam
        self._target_ids = target_ids
        self._unk_id = unk_id
        self._ids: dict[str, tuple[int, ...]] = {}

    def ids(self, target: str) -> tuple[int, ...]:
        """``target`` as the target tokenizer writes it at a word start; InvalidArgument when the model cannot
        write it (it has no pieces, or an unknown one)."""
        if target not in self._ids:
            ids = tuple(self._target_ids(target))
            if not ids or self._unk_id in ids:
                raise InvalidArgument(f"the glossary's target term {target!r} holds characters this model's target "
                                      "vocabulary cannot write")
            self._ids[target] = ids
        return self._ids[target]

    def constraints(self, text: str, name: str) -> tuple[list[Occurrence], tuple[tuple[int, ...], ...]]:
        """The occurrences in ``text`` (``name``: what messages call it) and one constraint per occurrence;
        InvalidArgument past :data:`MAX_SENTENCE_TERMS`."""
        found = self.glossary.find(text)
        if len(found) > MAX_SENTENCE_TERMS:
            raise InvalidArgument(f"{name} holds {len(found)} glossary terms, the limit is {MAX_SENTENCE_TERMS} per "
                                  "sentence")
        return found, tuple(self.ids(o.entry.target) for o in found)


def constrained_beam(beam: int, terms: int, max_beam: int) -> int:
    """The beam a sentence with ``terms`` constrained occurrences searches: the request's, widened to
    ``2 x terms + 1`` (room for the model's best translation, a hypothesis writing each term and one past
    each; :mod:`server.engine.constraints`) and at most ``max_beam``; a greedy request with one term thus
    searches a beam of 3."""
    return max(beam, min(2 * terms + 1, max_beam), 2)
