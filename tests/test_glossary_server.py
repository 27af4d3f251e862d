"""Glossaries through a live server with the small dates models: a term the model would not choose is written
and aligned, sentences without terms are untouched, do-not-translate terms, markup, the stored glossaries'
API over gRPC and HTTP with files an operator edits, the errors, the metrics and the command line."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from nmt.cli import main as nmt_main
from server.config import ServerConfig
from server.frontend.auth import Authenticator
from server.protos import pb2
from tests.harness import ServerHarness
from tests.test_server import default_loader

TRANSFORMER, BAHDANAU = "dates-transformer", "dates-bahdanau"
APRIL = [pb2.GlossaryEntry(source="April", target="Ostermond")]


@pytest.fixture(scope="module")
def glossary_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("glossaries")


@pytest.fixture(scope="module")
def server(dates_models: dict[str, Path], glossary_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHarness]:
    repository = tmp_path_factory.mktemp("glossary-models") / "models"
    for arch, version_dir in dates_models.items():
        shutil.copytree(version_dir, repository / f"dates-{arch}" / "1")
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="127.0.0.1:0",
                          model_repository=str(repository), default_model=TRANSFORMER, provider="cpu",
                          intra_op_threads=1, cache_mb=0, glossary_dir=str(glossary_dir)).validate()
    harness = ServerHarness(config, default_loader())
    yield harness
    harness.close()


def translate(server: ServerHarness, texts: list[str], model: str = TRANSFORMER, beam: int = 4,
              **fields) -> pb2.TranslateResponse:
    options = fields.pop("options", pb2.DecodingOptions(beam_size=beam, num_hypotheses=min(beam, 2),
                                                        return_scores=True))
    return server.stub.Translate(pb2.TranslateRequest(texts=texts, model=model, options=options, **fields),
                                 timeout=120)


def http(server: ServerHarness, verb: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}{path}", method=verb,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("model", [TRANSFORMER, BAHDANAU])
def test_a_term_the_model_would_not_choose_is_written_and_aligned(server, model):
    """"Ostermond" is no word these small models know (each of its pieces costs them several nats, and after it
    they lose their way): the search still writes it in every hypothesis, where the model attends to "April",
    after the words it translates before it."""
    plain = translate(server, ["Tuesday, April 25, 2045"], model)
    assert plain.translations[0].hypotheses[0].text == "Dienstag, 25. April 2045"
    response = translate(server, ["Tuesday, April 25, 2045"], model, glossary=APRIL,
                         options=pb2.DecodingOptions(beam_size=4, num_hypotheses=2, return_attention=True))
    [translation] = response.translations
    for hypothesis in translation.hypotheses:  # every hypothesis holds the term
        assert "Ostermond" in hypothesis.text and not hypothesis.terms_missed
    assert translation.hypotheses[0].text.startswith("Dienstag, 25.")
    assert [(t.source, t.target) for t in translation.terms] == [("April", "Ostermond")]


def test_sentences_without_a_term_decode_exactly_as_without_a_glossary(server):
    texts = ["Monday, May 1, 2046", "Tuesday, April 25, 2045", "Friday, March 3, 1999"]
    plain = translate(server, texts)
    glossed = translate(server, texts, glossary=APRIL)
    for i in (0, 2):
        a, b = plain.translations[i], glossed.translations[i]
        assert [(h.text, list(h.subword_tokens), list(h.token_scores), h.score) for h in a.hypotheses] == \
            [(h.text, list(h.subword_tokens), list(h.token_scores), h.score) for h in b.hypotheses]
        assert not b.terms
    assert "Ostermond" in glossed.translations[1].hypotheses[0].text


@pytest.mark.parametrize("beam", [1, 4])
def test_a_stream_with_a_glossary_joins_to_what_translate_returns(server, beam):
    """TranslateStreaming under a glossary: the words come as the beams agree on them (the term among them),
    and the deltas join to Translate's best hypothesis, which holds the term; a greedy request searches the
    widened beam in both."""
    request = pb2.TranslateRequest(texts=["Tuesday, April 25, 2045"], model=TRANSFORMER,
                                   options=pb2.DecodingOptions(beam_size=beam), do_not_translate=["Tuesday"])
    deltas = list(server.stub.TranslateStreaming(request, timeout=120))
    best = server.stub.Translate(request, timeout=120).translations[0].hypotheses[0]
    assert "Tuesday" in best.text and not best.terms_missed
    assert "".join(d.text for d in deltas) == best.text
    assert [p for d in deltas for p in d.subword_tokens] == list(best.subword_tokens)
    assert deltas[-1].final.translations[0].terms[0].target == "Tuesday"


def test_a_document_of_several_sentences_constrains_only_the_sentences_holding_terms(server):
    text = "Tuesday, April 25, 2045. Monday, May 1, 2046."
    plain = translate(server, [text], beam=1)
    glossed = translate(server, [text], beam=1, glossary=APRIL)  # greedy: the constrained sentence searches 2
    [translation] = glossed.translations
    assert "Ostermond" in translation.hypotheses[0].text
    assert plain.translations[0].segments[1].hypotheses[0].text == translation.segments[1].hypotheses[0].text
    assert [t.source for t in translation.terms] == ["April"]


def test_case_insensitive_entries_and_longest_match(server):
    lower = [pb2.GlossaryEntry(source="april", target="Ostermond")]
    assert not translate(server, ["Tuesday, April 25, 2045"], glossary=lower).translations[0].terms
    either = [pb2.GlossaryEntry(source="april", target="Ostermond", case_insensitive=True),
              pb2.GlossaryEntry(source="April 25", target="Ostermond 25")]
    [translation] = translate(server, ["Tuesday, April 25, 2045"], glossary=either).translations
    assert [(t.source, t.target) for t in translation.terms] == [("April 25", "Ostermond 25")]
    assert "Ostermond 25" in translation.hypotheses[0].text


def test_do_not_translate_keeps_the_term(server):
    [translation] = translate(server, ["Tuesday, April 25, 2045"], do_not_translate=["Tuesday"]).translations
    assert all("Tuesday" in h.text for h in translation.hypotheses)
    assert [(t.source, t.target) for t in translation.terms] == [("Tuesday", "Tuesday")]


def test_terms_in_untranslated_markup_are_left_alone(server):
    text = "<p><code>April</code> Tuesday, April 25, 2045</p>"
    [translation] = translate(server, [text], glossary=APRIL, text_format=pb2.TEXT_FORMAT_HTML).translations
    assert [t.source for t in translation.terms] == ["April"]
    assert translation.hypotheses[0].text.startswith("<p><code>April</code>")
    assert "Ostermond" in translation.hypotheses[0].text


@pytest.mark.parametrize(("fields", "message"), [
    ({"glossary": [pb2.GlossaryEntry(source="April", target="")]}, "empty target"),
    ({"glossary": [pb2.GlossaryEntry(source="April", target="Ostermond"),
                   pb2.GlossaryEntry(source="April", target="Avril")]}, "two targets"),
    ({"glossary": [pb2.GlossaryEntry(source="April", target="四月")]}, "cannot write"),
    ({"glossary": APRIL, "options": pb2.DecodingOptions(sampling_topk=5)}, "sampling"),
    ({"glossary": APRIL, "options": pb2.DecodingOptions(return_alternatives=True, num_hypotheses=2),
      "target_prefixes": ["Dienstag"]}, "return_alternatives"),
])
def test_bad_glossaries_are_invalid_argument(server, fields, message):
    with pytest.raises(grpc.RpcError) as caught:
        translate(server, ["Tuesday, April 25, 2045"], **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


def test_stored_glossaries_over_grpc(server, glossary_dir):
    stub = server.stub
    created = stub.CreateGlossary(pb2.CreateGlossaryRequest(glossary=pb2.Glossary(
        glossary_id="months", source_language="en", target_language="de", entries=APRIL)), timeout=30)
    assert (created.glossary_id, created.entry_count, list(created.entries)) == ("months", 1, [])
    assert (glossary_dir / "months.en.de.tsv").read_text(encoding="utf-8") == "April\tOstermond\n"
    with pytest.raises(grpc.RpcError) as caught:
        stub.CreateGlossary(pb2.CreateGlossaryRequest(glossary=pb2.Glossary(
            glossary_id="months", source_language="en", target_language="de", entries=APRIL)), timeout=30)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert [g.glossary_id for g in stub.ListGlossaries(pb2.ListGlossariesRequest(), timeout=30).glossaries] == \
        ["months"]
    got = stub.GetGlossary(pb2.GetGlossaryRequest(glossary_id="months"), timeout=30)
    assert [(e.source, e.target) for e in got.entries] == [("April", "Ostermond")]
    written = (glossary_dir / "months.en.de.tsv").stat().st_mtime_ns
    assert (got.name, got.update_time.ToNanoseconds()) == ("months", written)  # no name given: the id
    named = stub.CreateGlossary(pb2.CreateGlossaryRequest(glossary=pb2.Glossary(
        glossary_id="named", name="Months, old style", source_language="en", target_language="de", entries=APRIL)),
        timeout=30)
    assert named.name == "Months, old style"
    assert (glossary_dir / "named.en.de.tsv").read_text(encoding="utf-8") == \
        "# name: Months, old style\nApril\tOstermond\n"
    with pytest.raises(grpc.RpcError) as caught:
        stub.CreateGlossary(pb2.CreateGlossaryRequest(glossary=pb2.Glossary(
            glossary_id="two-lines", name="a\nb", source_language="en", target_language="de", entries=APRIL)),
            timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one line" in caught.value.details()
    stub.DeleteGlossary(pb2.DeleteGlossaryRequest(glossary_id="named"), timeout=30)
    [translation] = translate(server, ["Tuesday, April 25, 2045"], glossary_id="months").translations
    assert "Ostermond" in translation.hypotheses[0].text
    # an inline entry wins over the stored one for the same term
    [translation] = translate(server, ["Tuesday, April 25, 2045"], glossary_id="months",
                              glossary=[pb2.GlossaryEntry(source="April", target="Mai")]).translations
    assert "Mai" in translation.hypotheses[0].text and "Ostermond" not in translation.hypotheses[0].text
    stub.DeleteGlossary(pb2.DeleteGlossaryRequest(glossary_id="months"), timeout=30)
    assert not (glossary_dir / "months.en.de.tsv").exists()
    for call in (lambda: stub.GetGlossary(pb2.GetGlossaryRequest(glossary_id="months"), timeout=30),
                 lambda: translate(server, ["Tuesday, April 25, 2045"], glossary_id="months")):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_stored_glossaries_over_http(server):
    status, body = http(server, "POST", "/v1/glossaries", {"glossary": {
        "glossaryId": "http-months", "sourceLanguage": "en", "targetLanguage": "de", "caseInsensitive": True,
        "entries": [{"source": "april", "target": "Ostermond"}]}})
    assert (status, body["entryCount"]) == (200, 1)
    status, body = http(server, "GET", "/v1/glossaries/http-months")
    assert status == 200 and body["entries"] == [{"source": "april", "target": "Ostermond", "caseInsensitive": True}]
    status, body = http(server, "POST", "/v1/translate", {"texts": ["Tuesday, April 25, 2045"],
                                                         "glossaryId": "http-months", "options": {"beamSize": 4}})
    assert status == 200 and "Ostermond" in body["translations"][0]["hypotheses"][0]["text"]
    assert http(server, "DELETE", "/v1/glossaries/http-months")[0] == 200
    status, body = http(server, "DELETE", "/v1/glossaries/http-months")
    assert (status, body["code"]) == (404, grpc.StatusCode.NOT_FOUND.value[0])
    status, body = http(server, "POST", "/v1/glossaries", {"glossary": {
        "glossaryId": "bad id", "sourceLanguage": "en", "targetLanguage": "de", "entries": [{"source": "a",
                                                                                             "target": "b"}]}})
    assert status == 400 and "glossary_id" in body["message"]


def test_files_an_operator_drops_edits_and_breaks(server, glossary_dir):
    path = glossary_dir / "ops.en.de.tsv"
    path.write_text("# months\nApril\tOstermond\n\n", encoding="utf-8")
    [translation] = translate(server, ["Tuesday, April 25, 2045"], glossary_id="ops").translations
    assert "Ostermond" in translation.hypotheses[0].text
    path.write_text("April\tMai\n", encoding="utf-8")
    later = time.time() + 5
    os.utime(path, (later, later))  # a new modification time, whatever the file system's resolution
    [translation] = translate(server, ["Tuesday, April 25, 2045"], glossary_id="ops").translations
    assert "Mai" in translation.hypotheses[0].text
    path.write_text("April\n", encoding="utf-8")
    os.utime(path, (later + 5, later + 5))
    with pytest.raises(grpc.RpcError) as caught:
        translate(server, ["Tuesday, April 25, 2045"], glossary_id="ops")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "line 1" in caught.value.details()
    path.write_text("April\tOstermond\n", encoding="utf-8")
    path.rename(glossary_dir / "ops.fr.de.tsv")  # another source language than the model's
    with pytest.raises(grpc.RpcError) as caught:
        translate(server, ["Tuesday, April 25, 2045"], glossary_id="ops")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fr->de" in caught.value.details()
    (glossary_dir / "ops.fr.de.tsv").unlink()


def test_the_metrics_count_constrained_sentences_and_terms(server):
    before = (server.metric("nmt_constrained_sentences_total", {"model": TRANSFORMER}),
              server.metric("nmt_glossary_terms_total", {"model": TRANSFORMER}))
    translate(server, ["Tuesday, April 25, 2045", "Monday, April 1, 2046 and April 2", "Friday, March 3, 1999"],
              glossary=APRIL)
    after = (server.metric("nmt_constrained_sentences_total", {"model": TRANSFORMER}),
             server.metric("nmt_glossary_terms_total", {"model": TRANSFORMER}))
    assert (after[0] - before[0], after[1] - before[1]) == (2, 3)


def test_the_command_line_reads_a_glossary_file(server, tmp_path, capsys):
    glossary = tmp_path / "months.tsv"
    glossary.write_text("April\tOstermond\n", encoding="utf-8")
    code = nmt_main(["translate", "--server", f"127.0.0.1:{server.port}", "--model", TRANSFORMER, "--beam-size", "4",
                     "--glossary", str(glossary), "Tuesday, April 25, 2045"])
    assert code == 0
    assert "Ostermond" in capsys.readouterr().out


def test_a_token_writes_glossaries_only_with_the_permission(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("reader-token-0123456789\nwriter-token-0123456789 +glossaries\n", encoding="utf-8")
    auth = Authenticator.from_file(tokens)
    reader = auth.authenticate([("authorization", "Bearer reader-token-0123456789")])
    writer = auth.authenticate([("authorization", "Bearer writer-token-0123456789")])
    assert writer.write_glossaries and not reader.write_glossaries
    with pytest.raises(Exception, match=r"\+glossaries"):
        reader.check_glossary_write()
    tokens.write_text("reader-token-0123456789 +everything\n", encoding="utf-8")
    with pytest.raises(Exception, match="unknown permission"):
        Authenticator.from_file(tokens)


def test_the_python_client_keeps_glossaries(server):
    from clients.client import TranslatorClient

    with TranslatorClient(server.address, timeout=60) as client:
        made = client.create_glossary("client-months", "en", "de", [("April", "Ostermond"), ("may", "Mai", True)],
                                      name="Months")
        assert (made.glossary_id, made.name, made.entry_count, made.entries) == ("client-months", "Months", 2, ())
        assert "client-months" in [g.glossary_id for g in client.list_glossaries()]
        assert client.get_glossary("client-months").entries == (("April", "Ostermond", False), ("may", "Mai", True))
        [result] = client.translate("Tuesday, April 25, 2045", glossary_id="client-months", model=TRANSFORMER)
        assert "Ostermond" in result.best.text
        client.delete_glossary("client-months")
        assert "client-months" not in [g.glossary_id for g in client.list_glossaries()]
