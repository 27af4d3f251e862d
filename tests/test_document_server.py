"""Documents through a live server with the small dates models (both architectures), whose word order
changes: known answers for markup and placeholders, paragraphs with their separators, sentences batched with
other requests and under the request's deadline, limits, the HTTP face, metrics, the command line, and a fuzz
run of random and malformed markup that the server answers and survives."""

from __future__ import annotations

import io
import json
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmt.cli import main as nmt_main
from server.config import ServerConfig
from server.protos import pb2
from tests.harness import ServerHarness
from tests.test_server import default_loader

TRANSFORMER, BAHDANAU = "dates-transformer", "dates-bahdanau"
HTML, XML, PLAIN = pb2.TEXT_FORMAT_HTML, pb2.TEXT_FORMAT_XML, pb2.TEXT_FORMAT_PLAIN
DATES = ["Tuesday, April 25, 2045", "Monday, May 1, 2046", "Friday, March 3, 1999", "Sunday, June 7, 2020",
         "Saturday, July 8, 2023", "Wednesday, August 9, 2000", "Thursday, September 10, 1987",
         "Tuesday, October 11, 2011", "Monday, November 12, 2012", "Friday, December 13, 2013"]


@pytest.fixture(scope="module")
def server(dates_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHarness]:
    repository = tmp_path_factory.mktemp("documents") / "models"
    for arch, version_dir in dates_models.items():
        shutil.copytree(version_dir, repository / f"dates-{arch}" / "1")
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="127.0.0.1:0",
                          model_repository=str(repository), default_model=TRANSFORMER, provider="cpu",
                          intra_op_threads=1, max_tokens=24, cache_mb=0).validate()
    harness = ServerHarness(config, default_loader())
    yield harness
    harness.close()


def translate(server: ServerHarness, texts: list[str], model: str = TRANSFORMER, **fields) -> pb2.TranslateResponse:
    options = fields.pop("options", pb2.DecodingOptions(beam_size=4))
    return server.stub.Translate(pb2.TranslateRequest(texts=texts, model=model, options=options, **fields),
                                 timeout=120)


def text_of(response: pb2.TranslateResponse) -> list[str]:
    return [t.hypotheses[0].text for t in response.translations]


@pytest.mark.parametrize(("text", "expected"), [
    ("April <b>25</b>, 2045", "<b>25.</b> April 2045"),
    ("<i>Tuesday</i>, April 25, 2045", "<i>Dienstag</i>, 25. April 2045"),
])
def test_inline_markup_follows_the_words(server: ServerHarness, text: str, expected: str) -> None:
    assert text_of(translate(server, [text], text_format=HTML)) == [expected]


def test_a_paragraph_of_ten_dates_keeps_its_separators(server: ServerHarness) -> None:
    separators = [" ", "\n", " ", "\n\n", "  ", "\n", " ", "\t", "\n", "\n"]
    text = "".join(f"{date}.{gap}" for date, gap in zip(DATES, separators, strict=True))
    alone = text_of(translate(server, [f"{date}." for date in DATES]))  # each sentence as a text of its own
    [result] = translate(server, [text]).translations
    assert len(result.segments) == 10
    got = result.hypotheses[0].text
    for segment, date, own in zip(result.segments, DATES, alone, strict=True):
        assert text[segment.source_start:segment.source_end] == f"{date}."
        assert got[segment.target_start:segment.target_end] == own
    ends = [(s.source_end, s.target_end) for s in result.segments]
    starts = [(s.source_start, s.target_start) for s in result.segments[1:]] + [(len(text), len(got))]
    assert [got[t:u] for (_, t), (_, u) in zip(ends, starts, strict=True)] == separators


@pytest.mark.parametrize("placeholder", ["{0}", "%1$s", "{{name}}", "https://example.com/x"])
def test_placeholders_are_kept(server: ServerHarness, placeholder: str) -> None:
    [out] = text_of(translate(server, [f"Tuesday, April 25, {placeholder} 2045"]))
    assert out.count(placeholder) == 1
    assert out.replace(placeholder, "").split() == ["Dienstag,", "25.", "April", "2045"]


@pytest.mark.parametrize("model", [TRANSFORMER, BAHDANAU])
def test_one_sentence_gets_what_it_gets_without_documents(server: ServerHarness, model: str) -> None:
    options = pb2.DecodingOptions(beam_size=4, num_hypotheses=2, return_scores=True, return_attention=True)
    request = pb2.TranslateRequest(texts=[DATES[0]], model=model, options=options)
    [document] = server.stub.Translate(request, timeout=60).translations
    final = list(server.stub.TranslateStreaming(request, timeout=60))[-1].final  # one model input, as before
    [alone] = final.translations
    assert list(document.hypotheses) == list(alone.hypotheses)
    assert list(document.source_tokens) == list(alone.source_tokens)
    [segment] = document.segments
    assert (segment.source_start, segment.source_end) == (0, len(DATES[0]))
    assert not segment.hypotheses  # they are the translation's own


