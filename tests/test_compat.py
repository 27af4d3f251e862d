"""The APIs other translation services speak, through their official clients from PyPI, unchanged:
LibreTranslate's (``libretranslatepy``) and DeepL's (``deepl``), against the same server and repository as
tests/test_routing.py: their results equal the native API's, their errors have their shapes and statuses, and
their keys are the service's bearer tokens."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import deepl
import pytest
import requests
from libretranslatepy import LibreTranslateAPI

from server.frontend.http_face import MAX_BODY_BYTES
from server.protos import pb2
from tests.harness import ServerHarness
from tests.test_routing import BAHDANAU, DATE, FRENCH_TEXT, routing_repository, serve, translate

TOKEN = "compatible-api-key-0123"


@pytest.fixture(scope="module")
def repository(dates_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return routing_repository(dates_models, tmp_path_factory)


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHarness]:
    harness = serve(repository, glossary_dir=str(tmp_path_factory.mktemp("compat-glossaries")))
    yield harness
    harness.close()


# ---- LibreTranslate ---------------------------------------------------------------------------------------------

def client(server: ServerHarness, key: str | None = None) -> LibreTranslateAPI:
    return LibreTranslateAPI(f"http://127.0.0.1:{server.server.http_port}", api_key=key)


def post(server: ServerHarness, path: str, body: dict, headers: dict | None = None) -> tuple[int, object]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_libretranslate_client_gets_the_native_translations(server: ServerHarness) -> None:
    native = translate(server, [DATE], source_language="en", target_language="de").translations[0]
    assert client(server).translate(DATE, "en", "de") == native.hypotheses[0].text
    assert client(server).translate(DATE, "auto", "de") == native.hypotheses[0].text
    detected = client(server).detect(FRENCH_TEXT)
    assert detected[0]["language"] == "fr" and detected[0]["confidence"] > 90
    languages = {entry["code"]: entry for entry in client(server).languages()}
    assert languages["en"] == {"code": "en", "name": "English", "targets": ["de"]}
    assert languages["fr"]["targets"] == ["de"] and languages["de"]["targets"] == []


def test_libretranslate_batches_alternatives_and_html(server: ServerHarness) -> None:
    texts = [DATE, "Monday, May 1, 2046"]
    status, body = post(server, "/translate", {"q": texts, "source": "auto", "target": "de", "alternatives": 2})
    native = translate(server, texts, source_language="en", target_language="de",
                       options=pb2.DecodingOptions(beam_size=3, num_hypotheses=3))
    assert status == 200
    assert body["translatedText"] == [t.hypotheses[0].text for t in native.translations]
    assert body["alternatives"] == [[h.text for h in t.hypotheses[1:]] for t in native.translations]
    assert [d["language"] for d in body["detectedLanguage"]] == ["en", "en"]
    status, body = post(server, "/translate", {"q": "April <b>25</b>, 2045", "source": "en", "target": "de",
                                               "format": "html"})
    html = translate(server, ["April <b>25</b>, 2045"], source_language="en", target_language="de",
                     text_format=pb2.TEXT_FORMAT_HTML)
    assert (status, body) == (200, {"translatedText": html.translations[0].hypotheses[0].text})


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"source": "en", "target": "de"}, 400, "missing q"),
    ({"q": DATE, "target": "de"}, 400, "missing source"),
    ({"q": DATE, "source": "en", "target": "fr"}, 400, "served pairs"),
    ({"q": DATE, "source": "en", "target": "de", "format": "pdf"}, 400, "format"),
    ({"q": DATE, "source": "en", "target": "de", "alternatives": 99}, 400, "alternatives"),
    ({"q": "ok", "source": "auto", "target": "de"}, 400, "cannot be told"),
])
def test_libretranslate_errors_have_its_shape_and_status(server: ServerHarness, body: dict, status: int,
                                                         message: str) -> None:
    got, answer = post(server, "/translate", body)
    assert got == status and message in answer["error"]


def test_libretranslate_api_key_is_the_bearer_token(repository: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    harness = serve(repository, auth_tokens_file=str(tokens))
    try:
        assert client(harness, TOKEN).translate(DATE, "en", "de")
        with pytest.raises(urllib.error.HTTPError) as caught:
            client(harness).translate(DATE, "en", "de")
        assert caught.value.code == 403 and "error" in json.load(caught.value)
        with pytest.raises(urllib.error.HTTPError) as caught:
            client(harness, "wrong").languages()
        assert caught.value.code == 403
        assert {entry["code"] for entry in client(harness, TOKEN).languages()} == {"de", "en", "fr"}
        assert harness.metric("nmt_requests_total", {"model": BAHDANAU, "method": "libretranslate:translate",
                                                     "code": "OK"}) == 1
    finally:
        harness.close()


# ---- DeepL ---------------------------------------------------------------------------------------------------------

def deepl_client(server: ServerHarness, key: str = "any-key") -> deepl.Translator:
    return deepl.Translator(key, server_url=f"http://127.0.0.1:{server.server.http_port}", send_platform_info=False)


def test_deepl_client_gets_the_native_translations(server: ServerHarness) -> None:
    translator = deepl_client(server)
    texts = [DATE, "Monday, May 1, 2046"]
    native = translate(server, texts, source_language="en", target_language="de")
    results = translator.translate_text(texts, target_lang="DE")  # no source: detected
    assert [r.text for r in results] == [t.hypotheses[0].text for t in native.translations]
    assert [(r.detected_source_lang, r.billed_characters) for r in results] == [("EN", len(t)) for t in texts]
    assert translator.translate_text(FRENCH_TEXT, source_lang="FR", target_lang="DE").detected_source_lang == "FR"
    # a regional variant of the target, form-encoded as older clients send it
    form = requests.post(f"http://127.0.0.1:{server.server.http_port}/v2/translate", timeout=60,
                         data={"text": DATE, "target_lang": "DE-AT", "source_lang": "EN"},
                         headers={"Authorization": "DeepL-Auth-Key any-key"})
    assert form.status_code == 200
    assert form.json()["translations"][0]["text"] == native.translations[0].hypotheses[0].text


def test_deepl_tag_handling_equals_native_markup(server: ServerHarness) -> None:
    translator = deepl_client(server)
    html = "<p>April <b>25</b>, 2045</p>\n<p><i>Tuesday</i>, April 25, 2045</p>"
    native = translate(server, [html], source_language="en", target_language="de", text_format=pb2.TEXT_FORMAT_HTML,
                       sentence_splitting=pb2.SPLIT_NO_NEWLINES)
    assert translator.translate_text(html, source_lang="EN", target_lang="DE",
                                     tag_handling="html").text == native.translations[0].hypotheses[0].text
    # Weblate's placeholders: XML with <x id="N"></x> among ignore_tags; an ignored element is copied unchanged
    xml = 'April <x id="1"></x>25, 2045 <ph>kept &amp; as it is</ph>'
    result = translator.translate_text(xml, source_lang="EN", target_lang="DE", tag_handling="xml",
                                       ignore_tags=["x", "ph"]).text
    assert '<x id="1"/>' in result and "<ph>kept &amp; as it is</ph>" in result and "April" in result
    segments = translator.translate_text("<seg>Tuesday</seg><seg>April 25, 2045</seg>", source_lang="EN",
                                         target_lang="DE", tag_handling="xml", splitting_tags="seg").text
    assert segments.count("<seg>") == 2


def test_deepl_languages_and_usage(server: ServerHarness) -> None:
    translator = deepl_client(server)
    assert {(lang.code, lang.name) for lang in translator.get_source_languages()} == {("EN", "English"),
                                                                                       ("FR", "French")}
    [german] = translator.get_target_languages()
    assert (german.code, german.name, german.supports_formality) == ("DE", "German", False)
    before = translator.get_usage().character.count
    translator.translate_text(DATE, source_lang="EN", target_lang="DE")
    usage = translator.get_usage()
    assert usage.character.count == before + len(DATE) and not usage.any_limit_reached


@pytest.mark.parametrize(("options", "message"), [
    ({"target_lang": "FR"}, "served pairs"),
    ({"target_lang": "DE", "formality": "more"}, "formality"),
    ({"target_lang": "DE", "source_lang": "EN", "glossary": "g1"}, "no glossary 'g1'"),
    ({"target_lang": "DE", "split_sentences": "sometimes"}, "split_sentences"),
    ({"target_lang": "DE", "tag_handling": "markdown"}, "tag_handling"),
])
def test_deepl_errors_are_its_400(server: ServerHarness, options: dict, message: str) -> None:
    with pytest.raises(deepl.DeepLException) as caught:
        deepl_client(server).translate_text(DATE, **options)
    assert caught.value.http_status_code == 400 and message in str(caught.value)


def test_deepl_glossaries_through_its_client(server: ServerHarness) -> None:
    """DeepL's glossary calls, as its client makes them, over the stored glossaries: the name is the caller's,
    the id the service's, and a translation with the glossary holds its terms as the native call does."""
    translator = deepl_client(server)
    assert [(p.source_lang, p.target_lang) for p in translator.get_glossary_languages()] == [("en", "de"),
                                                                                            ("fr", "de")]
    glossary = translator.create_glossary("weblate:en:de:1", "EN", "DE", {"April": "Mai", "Tuesday": "Mittwoch"})
    assert (glossary.name, glossary.source_lang, glossary.target_lang, glossary.entry_count, glossary.ready) == \
        ("weblate:en:de:1", "EN", "DE", 2, True)
    assert [g.glossary_id for g in translator.list_glossaries()] == [glossary.glossary_id]
    assert translator.get_glossary(glossary.glossary_id).name == "weblate:en:de:1"
    assert translator.get_glossary_entries(glossary) == {"April": "Mai", "Tuesday": "Mittwoch"}
    native = translate(server, [DATE], source_language="en", target_language="de",
                       glossary_id=glossary.glossary_id).translations[0]
    assert [(t.source, t.target) for t in native.terms] == [("Tuesday", "Mittwoch"), ("April", "Mai")]
    text = translator.translate_text(DATE, source_lang="EN", target_lang="DE", glossary=glossary).text
    assert text == native.hypotheses[0].text and "Mai" in text and "Mittwoch" in text
    from_csv = translator.create_glossary_from_csv("csv", "EN", "DE", "April,Mai,en,de\nMay,April\n")
    assert translator.get_glossary_entries(from_csv) == {"April": "Mai", "May": "April"}
    for made in (glossary, from_csv):
        translator.delete_glossary(made)
    assert translator.list_glossaries() == []
    with pytest.raises(deepl.GlossaryNotFoundException):
        translator.get_glossary(glossary.glossary_id)
    with pytest.raises(deepl.GlossaryNotFoundException):
        translator.delete_glossary(glossary.glossary_id)
    status, body = post(server, "/v2/glossaries", {"name": "bad", "source_lang": "EN", "target_lang": "DE",
                                                   "entries": "April Mai", "entries_format": "tsv"})
    assert status == 400 and "line 1" in body["message"]
    status, body = post(server, "/v2/translate", {"text": [DATE], "target_lang": "DE", "glossary_id": "x"})
    assert status == 400 and "source_lang" in body["message"]


