"""A run put back together around its sentences' translations: inline elements and atoms moved through the
word alignments, the gaps between sentences copied.

Each target word takes the inline element of the source word it aligns to: its letters and digits (the
word's core) that of the source word's core, and punctuation at its edges that of the source word's edge
when it is the same punctuation (``<i>Tuesday</i>,`` -> ``<i>Dienstag</i>,``), else the core's
(``<b>25</b>,`` -> ``<b>25.</b>``). An element then spans from the first to the last piece of output that
asked for it, so it opens and closes once and the run keeps its element tree; siblings whose spans would
overlap are clipped in their target order, and children stay inside their parents. An element none of whose
words reached the target is placed empty beside the nearest aligned word, and so is an empty element. An
atom inside a sentence goes before the target word aligned to the first source word after it. Tag
boundaries fall only between the pieces of output (never between two letters of a word); the whitespace
between target words belongs to an element only when words of that element stand on both sides.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from html import escape
from itertools import pairwise

from server.frontend.documents.model import ATOM, NO_ELEMENT, Atom, Run
from server.types import Translation

FREE = -2  # a piece of output with no element of its own (the whitespace between target words)


@dataclass(frozen=True)
class SourceSentence:
    """A sentence of a run: ``[start, end)`` of its characters, the text the model reads (atoms left out,
    whitespace collapsed to single spaces) and the run position of each character of that text."""

    start: int
    end: int
    text: str
    positions: tuple[int, ...]
    needs_alignment: bool  # atoms inside, or more than one element: the target needs the word alignments


@dataclass
class TargetSentence:
    """A sentence's translation: its text and, when aligned, its words and source words (``[start, end)`` in
    the target and source texts) and, per target word, the source word it aligns to."""

    text: str
    words: list[tuple[int, int]] = field(default_factory=list)
    source_words: list[tuple[int, int]] = field(default_factory=list)
    aligned: list[int] = field(default_factory=list)


@dataclass
class Piece:
    """One piece of a run's output: text, an atom or an empty element, and the element it asks for."""

    text: str = ""
    owner: int = FREE
    atom: Atom | None = None
    shell: int = -1  # an element emitted empty here
    sentence: int = -1  # for target spans: the sentence and target word it belongs to
    word: int = -1
    after_atom: int = -1  # the space after an atom: the atom's piece (left out when the atom moves)


@dataclass
class RenderedRun:
    """A run's output, and where in its text content (offsets from the run's start) each sentence's
    translation and each target word lie."""

    markup: str
    length: int  # code points of the output's text content
    sentence_spans: list[tuple[int, int]]
    word_spans: list[dict[int, tuple[int, int]]]  # per sentence: target word -> its span


def source_sentence(run: Run, start: int, end: int) -> SourceSentence:
    """The sentence of ``run.chars[start:end]`` as the model reads it."""
    text: list[str] = []
    positions: list[int] = []
    for i in range(start, end):
        char = run.chars[i]
        if char == ATOM:
            continue
        if char.isspace():
            if not text or text[-1] == " ":
                continue
            char = " "
        text.append(char)
        positions.append(i)
    while text and text[-1] == " ":
        text.pop()
        positions.pop()
    inside = range(start, end)
    owners = {run.owner[i] for i in inside}
    atoms = any(i in run.atoms for i in inside)
    return SourceSentence(start, end, "".join(text), tuple(positions), atoms or len(owners) > 1)


def word_spans(text: str, words: list[str]) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``words`` found in order in ``text``; a word not found (a piece the
    tokenizer spells differently) gets the text between its neighbours."""
    spans, position = [], 0
    for word in words:
        found = text.find(word, position) if word else -1
        if found < 0:
            while position < len(text) and text[position].isspace():
                position += 1
            end = position
            while end < len(text) and not text[end].isspace():
                end += 1
            spans.append((position, end))
        else:
            spans.append((found, found + len(word)))
        position = spans[-1][1]
    return spans


def _parts(word: str) -> tuple[str, str, str]:
    """A word's leading punctuation, its core (first to last letter or digit) and its trailing punctuation."""
    alnum = [i for i, char in enumerate(word) if char.isalnum()]
    if not alnum:
        return "", word, ""
    return word[:alnum[0]], word[alnum[0]:alnum[-1] + 1], word[alnum[-1] + 1:]