def test_segments_carry_their_n_best_and_the_document_its_alignments(server: ServerHarness) -> None:
    text = f"{DATES[0]}. {DATES[1]}."
    options = pb2.DecodingOptions(beam_size=4, num_hypotheses=3, return_scores=True, return_attention=True)
    [result] = translate(server, [text], options=options).translations
    assert len(result.hypotheses) == 1 and len(result.segments) == 2
    out = result.hypotheses[0].text
    for segment in result.segments:
        assert len(segment.hypotheses) == 3
        assert out[segment.target_start:segment.target_end] == segment.hypotheses[0].text
        assert segment.hypotheses[0].attention.target_length == len(segment.hypotheses[0].tokens)
    assert [w.text for w in result.source_words] == text.split()
    for word in result.source_words:
        assert text[word.start:word.end] == word.text
    for word in result.target_words:
        assert out[word.start:word.end] == word.text
    assert len(result.word_alignments) == len(result.target_words)
    # every alignment stays inside its sentence
    for pair in result.word_alignments:
        assert result.source_words[pair.source_index].segment == result.target_words[pair.target_index].segment


def test_without_attention_no_alignments_are_returned(server: ServerHarness) -> None:
    [result] = translate(server, ["<b>Tuesday</b>, April 25, 2045. Monday, May 1, 2046."], text_format=HTML,
                         options=pb2.DecodingOptions(beam_size=1)).translations
    assert not result.source_words and not result.word_alignments
    assert not any(h.HasField("attention") for s in result.segments for h in s.hypotheses)
    assert result.hypotheses[0].text.startswith("<b>Dienstag</b>, ")


def test_xml_with_translation_tool_placeholders(server: ServerHarness) -> None:
    [out] = text_of(translate(server, ['<g id="1">April</g> 25, <x id="2"/>2045'], text_format=XML))
    assert out.count('<x id="2"/>') == 1 and out.count('<g id="1">') == 1
    assert "25." in out


def test_a_sentence_longer_than_the_model_takes_is_cut_not_truncated(server: ServerHarness) -> None:
    text = ", ".join(DATES[:4])  # one sentence of more than max_tokens (24) tokens
    [result] = translate(server, [text]).translations
    assert len(result.segments) > 1
    covered = set()
    for segment in result.segments:
        covered.update(range(segment.source_start, segment.source_end))
        assert segment.hypotheses[0].text  # every piece translated
    assert all(i in covered for i, char in enumerate(text) if not char.isspace() and char != ",")


@pytest.mark.parametrize(("fields", "message"), [
    ({"text_format": HTML, "target_prefixes": ["Dienstag"]}, "target_prefixes applies to one sentence"),
    ({"sentence_splitting": pb2.SPLIT_SENTENCES, "target_prefixes": ["Dienstag"]}, "one sentence of plain text"),
    ({"text_format": XML, "texts": ["<a>one<b>two</a>"]}, r"not well-formed XML: .*\(line 1, column"),
    ({"text_format": XML, "texts": ['<!DOCTYPE a [<!ENTITY x "y">]><a>&x;</a>']}, "DTDs"),
    ({"texts": ["one. " * 600]}, "max_sentences"),
    ({"texts": ["x" * 60000, "y" * 60000]}, "max_request_chars"),
])
def test_what_has_no_meaning_is_invalid_argument(server: ServerHarness, fields: dict, message: str) -> None:
    texts = fields.pop("texts", [DATES[0]])
    with pytest.raises(grpc.RpcError) as error:
        translate(server, texts, **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.value.details()), error.value.details()


def test_the_deadline_covers_every_sentence(server: ServerHarness) -> None:
    text = " ".join(f"{d}." for d in DATES * 8)
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Translate(pb2.TranslateRequest(texts=[text], options=pb2.DecodingOptions(beam_size=4)),
                              timeout=0.05)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert text_of(translate(server, [DATES[0]])) == ["Dienstag, 25. April 2045"]  # and the server serves on


def test_http_face_reads_the_same_fields(server: ServerHarness) -> None:
    body = {"texts": ["<p>April <b>25</b>, 2045</p>"], "model": TRANSFORMER, "textFormat": "TEXT_FORMAT_HTML",
            "sentenceSplitting": "SPLIT_NO_NEWLINES", "options": {"beamSize": 4}}
    status, reply = post(server, body)
    assert status == 200, reply
    translation = reply["translations"][0]
    assert translation["hypotheses"][0]["text"] == "<p><b>25.</b> April 2045</p>"
    assert translation["segments"][0]["sourceEnd"] == len("April 25, 2045")
    status, reply = post(server, {**body, "textFormat": "TEXT_FORMAT_XML", "texts": ["<a>"]})
    assert status == 400 and "well-formed" in reply["message"]


