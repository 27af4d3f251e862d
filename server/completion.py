"""Target prefixes that end inside a word (the translator is typing it): the output completes that word.

:func:`split_partial_word` cuts the prefix before its trailing word characters; the text before them is
tokenized and forced as usual, and the partial word becomes a :class:`Completion`: the next pieces must
spell it out. A piece is allowed when it starts with the characters still to produce (it completes the
word, and may go on: "▁Apr" -> "▁April") or is a prefix of them (it produces some, and the next piece
goes on from there). Pieces that lead to a dead end (no piece continues) are left out when the
automaton is built, so the search never runs into one; a word no sequence of pieces spells is refused
by :func:`build_completion` (None) and the prefix is then tokenized whole, as before.

:meth:`WordPieces.boundary` is the completion of a word boundary: its one piece starts a word or ends
the sentence. Alternatives after a prefix that ends with whitespace (a finished word, though its pieces
cannot say so: the tokenizer drops trailing whitespace) start there (:mod:`server.engine.forced`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.model_format.tokenizer import WORD_START

WORD_END = re.compile(r"\w+$")
# alternatives: partial words the word search keeps per word asked for (some make no word, some spell one
# again); the front-end counts the rows they take (server.frontend.validation), the search keeps them
# (server.engine.forced)
WIDTH = 2


def split_partial_word(prefix: str) -> tuple[str, str]:
    """``prefix`` -> (the text before its trailing word, that word), ``(prefix, "")`` when the prefix ends
    at a boundary (whitespace or punctuation)."""
    match = WORD_END.search(prefix)
    if match is None:
        return prefix, ""
    return prefix[: match.start()], match.group()


@dataclass(eq=False)  # compared by identity, as before it was a dataclass
class Completion:
    """The pieces allowed while a partial word is spelt out, from step ``start`` (the forced pieces
    before it) on: ``states[k]`` maps each allowed token to the characters of ``text`` produced once it
    is taken (``len(text)``: the word is complete)."""

    text: str  # the word in piece spelling ("▁Apr" after whitespace)
    start: int
    states: list[dict[int, int]]

    def steps(self) -> int:
        """At most this many pieces spell the word (each produces at least one character)."""
        return len(self.text)

    def allowed(self, tokens: Sequence[int]) -> dict[int, int] | None:
        """Tokens allowed after ``tokens`` (those generated since ``start``); None once the word is complete,
        nothing after tokens that do not spell it (a dead beam row's filler)."""
        produced: int | None = 0
        for token in tokens:
            produced = self.states[produced].get(int(token))
            if produced is None:
                return {}
            if produced == len(self.text):
                return None
        return self.states[produced]


def piece_index(pieces: Sequence[str], excluded: set[int]) -> dict[str, list[tuple[int, str]]]:
    """The vocabulary (id -> spelling, ``excluded`` ids left out) by first character: a piece that can
    spell part of a word starts with that part's first character (built once per model version)."""
    index: dict[str, list[tuple[int, str]]] = {}
    for i, piece in enumerate(pieces):
        if piece and i not in excluded:
            index.setdefault(piece[0], []).append((i, piece))
    return index


def build_completion(word: str, after_space: bool, start: int,
                     index: dict[str, list[tuple[int, str]]]) -> Completion | None:
    """The :class:`Completion` of ``word`` (``after_space``: it begins a word, so its first piece carries
    the boundary mark) over the vocabulary ``index`` (:func:`piece_index`); None when no sequence of
    pieces spells it."""
    text = (WORD_START if after_space else "") + unicodedata.normalize("NFKC", word)
    length = len(text)
    states: list[dict[int, int]] = [{} for _ in range(length)]
    viable = [False] * length + [True]
    for k in range(length - 1, -1, -1):
        rest = text[k:]
        states[k] = {i: min(k + len(piece), length) for i, piece in index.get(rest[0], ())
                     if (piece.startswith(rest) or rest.startswith(piece)) and viable[min(k + len(piece), length)]}
        viable[k] = bool(states[k])
    return Completion(text, start, states) if viable[0] else None


class WordPieces:
    """Which target ids start a word, and how each is spelt: a model's vocabulary as the next-word rule
    (:mod:`server.engine.forced`) and :meth:`boundary` read it, built once when the model loads."""

    def __init__(self, pieces: Sequence[str], eos_id: int) -> None:
        self.spellings = tuple(pieces)  # id -> piece: two spellings of one word join to the same text
        self.starts = np.array([piece.startswith(WORD_START) for piece in pieces])  # bool [V]
        self.bare = np.array([piece == WORD_START for piece in pieces])  # bool [V]: the mark alone (a word's first
        # piece when no piece holds the mark and its first characters; never a word by itself)
        self.ends = self.starts.copy()  # bool [V]: a piece that ends the word before it (a word start, or EOS)
        self.ends[eos_id] = True
        self._boundary = [dict.fromkeys(np.flatnonzero(self.ends).tolist(), len(WORD_START))]
        # the pieces that continue the word before them (no word start, a letter or digit first): none may follow
        # a glossary term's last piece (server.engine.constraints), where it would make the term part of a word
        self.joiners = frozenset(i for i, piece in enumerate(pieces) if piece[:1].isalnum())

    def boundary(self, start: int) -> Completion:
        """The piece at step ``start`` starts a word or ends the sentence (a prefix ending with whitespace)."""
        return Completion(WORD_START, start, self._boundary)

    def spell(self, tokens: Sequence[int]) -> str:
        """The pieces ``tokens`` joined: the same for every spelling of one word."""
        return "".join(self.spellings[t] for t in tokens)
