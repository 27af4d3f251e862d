"""Decoding controls end to end: gRPC requests with the new ``DecodingOptions`` fields, served by the real
engine on both tiny architectures (the step-table tests in ``tests/test_beam.py`` pin their arithmetic)."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest

from clients.client import TranslatorClient
from common.model_format.manifest import LOGITS_OUTPUT, ManifestError, sha256_file
from export.graph_passes import remove_output
from nmt.cli import main as nmt_main
from server.config import ServerConfig
from server.controls import NEG_INF, top_k
from server.engine.engine import Engine
from server.protos import pb2
from tests.harness import ServerHarness

TEXT = "three four five six"
MODELS = ["tiny-transformer", "tiny-bahdanau"]


@pytest.fixture(scope="module")
def harness(tiny_models: dict[str, Path], tiny_repository: Path) -> Iterator[ServerHarness]:
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="127.0.0.1:0",
                          model_repository=str(tiny_repository), provider="cpu", intra_op_threads=1,
                          grace_seconds=5, reload_interval=0)
    h = ServerHarness(config)
    yield h
    h.close()


def translate(h: ServerHarness, model: str, *, target_prefixes: tuple[str, ...] = (),
              **options: object) -> pb2.Hypothesis:
    request = pb2.TranslateRequest(texts=[TEXT], model=model, target_prefixes=target_prefixes,
                                   options=pb2.DecodingOptions(return_scores=True, **options))
    return h.stub.Translate(request, timeout=30).translations[0].hypotheses[0]


@pytest.mark.parametrize("model", MODELS)
def test_min_length_and_suppression_change_the_output(harness: ServerHarness, model: str) -> None:
    plain = translate(harness, model)
    generated = len(plain.token_scores)  # pieces including the end of sentence
    longer = translate(harness, model, min_length=generated + 2)
    assert len(longer.token_scores) >= generated + 3  # at least min_length pieces, then the end of sentence
    first_word = plain.tokens[0]
    suppressed = translate(harness, model, suppress_sequences=[first_word])
    assert first_word not in suppressed.tokens
    assert translate(harness, model, min_length=0, repetition_penalty=0, patience=0) == plain  # 0 means off


@pytest.mark.parametrize("model", MODELS)
def test_sampling_with_a_seed_is_reproducible(harness: ServerHarness, model: str) -> None:
    options = dict(sampling_topk=8, sampling_temperature=3.0, sampling_seed=7)
    first = translate(harness, model, **options)
    assert translate(harness, model, **options) == first
    seeds = {translate(harness, model, sampling_topk=8, sampling_temperature=3.0, sampling_seed=seed).text
             for seed in range(1, 9)}
    assert len(seeds) > 1  # hot sampling from 8 tokens does not always give the same text


@pytest.mark.parametrize("options, field", [
    (dict(sampling_topk=4, beam_size=4), "sampling"),
    (dict(repetition_penalty=0.5), "repetition_penalty"),
    (dict(sampling_topp=1.5), "sampling_topp"),
    (dict(min_length=40, max_length=10), "min_length"),
])
def test_bad_controls_are_invalid_argument(harness: ServerHarness, options: dict, field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        translate(harness, MODELS[0], **options)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("beam", [1, 4])
def test_target_prefix_forces_the_start_and_continues(harness: ServerHarness, model: str, beam: int) -> None:
    plain = translate(harness, model, beam_size=beam)
    own = translate(harness, model, beam_size=beam, target_prefixes=(plain.tokens[0],))
    assert own.text == plain.text  # forcing the model's own first word changes nothing
    assert own.token_scores == pytest.approx(plain.token_scores, abs=1e-5)
    other = next(word for word in ("zehn", "eins", "acht") if word != plain.tokens[0])
    forced = translate(harness, model, beam_size=beam, target_prefixes=(other,))
    assert forced.tokens[0] == other  # an unlikely first word is kept, and decoding goes on after it
    assert len(forced.tokens) > 1


def test_target_prefixes_are_checked(harness: ServerHarness) -> None:
    request = pb2.TranslateRequest(texts=["one", "two"], model=MODELS[0], target_prefixes=["eins"])
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Translate(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one per text" in caught.value.details()
    both = pb2.TranslateRequest(texts=["one", "two"], model=MODELS[0], target_prefixes=["", "zehn"])
    first, second = harness.stub.Translate(both, timeout=30).translations
    assert second.hypotheses[0].tokens[0] == "zehn" and first.hypotheses[0].tokens[0] != "zehn"


def test_client_and_cli_send_target_prefixes(harness: ServerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    with TranslatorClient(harness.address) as client:
        [result] = client.translate(TEXT, model=MODELS[0], target_prefixes=["zehn"])
    assert result.hypotheses[0].text.split()[0] == "zehn"
    assert nmt_main(["translate", "--server", harness.address, "--model", MODELS[1], "--prefix", "zehn", TEXT]) == 0
    assert capsys.readouterr().out.split()[0] == "zehn"


@pytest.mark.parametrize("model", MODELS)
def test_score_of_the_own_translation_equals_translate(harness: ServerHarness, model: str) -> None:
    texts = [TEXT, "one two", "seven"]
    request = pb2.TranslateRequest(texts=texts, model=model, options=pb2.DecodingOptions(
        beam_size=1, return_scores=True, return_attention=True))
    translated = harness.stub.Translate(request, timeout=30).translations
    targets = [t.hypotheses[0].text for t in translated]
    scored = harness.stub.Score(pb2.ScoreRequest(texts=texts, targets=targets, model=model, return_attention=True),
                                timeout=30).translations
    for own, given in zip(translated, scored, strict=True):
        [hypothesis], [best] = given.hypotheses, own.hypotheses[:1]
        assert hypothesis.text == best.text and hypothesis.subword_tokens == best.subword_tokens
        assert hypothesis.token_scores == pytest.approx(best.token_scores, abs=1e-5)
        assert hypothesis.score == pytest.approx(best.score, abs=1e-5)
        assert hypothesis.attention.weights == pytest.approx(best.attention.weights, abs=1e-5)
        assert hypothesis.attention.pharaoh == best.attention.pharaoh
    other = harness.stub.Score(pb2.ScoreRequest(texts=[TEXT], targets=["zehn eins"], model=model), timeout=30)
    [hypothesis] = other.translations[0].hypotheses
    assert hypothesis.text == "zehn eins" and hypothesis.score < scored[0].hypotheses[0].score


@pytest.mark.parametrize("targets, message", [(["eins"], "one per text"), (["eins", ""], "targets[1] is empty")])
def test_score_checks_its_targets(harness: ServerHarness, targets: list[str], message: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Score(pb2.ScoreRequest(texts=["one", "two"], targets=targets, model=MODELS[0]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


def test_score_over_http(harness: ServerHarness) -> None:
    body = json.dumps({"texts": [TEXT], "targets": ["zehn eins"], "model": MODELS[0]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{harness.server.http_port}/v1/score", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        [translation] = json.load(response)["translations"]
    [hypothesis] = translation["hypotheses"]
    assert hypothesis["text"] == "zehn eins" and len(hypothesis["tokenScores"]) == len(hypothesis["subwordTokens"]) + 1


def test_client_and_cli_score(harness: ServerHarness, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with TranslatorClient(harness.address) as client:
        [result] = client.score(TEXT, "zehn eins", model=MODELS[1], attention=True)
    [hypothesis] = result.hypotheses
    assert hypothesis.text == "zehn eins" and hypothesis.score < 0 and hypothesis.attention is not None
    plot = tmp_path / "score.png"
    assert nmt_main(["translate", "--server", harness.address, "--model", MODELS[0], "--score", "zehn eins",
                     "--plot", str(plot), TEXT]) == 0
    assert "zehn eins" in capsys.readouterr().out and plot.stat().st_size > 0
    assert nmt_main(["translate", "--server", harness.address, "--score", "zehn", "one", "two"]) != 0
    assert "scores one text" in capsys.readouterr().err


def test_a_version_without_logits_is_refused_with_the_way_out(harness: ServerHarness, tiny_models: dict,
                                                              tmp_path: Path) -> None:
    """A version exported before the decoders' ``logits`` output (which the repetition penalty scales) is refused at
    load, the message saying how to export it again."""
    old = tmp_path / "repository" / "old" / "1"
    shutil.copytree(tiny_models["transformer"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    for role in ("decoder", "decoder_attention"):
        onnx.save(remove_output(onnx.load(str(old / f"{role}.onnx")), LOGITS_OUTPUT), str(old / f"{role}.onnx"))
        manifest["files"][f"{role}.onnx"] = sha256_file(old / f"{role}.onnx")
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="lacks the 'logits' output .*export the model again from its training"):
        Engine.load(old, provider="cpu", intra_op_threads=1)


def test_top_k_equals_a_stable_sort_with_ties_to_the_lower_id() -> None:
    """The partitioned top-k picks and orders exactly as a stable sort of the whole row (the graphs' ``TopK``):
    rows with values rounded into ties, barred tokens (-inf) and k past the row's finite values."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        width, rows, k = int(rng.integers(2, 400)), int(rng.integers(1, 6)), int(rng.integers(1, 12))
        log_probs = np.round(rng.normal(size=(rows, width)), int(rng.integers(0, 3)))
        log_probs[rng.random((rows, width)) < 0.3] = NEG_INF
        ids, values = top_k(log_probs, k)
        expected = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
        assert (ids == expected).all()
        assert np.array_equal(values, np.take_along_axis(log_probs, expected, 1))
