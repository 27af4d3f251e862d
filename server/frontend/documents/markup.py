"""HTML and XML texts read into a :class:`~server.frontend.documents.model.Document`.

HTML is parsed by ``html5lib`` (MIT), the WHATWG algorithm browsers use: every input parses, a fragment as a
fragment and a text that starts with ``<!DOCTYPE`` or ``<html`` as a document. XML is parsed by ``lxml``
(BSD) with a parser that reads no DTD, resolves no entities and opens no network or file; a text with a
document type declaration is refused, and a malformed one is INVALID_ARGUMENT with its line and column. A
fragment (text and elements side by side, as translation tools send ``Hello <x id="1"/> world``) is read
inside a root of our own that the output leaves out.

Block elements (:data:`BLOCKS`, by local name, so XHTML reads as HTML) and ``br`` separate runs and stay
where they are; so does an inline element that holds a block. Elements that are not translated
(:func:`untranslatable`), comments, processing instructions, void elements and, in XML, empty elements are
atoms: copied as they are, placed through the alignments when inside a sentence. Attributes are copied
unchanged (``alt``, ``title`` and ``placeholder`` are not translated). Text is decoded for the model and
escaped again in the output. Nesting deeper than :data:`MAX_DEPTH` is INVALID_ARGUMENT.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html import escape
from typing import Any
from xml.etree import ElementTree

import html5lib
from lxml import etree

from server.errors import InvalidArgument
from server.frontend.documents.model import (
    NO_ELEMENT,
    Atom,
    Document,
    Element,
    Run,
    Tags,
    TextFormat,
    add_text_with_placeholders,
)

MAX_DEPTH = 100
BLOCKS = frozenset({
    "address", "article", "aside", "blockquote", "body", "br", "caption", "center", "dd", "details", "dialog",
    "dir", "div", "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5",
    "h6", "head", "header", "hgroup", "hr", "html", "legend", "li", "main", "menu", "nav", "ol", "optgroup",
    "option", "p", "section", "summary", "table", "tbody", "td", "tfoot", "th", "thead", "title", "tr", "ul",
})
UNTRANSLATED = frozenset({"code", "pre", "kbd", "samp", "var", "script", "style", "noscript", "template", "svg",
                          "math", "textarea"})
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
                  "track", "wbr"})
RAW_TEXT = frozenset({"script", "style"})  # their text is written as it is
_DOCUMENT = re.compile(r"\s*(<!--.*?-->\s*)*<(!doctype|html[\s>])", re.IGNORECASE | re.DOTALL)
_XML_DECLARATION = re.compile(r"\s*<\?xml[^>]*\?>")
_ROOT = "nmt-fragment"


def local_name(tag: str) -> str:
    return tag.rsplit("}", 1)[-1].lower() if isinstance(tag, str) else ""


def untranslatable(tag: str, attributes: dict[str, str], ignored: frozenset[str] = frozenset()) -> bool:
    """Elements copied unchanged: code and the like, those the request names (``ignored``), ``translate="no"``
    (any namespace, as ITS's ``its:translate``) and ``class="notranslate"``."""
    if local_name(tag) in UNTRANSLATED or local_name(tag) in ignored:
        return True
    for key, value in attributes.items():
        if local_name(key) == "translate" and value.strip().lower() == "no":
            return True
    return "notranslate" in attributes.get("class", "").split()


class _Builder:
    """Walks a parsed tree into a Document: structural elements verbatim, runs between them."""

    def __init__(self, document: Document, serializer: _Serializer, tags: Tags) -> None:
        self.document = document
        self.serialize = serializer
        self.tags = tags
        self.run: Run | None = None
        self.offset = 0  # text content code points so far

    # -- output --------------------------------------------------------------------------------------------
    def verbatim(self, markup: str) -> None:
        self.flush()
        self.document.parts.append(markup)

    def current(self) -> Run:
        if self.run is None:
            self.run = Run(escape=True)
        return self.run

    def flush(self) -> None:
        if self.run is not None and self.run.chars:
            self.document.parts.append(self.run)
        self.run = None

    def text(self, value: str | None, owner: int) -> None:
        if value:
            add_text_with_placeholders(self.current(), value, owner, self.offset, escape_markup=_escape_text)
            self.offset += len(value)

    def atom(self, node: Any, owner: int) -> None:
        markup, content = self.serialize.whole(node), self.serialize.content(node)
        self.current().add_atom(Atom(markup, content), owner, self.offset)
        self.offset += len(content)

    # -- walking -------------------------------------------------------------------------------------------
    def structural(self, node: Any, blocks: set[int], own_tags: bool = True) -> None:
        if own_tags:
            self.verbatim(self.serialize.start(node))
        self.text(node.text, NO_ELEMENT)
        for child in node:
            self.child(child, NO_ELEMENT, blocks)
            self.text(child.tail, NO_ELEMENT)
        if own_tags:
            self.verbatim(self.serialize.end(node))

    def child(self, node: Any, owner: int, blocks: set[int]) -> None:
        kind = self.serialize.kind(node)
        if kind != "element" or untranslatable(node.tag, dict(node.attrib), self.tags.ignored):
            if kind == "element" and id(node) in blocks:  # a block of code: beside the runs, as it is
                self.flush()
                content = self.serialize.content(node)
                self.document.parts.append(Atom(self.serialize.whole(node), content))
                self.offset += len(content)
            else:
                self.atom(node, owner)
        elif id(node) in blocks:
            if owner != NO_ELEMENT:  # cannot happen: an element holding a block is a block itself
                raise AssertionError("block inside an inline element")
            self.structural(node, blocks)
        elif self.serialize.is_atom(node):
            self.atom(node, owner)
        else:
            run = self.current()
            index = run.open_element(Element(self.serialize.start(node), self.serialize.end(node), owner))
            self.text(node.text, index)
            for grandchild in node:
                self.child(grandchild, index, blocks)
                self.text(grandchild.tail, index)


def _escape_text(value: str) -> str:
    return escape(value, quote=False)


class _Serializer:
    """Markup of one tree flavour (html5lib's ElementTree, lxml's)."""

    def kind(self, node: Any) -> str:
        raise NotImplementedError

    def start(self, node: Any) -> str:
        raise NotImplementedError

    def end(self, node: Any) -> str:
        raise NotImplementedError

    def is_atom(self, node: Any) -> bool:
        raise NotImplementedError

    def whole(self, node: Any) -> str:
        """The node and everything inside it (not its tail)."""
        kind = self.kind(node)
        if kind == "comment":
            return f"<!--{node.text or ''}-->"
        if kind == "pi":
            return self.pi(node)
        if self.is_void(node):
            return self.start(node)
        raw = local_name(node.tag) in RAW_TEXT
        parts = [self.start(node), (node.text or "") if raw else _escape_text(node.text or "")]
        for child in node:
            parts.append(self.whole(child))
            parts.append((child.tail or "") if raw else _escape_text(child.tail or ""))
        parts.append(self.end(node))
        return "".join(parts)

    def content(self, node: Any) -> str:
        """The node's text content (comments and processing instructions have none)."""
        if self.kind(node) != "element":
            return ""
        return "".join(_texts(node, self))

    def is_void(self, node: Any) -> bool:
        return False

    def pi(self, node: Any) -> str:
        return ""


def _texts(node: Any, serializer: _Serializer) -> Iterator[str]:
    if node.text:
        yield node.text
    for child in node:
        if serializer.kind(child) == "element":
            yield from _texts(child, serializer)
        if child.tail:
            yield child.tail


class _HtmlSerializer(_Serializer):
    def kind(self, node: Any) -> str:
        if node.tag is ElementTree.Comment:
            return "comment"
        if node.tag is ElementTree.ProcessingInstruction:
            return "pi"
        return "element" if isinstance(node.tag, str) else "other"

    def start(self, node: Any) -> str:
        attributes = "".join(f' {_html_name(k)}="{escape(v, quote=True)}"' for k, v in node.attrib.items())
        return f"<{node.tag}{attributes}>"

    def end(self, node: Any) -> str:
        return "" if self.is_void(node) else f"</{node.tag}>"

    def is_void(self, node: Any) -> bool:
        return local_name(node.tag) in VOID

    def is_atom(self, node: Any) -> bool:
        return self.is_void(node)


def _html_name(name: str) -> str:
    """An html5lib attribute name (foreign attributes come as ``{namespace}name``) in HTML syntax."""
    if name.startswith("{"):
        namespace, local = name[1:].split("}", 1)
        prefix = {"http://www.w3.org/1999/xlink": "xlink", "http://www.w3.org/XML/1998/namespace": "xml",
                  "http://www.w3.org/2000/xmlns/": "xmlns"}.get(namespace)
        return f"{prefix}:{local}" if prefix and local != "xmlns" else local
    return name


class _XmlSerializer(_Serializer):
    def kind(self, node: Any) -> str:
        if isinstance(node, etree._Comment):
            return "comment"
        if isinstance(node, etree._ProcessingInstruction):
            return "pi"
        if isinstance(node, etree._Entity):
            return "other"
        return "element"

    def pi(self, node: Any) -> str:
        return f"<?{node.target} {node.text or ''}?>" if node.text else f"<?{node.target}?>"

    def _qname(self, node: Any, name: str) -> str:
        qname = etree.QName(name)
        if qname.namespace is None:
            return qname.localname
        if qname.namespace == "http://www.w3.org/XML/1998/namespace":
            return f"xml:{qname.localname}"
        for prefix, uri in node.nsmap.items():
            if uri == qname.namespace and (prefix or name == node.tag):
                return f"{prefix}:{qname.localname}" if prefix else qname.localname
        return qname.localname

    def start(self, node: Any, *, empty: bool = False) -> str:
        parent = node.getparent()
        inherited = parent.nsmap if parent is not None and local_name(parent.tag) != _ROOT else {}
        declarations = "".join(
            f' xmlns{":" + prefix if prefix else ""}="{escape(uri, quote=True)}"'
            for prefix, uri in node.nsmap.items() if inherited.get(prefix) != uri)
        attributes = "".join(f' {self._qname(node, k)}="{_escape_attribute(v)}"' for k, v in node.attrib.items())
        return f"<{self._qname(node, node.tag)}{declarations}{attributes}{'/' if empty else ''}>"

    def end(self, node: Any) -> str:
        return f"</{self._qname(node, node.tag)}>"

    def is_atom(self, node: Any) -> bool:
        return len(node) == 0 and not node.text

    def whole(self, node: Any) -> str:
        if self.kind(node) == "element" and self.is_atom(node):
            return self.start(node, empty=True)
        return super().whole(node)


def _escape_attribute(value: str) -> str:
    return escape(value, quote=True).replace("\n", "&#10;").replace("\t", "&#9;").replace("\r", "&#13;")


def _depth(root: Any) -> int:
    deepest, stack = 0, [(root, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        stack.extend((child, depth + 1) for child in node)
    return deepest


def _blocks(root: Any, serializer: _Serializer, splitting: frozenset[str] = frozenset()) -> set[int]:
    """Ids of the elements that are blocks: by name (built in, or ``splitting``), or holding a block."""
    blocks: set[int] = set()

    def visit(node: Any) -> bool:
        inner = False
        for child in node:
            if serializer.kind(child) == "element":
                inner = visit(child) or inner
        if inner or local_name(node.tag) in BLOCKS or local_name(node.tag) in splitting:
            blocks.add(id(node))
            return True
        return False

    visit(root)
    return blocks


def html_document(text: str, where: str = "text", tags: Tags = Tags()) -> Document:  # noqa: B008 - frozen
    """An HTML fragment or document (see the module docstring)."""
    serializer = _HtmlSerializer()
    whole = _DOCUMENT.match(text) is not None
    if whole:
        root = html5lib.parse(text, treebuilder="etree", namespaceHTMLElements=False)
    else:
        root = html5lib.parseFragment(text, treebuilder="etree", namespaceHTMLElements=False)
    _check_depth(root, where)
    document = Document(format=TextFormat.HTML)
    builder = _Builder(document, serializer, tags)
    blocks = _blocks(root, serializer, tags.splitting) | {id(root)}
    if whole and re.match(r"\s*(<!--.*?-->\s*)*<!doctype", text, re.IGNORECASE | re.DOTALL):
        builder.verbatim("<!DOCTYPE html>")
    builder.structural(root, blocks, own_tags=whole)
    builder.flush()
    document.text_length = builder.offset
    return document


def xml_document(text: str, where: str = "text", tags: Tags = Tags()) -> Document:  # noqa: B008 - frozen
    """An XML document or fragment (see the module docstring)."""
    declaration = _XML_DECLARATION.match(text)
    body = text[declaration.end():] if declaration else text
    if re.search(r"<!DOCTYPE", body, re.IGNORECASE) or re.search(r"<!ENTITY", body, re.IGNORECASE):
        raise InvalidArgument(f"{where} has a document type declaration: DTDs and entity declarations are not "
                              "accepted in XML to translate")
    opening = f"<{_ROOT}>"
    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, dtd_validation=False,
                             huge_tree=False, remove_blank_text=False, remove_comments=False, remove_pis=False)
    try:
        root = etree.fromstring(f"{opening}{body}</{_ROOT}>".encode(), parser)
    except etree.XMLSyntaxError as error:
        line, column = error.position if hasattr(error, "position") else (error.lineno, error.offset)
        if line == 1:
            column -= len(opening)
        if declaration:
            line += declaration.group().count("\n")
        message = re.sub(r",? line \d+, column \d+$", "", error.msg or str(error)).strip()
        raise InvalidArgument(f"{where} is not well-formed XML: {message} (line {line}, column {max(column, 1)})") \
            from None
    _check_depth(root, where)
    serializer = _XmlSerializer()
    document = Document(format=TextFormat.XML)
    builder = _Builder(document, serializer, tags)
    if declaration:
        builder.verbatim(declaration.group())
    builder.structural(root, _blocks(root, serializer, tags.splitting) | {id(root)}, own_tags=False)
    builder.flush()
    document.text_length = builder.offset
    return document


def _check_depth(root: Any, where: str) -> None:
    if _depth(root) > MAX_DEPTH:
        raise InvalidArgument(f"{where} nests elements deeper than {MAX_DEPTH} levels")