def _majority(run: Run, positions: list[int]) -> int:
    """The element most of these characters sit in (the first of them on a tie)."""
    owners = [run.owner[p] for p in positions]
    if not owners:
        return NO_ELEMENT
    if owners.count(owners[0]) == len(owners):
        return owners[0]
    return Counter(owners).most_common(1)[0][0]


def render_run(run: Run, sentences: list[tuple[SourceSentence, TargetSentence]]) -> RenderedRun:
    """The output of ``run`` with each sentence (in order, not overlapping) replaced by its translation."""
    pieces: list[Piece] = []
    anchors: dict[int, int] = {}  # run position in a gap -> index of its piece
    position = 0
    for k, (source, target) in enumerate(sentences):
        _gap(run, position, source.start, pieces, anchors)
        _sentence(run, k, source, target, pieces, anchors)
        position = source.end
    _gap(run, position, len(run.chars), pieces, anchors)
    anchors.setdefault(len(run.chars), len(pieces))
    ranges = _layout(run, _with_shells(run, pieces, anchors))
    return _emit(run, ranges, len(sentences))


def _gap(run: Run, start: int, end: int, pieces: list[Piece], anchors: dict[int, int]) -> None:
    """The run's own characters ``[start, end)``, copied: a piece per atom and per stretch of one element."""
    stretch: Piece | None = None
    for i in range(start, end):
        anchors[i] = len(pieces)
        if i in run.atoms:
            pieces.append(Piece(owner=run.owner[i], atom=run.atoms[i]))
            stretch = None
        elif stretch is not None and stretch.owner == run.owner[i]:
            stretch.text += run.chars[i]
        else:
            stretch = Piece(text=run.chars[i], owner=run.owner[i])
            pieces.append(stretch)


def _sentence(run: Run, k: int, source: SourceSentence, target: TargetSentence, pieces: list[Piece],
              anchors: dict[int, int]) -> None:
    """A sentence's translation as pieces, each word's parts asking for its aligned source word's elements,
    the sentence's atoms before the words they precede in the source."""
    first = len(pieces)
    if not target.words or not source.needs_alignment:  # one element (or none) and no atoms: nothing moves
        owner = run.owner[source.positions[0]] if source.positions else NO_ELEMENT
        cursor = 0
        for i, (start, end) in enumerate(target.words):  # the words only for their spans
            if start > cursor:
                pieces.append(Piece(text=target.text[cursor:start], owner=owner, sentence=k))
            pieces.append(Piece(text=target.text[start:end], owner=owner, sentence=k, word=i))
            cursor = end
        if cursor < len(target.text) or not target.words:
            pieces.append(Piece(text=target.text[cursor:], owner=owner, sentence=k))
        for i in range(source.start, source.end):
            anchors[i] = first
        return
    source_parts = []  # per source word: (lead, core, trail) strings and owners
    for start, end in target.source_words:
        lead, core, trail = _parts(source.text[start:end])
        cuts = [start, start + len(lead), start + len(lead) + len(core), end]
        owners = [_majority(run, list(source.positions[a:b])) for a, b in pairwise(cuts)]
        source_parts.append(((lead, core, trail), owners))
    word_starts = [source.positions[start] for start, _ in target.source_words]
    atoms_before: dict[int, list[int]] = {}  # target word -> run positions of the atoms placed before it
    placed_after: list[int] = []  # atoms after the last word
    first_target = {}  # source word -> its first target word
    for i, j in enumerate(target.aligned):
        first_target.setdefault(j, i)
    for p in range(source.start, source.end):
        if p not in run.atoms:
            continue
        following = [j for j, start in enumerate(word_starts) if start > p and j in first_target]
        if following:
            atoms_before.setdefault(first_target[following[0]], []).append(p)
        else:
            placed_after.append(p)
    word_piece: dict[int, int] = {}
    cursor = 0
    for i, (start, end) in enumerate(target.words):
        if start > cursor:
            pieces.append(Piece(text=target.text[cursor:start], owner=FREE, sentence=k))
        for p in atoms_before.get(i, []):
            word_piece.setdefault(i, len(pieces))
            pieces.append(Piece(owner=run.owner[p], atom=run.atoms[p], sentence=k))
            if p + 1 < len(run.chars) and run.chars[p + 1].isspace():
                pieces.append(Piece(text=" ", owner=FREE, sentence=k, after_atom=len(pieces) - 1))
        word_piece.setdefault(i, len(pieces))
        (s_lead, _, s_trail), (o_lead, o_core, o_trail) = source_parts[target.aligned[i]]
        lead, core, trail = _parts(target.text[start:end])
        for text, owner in ((lead, o_lead if lead and lead == s_lead else o_core), (core, o_core),
                            (trail, o_trail if trail and trail == s_trail else o_core)):
            if text:
                pieces.append(Piece(text=text, owner=owner, sentence=k, word=i))
        cursor = end
    if cursor < len(target.text):
        pieces.append(Piece(text=target.text[cursor:], owner=FREE, sentence=k))
    for p in placed_after:
        if p > 0 and run.chars[p - 1].isspace() and pieces and not pieces[-1].text.endswith(" "):
            pieces.append(Piece(text=" ", owner=FREE, sentence=k))
        pieces.append(Piece(owner=run.owner[p], atom=run.atoms[p], sentence=k))
    following_piece = len(pieces)  # run positions of the sentence -> where their content went: the first
    for j in range(len(word_starts) - 1, -1, -1):  # target word of the nearest aligned source word from there
        if j in first_target:
            following_piece = word_piece.get(first_target[j], following_piece)
        anchors.setdefault(word_starts[j], following_piece)
    following = len(pieces)
    for i in range(source.end - 1, source.start - 1, -1):  # any other position: where the next word went
        following = anchors.setdefault(i, following)
    if len(pieces) == first:
        pieces.append(Piece(text="", owner=FREE, sentence=k))