def test_deepl_body_over_the_limit_is_413(server: ServerHarness) -> None:
    answer = requests.post(f"http://127.0.0.1:{server.server.http_port}/v2/translate", timeout=60,
                           data={"text": "a" * (MAX_BODY_BYTES + 1), "target_lang": "DE"})
    assert answer.status_code == 413 and "limit" in answer.json()["message"]


def test_deepl_auth_key_is_the_bearer_token(repository: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    harness = serve(repository, auth_tokens_file=str(tokens))
    try:
        assert deepl_client(harness, TOKEN).translate_text(DATE, source_lang="EN", target_lang="DE").text
        with pytest.raises(deepl.AuthorizationException, match="glossar"):  # writing needs +glossaries
            deepl_client(harness, TOKEN).create_glossary("g", "EN", "DE", {"April": "Mai"})
        with pytest.raises(deepl.AuthorizationException):
            deepl_client(harness, "wrong-key").translate_text(DATE, source_lang="EN", target_lang="DE")
        with pytest.raises(deepl.AuthorizationException):
            deepl_client(harness, "wrong-key").get_usage()
        assert harness.metric("nmt_requests_total", {"model": BAHDANAU, "method": "deepl:translate",
                                                     "code": "OK"}) == 1
    finally:
        harness.close()
