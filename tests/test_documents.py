"""Texts read as documents (:mod:`server.frontend.documents`), without a model: segmentation with the gaps kept, long
sentences cut, placeholders, HTML and XML read safely, and tag transfer through given alignments, on known
answers and as properties over random markup around the dates corpus' sentences."""

from __future__ import annotations

import re
from xml.etree import ElementTree

import html5lib
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.errors import InvalidArgument
from server.frontend.documents.markup import MAX_DEPTH, html_document, xml_document
from server.frontend.documents.model import PLACEHOLDER, Tags, TextFormat
from server.frontend.documents.segmenter import Splitting, cut_to_fit, sentence_spans
from server.frontend.documents.translate import Reading, assemble, plan_text
from server.types import Attention, Hypothesis, Translation, WordAlignment
from training.data import generate_dates_corpus

CORPUS = [pair.source.rstrip(".") for pair in generate_dates_corpus(200, seed=3)]  # the tests add the stops


def translated(source: str, target_words: list[str], aligned: list[int]) -> Translation:
    """A sentence's translation as the engine gives it: ``target_words`` with target word i aligned to source
    word ``aligned[i]``."""
    words = source.split()
    attention = Attention(words, target_words, np.zeros((len(target_words), len(words))),
                          [WordAlignment(j, i) for i, j in enumerate(aligned)], np.zeros((1, 1)))
    return Translation(words, words, [Hypothesis(" ".join(target_words), [], target_words, [], -0.5, [], attention)])


def reversed_words(source: str) -> Translation:
    """A stand-in model that reverses the word order (so every element moves), uppercasing letters."""
    words = source.split()
    return translated(source, [w.upper() for w in reversed(words)], list(range(len(words)))[::-1])


def identity(source: str) -> Translation:
    words = source.split()
    return translated(source, words, list(range(len(words))))


def document(text: str, text_format: TextFormat = TextFormat.PLAIN, model=identity,
             splitting: Splitting = Splitting.SENTENCES, fits=lambda sentence: True) -> Translation:
    plan = plan_text(text, Reading(text_format, splitting, "en"), fits)
    return assemble(plan, [model(s.text) for s in plan.flat], words=True)


DATES = {  # the demo models' word order: the day moves before the month
    "April 25, 2045": (["25.", "April", "2045"], [1, 0, 2]),
    "Tuesday, April 25, 2045": (["Dienstag,", "25.", "April", "2045"], [0, 2, 1, 3]),
}


def dates(source: str) -> Translation:
    words, aligned = DATES[source]
    return translated(source, words, aligned)


# ---- segmentation ----------------------------------------------------------------------------------------


def test_sentences_and_the_gaps_between_them_are_kept_exactly() -> None:
    text = "  Tuesday, April 25, 2045. Monday, May 1, 2046.\n\n\tOne two.\r\nThree  \n"
    result = document(text)
    assert result.hypotheses[0].text == text
    assert [text[a:b] for a, b in (s.source for s in result.segments)] == [
        "Tuesday, April 25, 2045.", "Monday, May 1, 2046.", "One two.", "Three"]
    assert [s.source for s in result.segments] == [s.target for s in result.segments]


def test_splitting_modes() -> None:
    text = "One two\nthree four. Five six.\n\nSeven"
    assert [text[a:b] for a, b in sentence_spans(text, "en", Splitting.SENTENCES)] == [
        "One two", "three four.", "Five six.", "Seven"]
    assert [text[a:b] for a, b in sentence_spans(text, "en", Splitting.NO_NEWLINES)] == [
        "One two\nthree four.", "Five six.", "Seven"]
    assert [text[a:b] for a, b in sentence_spans(text, "en", Splitting.OFF)] == [text]
    plan = plan_text(text, Reading(splitting=Splitting.NO_NEWLINES, language="en"), lambda s: True)
    assert plan.flat[0].text == "One two three four."  # what the model reads: whitespace collapsed


def test_a_sentence_too_long_is_cut_at_clauses_then_words_and_nothing_is_dropped() -> None:
    text = "one two three, four five six seven eight nine ten; eleven twelve"
    fits = lambda sentence: len(sentence.split()) <= 4  # noqa: E731
    spans = cut_to_fit(text, 0, len(text), fits)
    pieces = [text[a:b] for a, b in spans]
    assert pieces == ["one two three,", "four five six seven", "eight nine ten;", "eleven twelve"]
    assert " ".join(pieces).split() == text.split()
    assert all(fits(p) for p in pieces)
    assert document(text, fits=fits).hypotheses[0].text == text


@pytest.mark.parametrize("placeholder", ["{0}", "{name}", "{{user.name}}", "%s", "%1$s", "%(count)d", "%.2f",
                                         "$HOME", "${VAR}", "https://example.com/a?b=1", "www.example.org/x",
                                         "ana.lopez+tag@example.co.uk"])
