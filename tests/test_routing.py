"""Requests by language pair and source_language "auto", through a live server, the Python client and the
command line.

The repository serves the small dates models (English -> German, both architectures) and a copy of the
Transformer whose manifest says it translates French (``dates-fr``): a second source language to route to
and to detect (its translations are the English model's, which the tests do not read)."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients.client import TranslatorClient
from nmt.cli import main as nmt_main
from server.config import ServerConfig
from server.frontend.detection import Detection, LanguageDetector, detect_texts
from server.frontend.documents.model import TextFormat
from server.protos import pb2
from tests.harness import ServerHarness
from tests.test_server import default_loader

TRANSFORMER, BAHDANAU, FRENCH = "dates-transformer", "dates-bahdanau", "dates-fr"
DATE = "Tuesday, April 25, 2045"
FRENCH_TEXT = "Le chat dort sur la table de la cuisine."


def copy_as(version_dir: Path, target: Path, name: str, **manifest: str) -> None:
    shutil.copytree(version_dir, target)
    path = target / "manifest.json"
    fields = json.loads(path.read_text())
    path.write_text(json.dumps({**fields, "name": name, **manifest}))


def routing_repository(dates_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository of the module docstring."""
    root = tmp_path_factory.mktemp("routing") / "models"
    copy_as(dates_models["transformer"], root / TRANSFORMER / "1", TRANSFORMER)
    copy_as(dates_models["bahdanau"], root / BAHDANAU / "1", BAHDANAU)
    copy_as(dates_models["transformer"], root / FRENCH / "1", FRENCH, source_language="fr")
    return root


@pytest.fixture(scope="module")
def repository(dates_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return routing_repository(dates_models, tmp_path_factory)


def serve(repository: Path, tmp_path: Path | None = None, **settings) -> ServerHarness:
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="127.0.0.1:0",
                          model_repository=str(repository), default_model=TRANSFORMER, provider="cpu",
                          intra_op_threads=1, pair_models=f"en:de={BAHDANAU}", **settings).validate()
    return ServerHarness(config, default_loader())


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerHarness]:
    harness = serve(repository)
    yield harness
    harness.close()


def translate(server: ServerHarness, texts: list[str], **fields) -> pb2.TranslateResponse:
    return server.stub.Translate(pb2.TranslateRequest(texts=texts, **fields), timeout=60)


def refused(server: ServerHarness, texts: list[str], **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        translate(server, texts, **fields)
    return caught.value


def test_a_pair_chooses_its_model(server: ServerHarness) -> None:
    by_pair = translate(server, [DATE], source_language="en", target_language="de")
    assert by_pair.model == BAHDANAU  # --pair-models en:de=dates-bahdanau over the default model
    assert translate(server, [DATE], source_language="fr", target_language="de").model == FRENCH
    direct = translate(server, [DATE], model=BAHDANAU)
    assert by_pair.translations == direct.translations
    # regional variants and case fall back to the served primary subtag
    assert translate(server, [DATE], source_language="EN-us", target_language="de-DE").model == BAHDANAU
    # no source: the default model's source where it translates to the target
    assert translate(server, [DATE], target_language="de").model == BAHDANAU
    assert translate(server, [DATE]).model == TRANSFORMER  # neither: the default model, as before


def test_an_unserved_pair_is_not_found_listing_the_served_pairs(server: ServerHarness) -> None:
    error = refused(server, [DATE], source_language="en", target_language="fr")
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "en->de" in error.details() and "fr->de" in error.details()
    error = refused(server, [DATE], source_language="ja", target_language="de")
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_a_model_named_with_another_source_language_is_invalid_argument(server: ServerHarness) -> None:
    error = refused(server, [DATE], model=FRENCH, source_language="en")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'fr'" in error.details()


def test_languages_list_every_pair_with_its_model(server: ServerHarness) -> None:
    pairs = server.stub.ListLanguages(pb2.ListLanguagesRequest(), timeout=10).pairs
    listed = {(p.source_language, p.target_language): (p.model, sorted(p.models)) for p in pairs}
    assert listed == {("en", "de"): (BAHDANAU, sorted([BAHDANAU, TRANSFORMER])), ("fr", "de"): (FRENCH, [FRENCH])}
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.http_port}/v1/languages", timeout=10) as answer:
        assert len(json.load(answer)["pairs"]) == 2