def _desired(run: Run, pieces: list[Piece]) -> dict[int, tuple[int, int]]:
    """Per element, the first and last piece that asks for it or for an element inside it."""
    wanted: dict[int, tuple[int, int]] = {}
    for index, piece in enumerate(pieces):
        if piece.owner < 0:
            continue
        for element in run.ancestors(piece.owner):
            first, _ = wanted.get(element, (index, index))
            wanted[element] = (first, index)
    return wanted


def _with_shells(run: Run, pieces: list[Piece], anchors: dict[int, int]) -> list[Piece]:
    """``pieces`` with a shell piece for each outermost element that no piece asks for, where its start in
    the source went."""
    wanted = _desired(run, pieces)
    shells: dict[int, list[int]] = {}
    for element in range(len(run.elements)):
        parent = run.elements[element].parent
        if element not in wanted and (parent == NO_ELEMENT or parent in wanted):
            at = run.starts[element]
            index = anchors.get(at, anchors[len(run.chars)] if at >= len(run.chars) else len(pieces))
            shells.setdefault(index, []).append(element)
    if not shells:
        return pieces
    merged: list[Piece] = []
    for index in range(len(pieces) + 1):
        for element in shells.get(index, []):
            merged.append(Piece(owner=run.elements[element].parent, shell=element))
        if index < len(pieces):
            merged.append(pieces[index])
    return merged


@dataclass
class _Layout:
    pieces: list[Piece]
    ranges: dict[int, tuple[int, int]]  # element -> [first, last] pieces; first > last: empty at first
    children: dict[int, list[int]]


def _layout(run: Run, pieces: list[Piece]) -> _Layout:
    """Nested, contiguous piece ranges for every element that has pieces, siblings in target order."""
    wanted = _desired(run, pieces)
    children: dict[int, list[int]] = {}
    for element, _ in sorted(wanted.items(), key=lambda item: (item[1][0], item[0])):
        children.setdefault(run.elements[element].parent, []).append(element)
    ranges: dict[int, tuple[int, int]] = {}

    def place(parent: int, low: int, high: int) -> None:
        cursor = low
        for element in children.get(parent, []):
            first, last = wanted[element]
            first, last = max(first, cursor), min(last, high)
            if first > last:  # clipped away by a sibling or the parent: empty where it would start
                first, last = min(max(first, cursor), high + 1), min(max(first, cursor), high + 1) - 1
            ranges[element] = (first, last)
            cursor = last + 1
            place(element, first, last)

    place(NO_ELEMENT, 0, len(pieces) - 1)
    return _Layout(pieces, ranges, children)


def _settle(layout: _Layout, index: int, owner: int) -> tuple[int, int]:
    """Where an atom or shell asking for ``owner`` is emitted: ``(element, position)``, inside ``owner`` and
    outside its children (before the child whose range holds ``index``); an atom of an element that ended
    up empty goes inside that element."""
    if owner == NO_ELEMENT:
        first, last = 0, len(layout.pieces) - 1
    else:
        first, last = layout.ranges[owner]
        if first > last:
            return owner, first
    position = min(max(index, first), last + 1)
    for child in layout.children.get(owner, []):
        child_first, child_last = layout.ranges[child]
        if child_first < position <= child_last:
            return owner, child_first
    return owner, position