def test_placeholders_are_kept_verbatim(placeholder: str) -> None:
    assert PLACEHOLDER.fullmatch(placeholder)
    text = f"Tuesday, {placeholder} April 25, 2045"
    result = document(text, model=reversed_words)
    assert result.hypotheses[0].text.count(placeholder) == 1
    assert placeholder not in result.segments[0].translation.hypotheses[0].text  # the model never sees it


@pytest.mark.parametrize("text", ["50% off", "a 100 % rise", "pay $5 now", "{ not one }", "x@y"])
def test_ordinary_text_is_no_placeholder(text: str) -> None:
    assert not PLACEHOLDER.search(text)


# ---- known answers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("April <b>25</b>, 2045", "<b>25.</b> April 2045"),
    ("<i>Tuesday</i>, April 25, 2045", "<i>Dienstag</i>, 25. April 2045"),
    ('<a href="/x?a=1&amp;b=2" title="T &quot;q&quot;">April</a> 25, 2045',
     '25. <a href="/x?a=1&amp;b=2" title="T &quot;q&quot;">April</a> 2045'),
    ("April <img src=a.png> 25, 2045", '<img src="a.png"> 25. April 2045'),
    ("<p>April 25, 2045</p><p><b>Tuesday</b>, April 25, 2045</p>",
     "<p>25. April 2045</p><p><b>Dienstag</b>, 25. April 2045</p>"),
    ("April <code>x &lt; y</code> 25, 2045", "<code>x &lt; y</code> 25. April 2045"),
    ("<span translate=no>April</span> April 25, 2045", "<span translate=\"no\">April</span> 25. April 2045"),
])
def test_html_known_answers(text: str, expected: str) -> None:
    def model(source: str) -> Translation:
        return dates(source) if source in DATES else identity(source)

    assert document(text, TextFormat.HTML, model).hypotheses[0].text == expected


def test_xml_placeholders_of_translation_tools() -> None:
    text = '<g id="1">April</g> <x id="2"/>25, 2045'
    assert document(text, TextFormat.XML, dates).hypotheses[0].text == '<x id="2"/>25. <g id="1">April</g> 2045'


def test_elements_a_request_names_are_copied_or_separate_sentences() -> None:
    text = '<seg>April <ph>&amp;var</ph> 25, 2045</seg><seg>Tuesday</seg>'
    plain = plan_text(text, Reading(TextFormat.XML, Splitting.SENTENCES, "en"), lambda s: True)
    named = plan_text(text, Reading(TextFormat.XML, Splitting.SENTENCES, "en",
                                    tags=Tags(ignored=frozenset({"ph"}), splitting=frozenset({"seg"}))),
                      lambda s: True)
    assert [s.text for s in plain.flat] == ["April &var 25, 2045Tuesday"]  # inline: one run, one sentence
    assert [s.text for s in named.flat] == ["April 25, 2045", "Tuesday"]  # <ph> kept aside, each <seg> a block
    result = assemble(named, [identity(s.text) for s in named.flat], words=True).hypotheses[0].text
    assert result == text


def test_source_words_the_text_does_not_spell_get_spans_inside_it() -> None:
    """Unknown pieces make words such as ``<unk>`` that the text does not spell; found past the text's last
    character, such a word gets an empty span at the end (it indexed past the sentence's characters before)."""
    def unknown(source: str) -> Translation:
        attention = Attention(["<unk>", "<unk>"], ["x"], np.zeros((1, 2)), [WordAlignment(1, 0)], np.zeros((1, 1)))
        best = Hypothesis("x", [], ["x"], [], -0.5, [], attention)
        return Translation(["<unk>", "<unk>"], ["<unk>", "<unk>"], [best])

    result = document("0\u00a8", model=unknown)
    assert [(w.start, w.end) for w in result.document.source_words] == [(0, 2), (2, 2)]
    assert result.document.alignments == [WordAlignment(1, 0)]


def test_an_element_whose_words_reach_no_target_word_stays_empty_beside_its_neighbour() -> None:
    def drop_first(source: str) -> Translation:
        words = source.split()
        return translated(source, words[1:], list(range(1, len(words))))

    result = document("<b>Tuesday</b> April 25", TextFormat.HTML, drop_first).hypotheses[0].text
    assert result == "<b></b>April 25"


def test_spans_count_the_text_content() -> None:
    result = document("<p>April <b>25</b>, 2045.</p> <p>Tuesday, April 25, 2045</p>", TextFormat.HTML,
                      lambda s: dates(s.rstrip(".")) if s.rstrip(".") in DATES else identity(s))
    out = content(result.hypotheses[0].text)
    for segment in result.segments:
        a, b = segment.target
        assert out[a:b] == segment.translation.hypotheses[0].text
    assert result.document is not None
    for word in result.document.target_words:
        assert out[word.start:word.end] == word.text


# ---- safe parsing ----------------------------------------------------------------------------------------