def post(server: ServerHarness, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}/v1/translate",
                                     data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_sentences_per_text_are_counted_by_format(server: ServerHarness) -> None:
    before = server.metric("nmt_text_sentences_count", {"model": TRANSFORMER, "format": "html"})
    translate(server, ["<p>April 25, 2045.</p><p>May 1, 2046.</p>", "<b>x</b>"], text_format=HTML)
    assert server.metric("nmt_text_sentences_count", {"model": TRANSFORMER, "format": "html"}) == before + 2
    assert server.metric("nmt_text_sentences_sum", {"model": TRANSFORMER, "format": "html"}) >= 3


def test_the_command_line_translates_a_file(server: ServerHarness, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    page = tmp_path / "page.html"
    page.write_text("<h1>April <b>25</b>, 2045</h1>\n<p><i>Tuesday</i>, April 25, 2045</p>\n", encoding="utf-8")
    assert nmt_main(["translate", "--server", server.address, "--model", TRANSFORMER, "--beam-size", "4",
                     "--file", str(page), "--format", "html"]) == 0
    assert capsys.readouterr().out == "<h1><b>25.</b> April 2045</h1>\n<p><i>Dienstag</i>, 25. April 2045</p>\n"
    stdin = io.StringIO(f"{DATES[0]}.\n\n{DATES[1]}.\n")
    monkey = pytest.MonkeyPatch()
    monkey.setattr("sys.stdin", stdin)
    try:
        assert nmt_main(["translate", "--server", server.address, "--model", TRANSFORMER, "--format", "text",
                         "--json"]) == 0
    finally:
        monkey.undo()
    line = json.loads(capsys.readouterr().out)
    assert len(line["segments"]) == 2 and line["hypotheses"][0]["text"].count("\n") == 3


FUZZ_PIECES = ["<b>", "</b>", "<i>", "<p>", "</p>", "<br>", "<img src=x>", "<!--c-->", "&amp;", "&lt;", "&#x41;",
               "&bogus;", "<", ">", "]]>", "<![CDATA[x]]>", '<a href="', '">', "<x/>", "<?pi x?>", "{0}", "%s",
               "April", " 25,", " 2045", ". ", "\n", "<script>a<b</script>", '<div translate="no">']


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FUZZ_PIECES), min_size=1, max_size=30), st.sampled_from([HTML, XML, PLAIN]))
def test_fuzzed_markup_gets_an_answer_or_invalid_argument(server: ServerHarness, pieces: list[str],
                                                          text_format: int) -> None:
    text = "".join(pieces)
    try:
        response = translate(server, [text], text_format=text_format, options=pb2.DecodingOptions(beam_size=1))
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (text, error.details())
        return
    assert len(response.translations) == 1


@pytest.mark.parametrize("text", [
    "<b>" * 5000 + "April" + "</b>" * 5000,
    '<img alt="' + "a" * 15000 + '">April 25, 2045',
    "<p>April 25, 2045" * 300,
    '<?xml version="1.0"?><!DOCTYPE r [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;">]><r>&b;</r>',
], ids=["deep nesting", "a huge attribute", "unclosed tags", "an entity bomb"])
@pytest.mark.parametrize("text_format", [HTML, XML])
def test_hostile_markup_is_answered_and_the_server_stays_up(server: ServerHarness, text: str,
                                                            text_format: int) -> None:
    try:
        translate(server, [text], text_format=text_format, options=pb2.DecodingOptions(beam_size=1))
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert text_of(translate(server, [DATES[0]])) == ["Dienstag, 25. April 2045"]


@pytest.mark.parametrize("beam", [1, 4])
def test_a_document_streams_sentence_after_sentence(server: ServerHarness, beam: int) -> None:
    text = f"  {DATES[0]}.\n{DATES[1]}, {{0}} ok.\n\n{DATES[2]}.  "
    request = pb2.TranslateRequest(texts=[text], model=TRANSFORMER,
                                   options=pb2.DecodingOptions(beam_size=beam, return_scores=True))
    deltas = list(server.stub.TranslateStreaming(request, timeout=60))
    [expected] = server.stub.Translate(request, timeout=60).translations
    final = deltas[-1].final.translations[0]
    assert [d.HasField("final") for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert list(final.hypotheses) == list(expected.hypotheses)
    assert "".join(d.text for d in deltas) == expected.hypotheses[0].text  # gaps, sentences, the placeholder
    assert deltas[0].text == "  " and deltas[-1].text.endswith("  ")  # the last one: the rest and the gap
    first = expected.segments[0]
    streamed = "".join(d.text for d in deltas[1:])
    assert streamed.startswith(expected.hypotheses[0].text[first.target_start:first.target_end])
    if beam == 1:  # the first sentence word by word
        assert len([d for d in deltas if d.text.strip()]) > 3


def test_a_stream_of_markup_is_invalid_argument(server: ServerHarness) -> None:
    request = pb2.TranslateRequest(texts=["<b>April</b> 25, 2045"], model=TRANSFORMER, text_format=HTML)
    with pytest.raises(grpc.RpcError) as error:
        list(server.stub.TranslateStreaming(request, timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "plain text" in error.value.details()
