"""What a text is made of once read: verbatim parts and runs of inline content, and how plain text is read.

A :class:`Run` is the content between two block boundaries: its characters, the inline element each character
sits in, and :data:`ATOM` characters that stand for what is kept verbatim inside a sentence (a placeholder,
an ``<img>``, a ``<code>`` element, a comment). Sentences are cut from runs; a run is put back together as a
whole (:mod:`server.frontend.documents.transfer`), so an inline element may hold several sentences.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum


class TextFormat(Enum):
    """How a text is read (``TranslateRequest.text_format``)."""

    PLAIN = "text"
    HTML = "html"
    XML = "xml"


@dataclass(frozen=True)
class Tags:
    """Elements a request names, by local name (lower case), beside the built-in ones: ``ignored`` are copied
    unchanged, ``splitting`` separate sentences as blocks do."""

    ignored: frozenset[str] = frozenset()
    splitting: frozenset[str] = frozenset()


ATOM = "\ufffc"  # OBJECT REPLACEMENT CHARACTER: one kept span in a run's characters
NO_ELEMENT = -1  # a character outside every inline element of its run


@dataclass(frozen=True)
class Element:
    """An inline element of a run, serialized: what opens and closes it; ``parent`` is the index of the
    inline element it sits in (:data:`NO_ELEMENT`: the run's container)."""

    start_tag: str
    end_tag: str
    parent: int = NO_ELEMENT


@dataclass(frozen=True)
class Atom:
    """Something kept verbatim inside a sentence: its output markup and its text content."""

    markup: str
    text: str


@dataclass
class Run:
    """Inline content between block boundaries. ``chars`` holds the text as the model reads it (character
    references decoded), with :data:`ATOM` for each atom; ``owner[i]`` is the innermost inline element of
    character ``i``; ``offsets[i]`` its position in the document's text content."""

    chars: list[str] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    atoms: dict[int, Atom] = field(default_factory=dict)  # position in chars -> the atom there
    elements: list[Element] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # per element: the position in chars where it opens
    escape: bool = False  # the output is markup: text is escaped

    def add_text(self, text: str, owner: int, offset: int) -> None:
        for i, char in enumerate(text):
            if char == ATOM:  # a literal U+FFFC is an atom of itself
                self.add_atom(Atom(char, char), owner, offset + i)
            else:
                self.chars.append(char)
                self.owner.append(owner)
                self.offsets.append(offset + i)

    def add_atom(self, atom: Atom, owner: int, offset: int) -> None:
        self.atoms[len(self.chars)] = atom
        self.chars.append(ATOM)
        self.owner.append(owner)
        self.offsets.append(offset)

    def open_element(self, element: Element) -> int:
        """Add an inline element (opening where the characters end now); its index."""
        self.elements.append(element)
        self.starts.append(len(self.chars))
        return len(self.elements) - 1

    @property
    def text(self) -> str:
        return "".join(self.chars)

    def ancestors(self, element: int) -> list[int]:
        """``element`` and the inline elements around it, outermost first."""
        chain = []
        while element != NO_ELEMENT:
            chain.append(element)
            element = self.elements[element].parent
        return chain[::-1]


@dataclass
class Document:
    """A text read, in order: markup copied (``str``, in the output's syntax), blocks copied with their text
    content (:class:`Atom`) and runs."""

    parts: list[str | Atom | Run] = field(default_factory=list)
    format: TextFormat = TextFormat.PLAIN
    text_length: int = 0  # code points of the text content

    @property
    def runs(self) -> list[Run]:
        return [part for part in self.parts if isinstance(part, Run)]


# Placeholders kept verbatim in any text: format strings ({0}, {name}, {{name}}, %s, %1$s, %(name)s),
# variables ($VAR, ${VAR}), URLs and e-mail addresses.
PLACEHOLDER = re.compile(
    r"\{\{[^{}\n]{1,100}\}\}"
    r"|\{[\w.:,!\-]{0,100}\}"
    r"|%(?:\d{1,2}\$)?(?:\([\w.]{1,100}\))?[-+#0]?\d{0,3}(?:\.\d{1,3})?[sdifuxXeEgGc@]"
    r"|\$\{\w{1,100}\}|\$[A-Za-z_]\w{0,100}"
    r"|(?:https?|ftp)://[^\s<>\"]+[^\s<>\".,;:!?)\]}'\u201d]"
    r"|www\.[^\s<>\"]+[^\s<>\".,;:!?)\]}'\u201d]"
    r"|[\w.+\-]{1,64}@[\w\-]{1,63}(?:\.[\w\-]{1,63})+"
)


def add_text_with_placeholders(run: Run, text: str, owner: int, offset: int, escape_markup=None) -> None:
    """``text`` into ``run``, each placeholder (:data:`PLACEHOLDER`) as an atom; ``escape_markup`` gives an
    atom's output form (markup escaping; plain text: itself)."""
    position = 0
    for match in PLACEHOLDER.finditer(text):
        run.add_text(text[position:match.start()], owner, offset + position)
        value = match.group()
        run.add_atom(Atom(escape_markup(value) if escape_markup else value, value), owner, offset + match.start())
        position = match.end()
    run.add_text(text[position:], owner, offset + position)


def plain_document(text: str) -> Document:
    """A plain text: one run, placeholders as atoms."""
    run = Run()
    add_text_with_placeholders(run, text, NO_ELEMENT, 0)
    return Document(parts=[run], format=TextFormat.PLAIN, text_length=len(text))