def test_auto_detects_the_language_among_those_served(server: ServerHarness) -> None:
    english = translate(server, [DATE, "Monday, May 1, 2046"], source_language="auto", target_language="de")
    assert english.model == BAHDANAU
    assert [t.detected_language for t in english.translations] == ["en", "en"]
    assert all(0.5 <= t.detected_confidence <= 1 for t in english.translations)
    assert english.translations[0].hypotheses == translate(server, [DATE], model=BAHDANAU).translations[0].hypotheses
    french = translate(server, [FRENCH_TEXT], source_language="auto", target_language="de")
    assert french.model == FRENCH and french.translations[0].detected_language == "fr"
    # markup is left out of what is detected
    html = translate(server, [f"<p><b>{FRENCH_TEXT}</b></p>"], source_language="auto", target_language="de",
                     text_format=pb2.TEXT_FORMAT_HTML)
    assert html.translations[0].detected_language == "fr"


@pytest.mark.parametrize("text", ["ok", "2045", "これは日本語で書かれた文章です。"])
def test_a_text_that_cannot_be_told_is_invalid_argument_never_an_echo(server: ServerHarness, text: str) -> None:
    error = refused(server, [text], source_language="auto", target_language="de")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be told" in error.details()


def test_texts_of_several_languages_are_invalid_argument(server: ServerHarness) -> None:
    error = refused(server, [FRENCH_TEXT, "the twenty-fifth of April, two thousand forty-five"],
                    source_language="auto", target_language="de")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "several languages" in error.details()


def test_the_configured_default_takes_what_cannot_be_told() -> None:
    detector = LanguageDetector()
    [found] = detect_texts(detector, ["ok"], TextFormat.PLAIN, ["en", "fr"], "en")
    assert found == Detection("en", 0.0)
    with pytest.raises(Exception, match="cannot be told"):
        detect_texts(detector, ["ok"], TextFormat.PLAIN, ["en", "fr"], "")
    # one candidate: any text in its script is that language, with certainty; another script is not
    assert detector.detect("Le chat dort.", ["en"]) == Detection("en", 1.0)
    assert detector.detect("これは日本語で書かれた文章です。", ["en"]) is None


def test_detect_language_ranks_the_candidates(server: ServerHarness) -> None:
    response = server.stub.DetectLanguage(pb2.DetectLanguageRequest(texts=[FRENCH_TEXT, "ok"]), timeout=10)
    french, short = response.texts
    assert [d.language for d in french.languages] == ["fr", "en"]
    assert french.languages[0].confidence > 0.9 and abs(sum(d.confidence for d in french.languages) - 1) < 1e-5
    assert not short.languages


def test_the_client_and_the_command_line_take_a_pair(server: ServerHarness, capsys: pytest.CaptureFixture) -> None:
    with TranslatorClient(server.address, timeout=60) as translator:
        [result] = translator.translate(FRENCH_TEXT, source_language="auto", target_language="de")
        assert (result.model, result.detected_language) == (FRENCH, "fr") and result.detected_confidence > 0.5
        assert ("fr", "de", FRENCH) in translator.list_languages()
    assert nmt_main(["translate", "--server", server.address, "--from", "auto", "--to", "de", "--json", DATE]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["model"] == BAHDANAU and line["detected_language"]["language"] == "en"
    assert nmt_main(["translate", "--server", server.address, "--list-languages"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"en\tde\t{BAHDANAU}", f"fr\tde\t{FRENCH}"]