def _emit(run: Run, layout: _Layout, sentences: int) -> RenderedRun:
    """The run's markup: each element opened and closed once around its range, atoms and shells where
    :func:`_settle` puts them, the text escaped when the run is markup."""
    out: list[str] = []
    length = 0
    sentence_spans: list[list[int]] = [[-1, -1] for _ in range(sentences)]
    word_spans: list[dict[int, list[int]]] = [{} for _ in range(sentences)]
    text = escape if run.escape else (lambda value, quote=False: value)
    inside: dict[int, list[int]] = {}
    for child, element in enumerate(run.elements):
        inside.setdefault(element.parent, []).append(child)
    inserts: dict[tuple[int, int], list[int]] = {}  # (element, position) -> atom and shell pieces
    moved: set[int] = set()
    space_after = {piece.after_atom: index for index, piece in enumerate(layout.pieces) if piece.after_atom >= 0}
    for index, piece in enumerate(layout.pieces):
        if piece.atom is not None or piece.shell >= 0:
            element, position = _settle(layout, index, piece.owner if piece.owner >= 0 else NO_ELEMENT)
            inserts.setdefault((element, position), []).append(index)
            if position != index:
                moved.add(index)

    def shell(element: int) -> None:
        out.append(run.elements[element].start_tag)
        for key in sorted(k for k in inserts if k[0] == element):
            for index in inserts.pop(key):
                place(index)
        for child in inside.get(element, []):
            if child not in layout.ranges:
                shell(child)
        out.append(run.elements[element].end_tag)

    def place(index: int) -> None:
        piece = layout.pieces[index]
        if piece.shell >= 0:
            shell(piece.shell)
        else:
            track(index, piece.atom.markup, len(piece.atom.text))
            if index in moved and index in space_after:  # its space goes with it
                track(space_after[index], " ", 1)

    def track(index: int, markup: str, size: int) -> None:
        nonlocal length
        piece = layout.pieces[index]
        start = length
        out.append(markup)
        length += size
        if piece.sentence >= 0:
            span = sentence_spans[piece.sentence]
            span[0] = start if span[0] < 0 else span[0]
            span[1] = length
            if piece.word >= 0:
                word = word_spans[piece.sentence].setdefault(piece.word, [start, length])
                word[1] = length

    def emit(parent: int, low: int, high: int) -> None:
        children = iter(layout.children.get(parent, []))
        child = next(children, None)
        position = low
        while True:
            for index in inserts.pop((parent, position), []):
                place(index)
            if child is not None and layout.ranges[child][0] == position:
                first, last = layout.ranges[child]
                if first > last:
                    shell(child)
                else:
                    out.append(run.elements[child].start_tag)
                    emit(child, first, last)
                    out.append(run.elements[child].end_tag)
                    position = last + 1
                child = next(children, None)
                continue
            if position > high:
                break
            piece = layout.pieces[position]
            if piece.atom is None and piece.shell < 0 and not (piece.after_atom in moved and piece.text == " "):
                track(position, text(piece.text, quote=False), len(piece.text))
            position += 1

    emit(NO_ELEMENT, 0, len(layout.pieces) - 1)
    for key in sorted(inserts):  # cannot happen: every insert lies inside its element's range or shell
        for index in inserts.pop(key):
            place(index)
    words = [{i: (span[0], span[1]) for i, span in spans.items()} for spans in word_spans]
    return RenderedRun("".join(out), length, [(span[0], span[1]) for span in sentence_spans], words)


def target_sentence(source: SourceSentence, translation: Translation) -> TargetSentence:
    """A sentence's best translation as :func:`render_run` reads it: with its words and alignments when it
    was aligned."""
    if not translation.hypotheses:
        return TargetSentence("")
    best = translation.hypotheses[0]
    if best.attention is None or not best.words or not translation.source_words:
        return TargetSentence(best.text)
    aligned = [0] * len(best.words)
    for a in best.attention.alignments:
        if a.target_index < len(aligned):
            aligned[a.target_index] = min(a.source_index, len(translation.source_words) - 1)
    return TargetSentence(best.text, word_spans(best.text, best.words),
                          word_spans(source.text, translation.source_words), aligned)