def test_malformed_xml_is_invalid_argument_with_line_and_column() -> None:
    with pytest.raises(InvalidArgument, match=r"texts\[0\] is not well-formed XML: .*\(line 2, column \d+\)"):
        xml_document("<a>one\n<b>two</a>", "texts[0]")


@pytest.mark.parametrize("text", [
    '<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]><a>&lol2;</a>',
    '<!DOCTYPE a SYSTEM "file:///etc/passwd"><a>x</a>',
    '<a>&xxe;</a>',
])
def test_xml_without_dtds_or_entities(text: str) -> None:
    with pytest.raises(InvalidArgument):
        xml_document(text)


@pytest.mark.parametrize("reader", [html_document, xml_document])
def test_nesting_deeper_than_the_limit_is_refused(reader) -> None:
    deep = "<b>" * (MAX_DEPTH + 5) + "x" + "</b>" * (MAX_DEPTH + 5)
    with pytest.raises(InvalidArgument, match="deeper than"):
        reader(deep)


# ---- properties ------------------------------------------------------------------------------------------

INLINE = ["b", "i", "em", "span", "u"]  # not "a": HTML parsers take an <a> out of an <a>
BLOCK = ["p", "div", "li"]


@st.composite
def markup(draw: st.DrawFn) -> str:
    """A random HTML fragment of corpus sentences with inline elements around random word ranges, atoms
    (placeholders, images, code) between words, and blocks around groups of sentences."""
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        sentences = []
        for _ in range(draw(st.integers(1, 3))):
            words = draw(st.sampled_from(CORPUS)).split()
            pieces = list(words)
            for _ in range(draw(st.integers(0, 3))):
                start = draw(st.integers(0, len(pieces) - 1))
                end = draw(st.integers(start, len(pieces) - 1))
                tag = draw(st.sampled_from(INLINE))
                attribute = draw(st.sampled_from(["", ' class="c"', ' title="a &amp; b"']))
                pieces[start] = f"<{tag}{attribute}>{pieces[start]}"
                pieces[end] = f"{pieces[end]}</{tag}>"
            if draw(st.booleans()):
                pieces.insert(draw(st.integers(1, len(pieces))),
                              draw(st.sampled_from(["{0}", "%1$s", '<img src="x.png">', "<code>a&lt;b</code>"])))
            sentences.append(" ".join(pieces) + ".")
        block = draw(st.sampled_from(BLOCK))
        blocks.append(f"<{block}>" + draw(st.sampled_from([" ", "\n", "  "])).join(sentences) + f"</{block}>")
    return "\n".join(blocks)


def tree(text: str) -> list:
    """An HTML fragment's elements as a canonical tree: (tag, attributes, children) with children sorted,
    so inline siblings may change order as the words do."""
    root = html5lib.parseFragment(text, treebuilder="etree", namespaceHTMLElements=False)

    def shape(node: ElementTree.Element) -> tuple:
        return (str(node.tag), tuple(sorted(node.attrib.items())), tuple(sorted(shape(c) for c in node)))

    return sorted(shape(child) for child in root)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(markup(), st.sampled_from([identity, reversed_words]))
def test_markup_survives_translation(text: str, model) -> None:
    result = document(text, TextFormat.HTML, model)
    out = result.hypotheses[0].text
    assert tree(out) == tree(text)  # the same elements, nesting and attributes
    assert not re.search(r"\w<[^>]*>\w", out.replace("<img", " <img"))  # no tag boundary inside a word
    for placeholder in ("{0}", "%1$s"):
        assert out.count(placeholder) == text.count(placeholder)
    source_words = [w for s in result.segments for w in s.translation.source_words]
    assert len(result.segments) == len(re.findall(r"\.(?=\s|<|$)", text))  # no sentence dropped
    assert sorted(w.upper() for w in source_words) == sorted(
        w.upper() for s in result.segments for w in s.translation.hypotheses[0].words)
    if model is identity:  # the same text content, character for character
        assert content(out) == content(text)


def content(text: str) -> str:
    return "".join(html5lib.parseFragment(text, treebuilder="etree", namespaceHTMLElements=False).itertext())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(CORPUS), min_size=1, max_size=6),
       st.lists(st.sampled_from([". ", ".\n", ".\n\n", ".  ", ".\t"]), min_size=6, max_size=6),
       st.sampled_from(["", " ", "\n", "  \n"]))
def test_plain_text_gaps_and_sentences_are_kept(sentences: list[str], separators: list[str], edge: str) -> None:
    text = edge + "".join(s + separators[i] for i, s in enumerate(sentences)) + edge
    result = document(text)
    assert result.hypotheses[0].text == text
    assert len(result.segments) == len(sentences)
    reversed_result = document(text, model=reversed_words)
    out = reversed_result.hypotheses[0].text
    assert re.sub(r"\S", "", out) == re.sub(r"\S", "", text)  # every gap and newline where it was
