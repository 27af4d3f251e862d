"""The client library, the alignment rendering and ``nmt translate``, against a real in-process server.

The server (:class:`TranslationServer` on 127.0.0.1 port 0, on its own event loop in a background
thread, ``tests/harness.py``) serves the session's tiny exported models (``tests/conftest.py``), trained
for seconds to translate English number words into German in reverse order ("one two" -> "zwei eins"). Such a model
is not always right, so the known answers here are the server's own: each result is checked against
the raw ``TranslateResponse`` of the same request, and the command line against the library. Retries are
tested against a scripted fake ``Translator`` whose calls fail with chosen status codes, then succeed.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.client import AsyncTranslatorClient, RetryPolicy, TranslatorClient
from clients.messages import Attention, Hypothesis, ModelInfo, Translation, TranslationError
from clients.render import alignment_grid, save_heatmap
from common.errors import NmtError
from nmt.cli import main as nmt_main
from server.config import ServerConfig
from server.protos import pb2, pb2_grpc
from tests.harness import ServerHarness

MODEL = "tiny-transformer"
TEXTS = ["one two", "three four five", "seven", "eight nine ten one"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)


# ---- a real server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHarness]:
    """Both tiny models, version 1 each; the Transformer is the default model."""
    root = tmp_path_factory.mktemp("client-models")
    shutil.copytree(tiny_models["transformer"], root / MODEL / "1")
    shutil.copytree(tiny_models["bahdanau"], root / "tiny-bahdanau" / "1")
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="", model_repository=str(root),
                          provider="cpu",
                          intra_op_threads=1, grace_seconds=1, default_model=MODEL).validate()
    harness = ServerHarness(config)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def client(server: ServerHarness) -> Iterator[TranslatorClient]:
    with TranslatorClient(server.address, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: ServerHarness) -> Iterator[Any]:
    """A raw gRPC stub: its protobuf responses are the known answers for the client's dataclasses."""
    with grpc.insecure_channel(server.address) as channel:
        yield pb2_grpc.TranslatorStub(channel)


def raw_translate(stub: Any, texts: list[str], **options: Any) -> Any:
    model, version = options.pop("model", ""), options.pop("version", "")
    return stub.Translate(pb2.TranslateRequest(texts=texts, model=model, model_version=version,
                                               options=pb2.DecodingOptions(**options)), timeout=30)


GERMAN = {"eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn"}


def is_german_numbers(text: str) -> bool:
    return bool(text) and set(text.split()) <= GERMAN


# ---- the synchronous client ------------------------------------------------------------------------------------


def test_translate_one_text(client: TranslatorClient, stub: Any) -> None:
    [result] = client.translate("one two")
    [expected] = raw_translate(stub, ["one two"]).translations
    assert isinstance(result, Translation)
    assert result.source_tokens == ["one", "two"]
    assert (result.model, result.model_version) == (MODEL, "1")
    [best] = result.hypotheses
    assert isinstance(best, Hypothesis)
    assert best.text == expected.hypotheses[0].text and is_german_numbers(best.text)
    assert best.tokens == best.text.split() == list(expected.hypotheses[0].tokens)
    assert best.subword_tokens == list(expected.hypotheses[0].subword_tokens)
    assert "".join(best.subword_tokens).replace("\u2581", " ").strip() == best.text
    assert best.score is None and best.token_scores is None and best.attention is None  # not asked for


def test_translate_many_texts_keeps_order(client: TranslatorClient, stub: Any) -> None:
    results = client.translate(TEXTS)
    assert [r.source_tokens for r in results] == [t.split() for t in TEXTS]
    assert [r.best.text for r in results] == [h.hypotheses[0].text for h in raw_translate(stub, TEXTS).translations]
    other = client.translate(TEXTS[::-1], model="tiny-bahdanau", version="1")
    assert [r.model for r in other] == ["tiny-bahdanau"] * len(TEXTS)
    assert [r.source_tokens for r in other] == [t.split() for t in TEXTS[::-1]]
    assert [r.best.text for r in other] == [h.hypotheses[0].text for h in
                                            raw_translate(stub, TEXTS[::-1], model="tiny-bahdanau").translations]


def test_n_best_and_scores(client: TranslatorClient, stub: Any) -> None:
    results = client.translate(TEXTS[:2], beam_size=4, num_hypotheses=3, scores=True)
    expected = raw_translate(stub, TEXTS[:2], beam_size=4, num_hypotheses=3, return_scores=True).translations
    for result, raw in zip(results, expected, strict=True):
        assert [(h.text, h.score, h.token_scores) for h in result.hypotheses] == \
            [(h.text, h.score, list(h.token_scores)) for h in raw.hypotheses]
        assert 1 <= len(result.hypotheses) <= 3
        scores = [h.score for h in result.hypotheses]
        assert all(isinstance(s, float) and s <= 0 for s in scores)
        assert scores == sorted(scores, reverse=True)
        for h in result.hypotheses:
            assert len(h.token_scores) == len(h.subword_tokens) + 1  # end of sentence included
    assert len(client.translate(TEXTS[1], beam_size=4, num_hypotheses=3)[0].hypotheses) == 3


def test_attention(client: TranslatorClient, stub: Any) -> None:
    [result] = client.translate("one two three", beam_size=2, num_hypotheses=2, attention=True)
    [raw] = raw_translate(stub, ["one two three"], beam_size=2, num_hypotheses=2, return_attention=True).translations
    for h, expected in zip(result.hypotheses, raw.hypotheses, strict=True):
        assert [w for row in h.attention.weights for w in row] == list(expected.attention.weights)
        assert h.attention.pharaoh == expected.attention.pharaoh
        assert h.score is None
        a = h.attention
        assert isinstance(a, Attention)
        assert a.source_words == ["one", "two", "three"] and a.target_words == h.tokens
        assert a.shape == (len(h.tokens), 3) and len(a.weights) == len(h.tokens)
        assert all(len(row) == 3 for row in a.weights)
        assert all(math.isclose(sum(row), 1.0, abs_tol=1e-4) for row in a.weights)
        assert all(w >= 0 for row in a.weights for w in row)
        assert [t for _, t in a.alignments] == list(range(len(h.tokens)))
        for s, t in a.alignments:
            assert a.weights[t][s] == max(a.weights[t])
        assert a.pharaoh == " ".join(f"{s}-{t}" for s, t in a.alignments)


def test_list_models(client: TranslatorClient) -> None:
    models = client.list_models()
    assert all(isinstance(m, ModelInfo) for m in models)
    assert [(m.name, m.version) for m in models] == [("tiny-bahdanau", "1"), (MODEL, "1")]
    by_name = {m.name: m for m in models}
    assert by_name[MODEL].is_default and not by_name["tiny-bahdanau"].is_default
    assert all(m.is_latest for m in models)
    assert by_name["tiny-bahdanau"].architecture == "bahdanau"
    assert by_name[MODEL].architecture == "transformer"
    assert all(m.max_beam_size == 8 and m.execution_provider for m in models)


def test_health(client: TranslatorClient) -> None:
    assert client.health() == "SERVING"
    assert client.health(MODEL) == "SERVING"
    assert client.health("translation.v1.Translator") == "SERVING"
    with pytest.raises(TranslationError) as info:
        client.health("klingon")
    assert info.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("call", "code", "message"), [
    ({"texts": [""]}, grpc.StatusCode.INVALID_ARGUMENT, "texts[0] is empty or whitespace-only"),
    ({"texts": ["one", "  "]}, grpc.StatusCode.INVALID_ARGUMENT, "texts[1] is empty"),
    ({"texts": []}, grpc.StatusCode.INVALID_ARGUMENT, "no texts"),
    ({"texts": "one", "beam_size": 2, "num_hypotheses": 3}, grpc.StatusCode.INVALID_ARGUMENT,
     "num_hypotheses 3 is larger than the beam size 2"),
    ({"texts": "one", "model": "klingon"}, grpc.StatusCode.NOT_FOUND, "unknown model 'klingon'"),
    ({"texts": "one", "model": MODEL, "version": "7"}, grpc.StatusCode.NOT_FOUND, "has no version '7'"),
], ids=["empty", "whitespace", "no-texts", "n-best-over-beam", "unknown-model", "unknown-version"])
def test_errors_carry_status_and_message(client: TranslatorClient, call: dict, code: grpc.StatusCode,
                                         message: str) -> None:
    call = dict(call)
    texts = call.pop("texts")
    with pytest.raises(TranslationError) as info:
        client.translate(texts, request_id="req-42", **call)
    error = info.value
    assert isinstance(error, NmtError)
    assert error.code == code and message in error.message
    assert str(error) == f"{code.name}: {error.message}"
    assert error.request_id == "req-42"
    assert error.attempts == 1  # not retried


def test_local_argument_checks(client: TranslatorClient) -> None:
    with pytest.raises(ValueError, match="beam_size must be an integer >= 0"):
        client.translate("one", beam_size=-1)
    with pytest.raises(ValueError, match="length_penalty"):
        client.translate("one", length_penalty=math.nan)
    with pytest.raises(TypeError, match=r"texts\[1\] is int"):
        client.translate(["one", 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout"):
        client.translate("one", timeout=0)


# ---- the asyncio client -----------------------------------------------------------------------------------------


def test_async_client(server: ServerHarness) -> None:
    async def main() -> None:
        async with AsyncTranslatorClient(server.address, timeout=30) as client:
            [one] = await client.translate("one two", scores=True)
            assert is_german_numbers(one.best.text) and one.best.score is not None
            many, again = await asyncio.gather(client.translate(TEXTS), client.translate(TEXTS[::-1]))
            assert [r.source_tokens for r in many] == [t.split() for t in TEXTS]
            assert [r.best.text for r in again] == [r.best.text for r in many][::-1]
            [attended] = await client.translate("one two", attention=True)
            assert attended.best.attention.shape == (len(attended.best.tokens), 2)
            assert [m.name for m in await client.list_models()] == ["tiny-bahdanau", MODEL]
            assert await client.health() == "SERVING"
            with pytest.raises(TranslationError) as info:
                await client.translate("one", model="klingon", request_id="async-1")
            assert info.value.code == grpc.StatusCode.NOT_FOUND and "unknown model" in info.value.message
            assert info.value.request_id == "async-1" and info.value.attempts == 1
            with pytest.raises(TranslationError) as info:
                await client.translate(" ")
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.channel is None  # closed

    asyncio.run(main())


# ---- retries, against a scripted fake server --------------------------------------------------------------------


class ScriptedTranslator(pb2_grpc.TranslatorServicer):
    """Fails the first calls of each method with the scripted status codes, then answers.

    ``Translate`` answers each text with its words upper-cased; ``delay`` makes every call slow.
    """

    def __init__(self, failures: list[grpc.StatusCode], delay: float = 0.0) -> None:
        self.failures = list(failures)
        self.delay = delay
        self.calls: list[dict[str, str]] = []  # each call's metadata
        self.lock = threading.Lock()

    def _attempt(self, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls.append(dict(context.invocation_metadata()))
            code = self.failures.pop(0) if self.failures else None
        if self.delay:
            time.sleep(self.delay)
        if code is not None:
            context.abort(code, f"scripted {code.name}")

    def Translate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._attempt(context)
        return pb2.TranslateResponse(model="fake", model_version="1", translations=[
            pb2.Translation(source_tokens=t.split(), hypotheses=[pb2.Hypothesis(text=t.upper(),
                                                                                tokens=t.upper().split())])
            for t in request.texts])

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self._attempt(context)
        return pb2.ListModelsResponse(models=[pb2.ModelInfo(name="fake", version="1")])


class FakeServer:
    def __init__(self, servicer: ScriptedTranslator, credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_TranslatorServicer_to_server(servicer, self.server)
        if credentials is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


UNAVAILABLE, EXHAUSTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED


class StoppingServer:
    """An asyncio gRPC server (on its own loop thread) whose ``Translate`` of ``"stop"`` blocks the loop for
    ``hold`` seconds and then stops the server: calls that arrive meanwhile wait in gRPC core unmatched to a
    handler, and the stop ends them CANCELLED with the core's message (grpc/grpc#41785)."""

    def __init__(self, hold: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.handled: list[str] = []
        started = threading.Event()
        server_holder: list[grpc.aio.Server] = []
        outer = self

        class Stopping(pb2_grpc.TranslatorServicer):
            async def Translate(self, request: Any, context: Any) -> Any:  # noqa: N802
                outer.handled.extend(request.texts)
                if list(request.texts) == ["stop"]:
                    time.sleep(hold)  # blocks the loop on purpose
                    asyncio.get_running_loop().create_task(server_holder[0].stop(0))
                return pb2.TranslateResponse(model="fake", model_version="1", translations=[
                    pb2.Translation(hypotheses=[pb2.Hypothesis(text=t.upper())]) for t in request.texts])

            async def ListModels(self, request: Any, context: Any) -> Any:  # noqa: N802
                return pb2.ListModelsResponse(models=[pb2.ModelInfo(name="fake", version="1")])

        async def serve() -> None:
            server = grpc.aio.server()
            server_holder.append(server)
            pb2_grpc.add_TranslatorServicer_to_server(Stopping(), server)
            self.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            started.set()
            await server.wait_for_termination()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True)
        self.thread.start()
        assert started.wait(10)


def test_a_call_a_stopping_server_dropped_unhandled_is_retried_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    stopping = StoppingServer(hold=1.0)
    with FakeServer(ScriptedTranslator([])) as fake, \
            TranslatorClient([stopping.address, fake.address], retry=RetryPolicy(
                max_attempts=4, initial_backoff=0.01, max_backoff=0.02)) as client:
        for _ in range(4):  # both replicas connected and in the round
            client.list_models()
        with grpc.insecure_channel(stopping.address) as channel, futures.ThreadPoolExecutor(9) as pool, \
                caplog.at_level(logging.DEBUG, logger="nmt.client"):
            stop = pool.submit(pb2_grpc.TranslatorStub(channel).Translate, pb2.TranslateRequest(texts=["stop"]))
            time.sleep(0.3)  # the stopping server's loop is blocked now
            results = list(pool.map(lambda i: client.translate(f"call {i}")[0].best.text, range(8)))
            stop.result(10)
    stopping.thread.join(10)
    assert results == [f"CALL {i}" for i in range(8)]  # none lost
    dropped = [r for r in caplog.records if getattr(r, "fields", {}).get("code") == "CANCELLED"]
    assert dropped, "no call waited unhandled on the stopping server"


def test_retry_after_unavailable_succeeds() -> None:
    with FakeServer(ScriptedTranslator([UNAVAILABLE])) as fake, \
            TranslatorClient(fake.address, retry=FAST_RETRY) as client:
        [result] = client.translate("one two", request_id="r-1")
        assert result.best.text == "ONE TWO"
        assert len(fake.servicer.calls) == 2
        assert [c["x-request-id"] for c in fake.servicer.calls] == ["r-1", "r-1"]  # one id for all attempts
        fake.servicer.failures = [EXHAUSTED, UNAVAILABLE]
        assert [m.name for m in client.list_models()] == ["fake"]  # ListModels is retried too
        assert len(fake.servicer.calls) == 5
        generated = {c["x-request-id"] for c in fake.servicer.calls[2:]}
        assert len(generated) == 1 and len(generated.pop()) == 32  # an id is made when none is given


def test_async_retry_after_unavailable_succeeds() -> None:
    async def main(address: str) -> list[Translation]:
        async with AsyncTranslatorClient(address, retry=FAST_RETRY) as client:
            return await client.translate(["one", "two"])

    with FakeServer(ScriptedTranslator([UNAVAILABLE, EXHAUSTED])) as fake:
        results = asyncio.run(main(fake.address))
        assert [r.best.text for r in results] == ["ONE", "TWO"]
        assert len(fake.servicer.calls) == 3


def test_retries_stop_after_max_attempts() -> None:
    with FakeServer(ScriptedTranslator([EXHAUSTED] * 5)) as fake, \
            TranslatorClient(fake.address, retry=FAST_RETRY) as client:
        with pytest.raises(TranslationError) as info:
            client.translate("one")
        assert info.value.code == EXHAUSTED and info.value.message == "scripted RESOURCE_EXHAUSTED"
        assert info.value.attempts == 3 and len(fake.servicer.calls) == 3
    with FakeServer(ScriptedTranslator([UNAVAILABLE])) as fake, \
            TranslatorClient(fake.address, retry=FAST_RETRY, max_attempts=1) as client:
        with pytest.raises(TranslationError) as info:
            client.translate("one")
        assert info.value.code == UNAVAILABLE and len(fake.servicer.calls) == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.INTERNAL])
def test_no_retry_on_errors_that_would_repeat(code: grpc.StatusCode) -> None:
    with FakeServer(ScriptedTranslator([code])) as fake, TranslatorClient(fake.address, retry=FAST_RETRY) as client:
        with pytest.raises(TranslationError) as info:
            client.translate("one")
        assert info.value.code == code and info.value.attempts == 1
        assert len(fake.servicer.calls) == 1


def test_no_retry_after_deadline_exceeded() -> None:
    with FakeServer(ScriptedTranslator([], delay=1.0)) as fake, \
            TranslatorClient(fake.address, retry=FAST_RETRY, timeout=0.2) as client:
        started = time.monotonic()
        with pytest.raises(TranslationError) as info:
            client.translate("one")
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 0.9
        assert len(fake.servicer.calls) == 1


def test_unreachable_server_is_unavailable_after_retries() -> None:
    with FakeServer(ScriptedTranslator([])) as fake:
        address = fake.address
    with TranslatorClient(address, retry=FAST_RETRY, timeout=5) as client, \
            pytest.raises(TranslationError) as info:  # nothing listens there now
        client.translate("one")
    assert info.value.code == UNAVAILABLE and info.value.attempts == 3


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True,
                   timeout=60)
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    with FakeServer(ScriptedTranslator([]), credentials) as fake:
        with TranslatorClient(fake.address, root_certificates=str(cert), retry=FAST_RETRY) as client:
            assert client.translate("one")[0].best.text == "ONE"
        with TranslatorClient(fake.address, root_certificates=cert.read_bytes()) as client:
            assert [m.name for m in client.list_models()] == ["fake"]
        assert nmt_main(["translate", "--server", fake.address, "--ca-cert", str(cert), "two"]) == 0
        assert capsys.readouterr().out == "TWO\n"
        for untrusted in ({}, {"tls": True}):  # plaintext, or a certificate the system does not trust
            with TranslatorClient(fake.address, retry=FAST_RETRY, timeout=5, **untrusted) as client, \
                    pytest.raises(TranslationError) as info:
                client.translate("one")
            assert info.value.code == UNAVAILABLE
        assert len(fake.servicer.calls) == 3  # the failed handshakes never reached the servicer
    with pytest.raises(NmtError, match="cannot read certificates from"):
        TranslatorClient("127.0.0.1:1", root_certificates=str(tmp_path / "missing.pem"))


def test_retry_policy() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.1, max_backoff=0.3, backoff_multiplier=2)
    import random

    rng = random.Random(0)
    for attempt, ceiling in [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.3)]:
        samples = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0 <= s <= ceiling for s in samples) and max(samples) > 0.8 * ceiling  # full jitter
    assert policy.should_retry(UNAVAILABLE, 3) and not policy.should_retry(UNAVAILABLE, 4)
    assert not policy.should_retry(grpc.StatusCode.INVALID_ARGUMENT, 1)
    cancelled = grpc.StatusCode.CANCELLED
    assert policy.should_retry(cancelled, 1, "CANCELLED")  # dropped unhandled by a stopping server
    assert not policy.should_retry(cancelled, 1, "call cancelled") and not policy.should_retry(cancelled, 1)
    with pytest.raises(ValueError, match="never retried: INVALID_ARGUMENT"):
        RetryPolicy(retryable_codes=frozenset({UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT}))
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


# ---- rendering ----------------------------------------------------------------------------------------------------

SAMPLE = Attention(source_words=["one", "two", "<b>&"], target_words=["zwei", "eins"],
                   weights=[[0.1, 0.8, 0.1], [0.9, 0.02, 0.08]], alignments=[(1, 0), (0, 1)], pharaoh="1-0 0-1")


def test_alignment_grid() -> None:
    lines = alignment_grid(SAMPLE).splitlines()
    assert lines[0].split() == ["one", "two", "<b>&"]
    assert lines[1] == "zwei  ░░░ [███] ░░░░"
    assert lines[2] == "eins [███]      ░░░░"
    assert "alignment" in lines[3]
    ascii_grid = alignment_grid(SAMPLE, ascii_only=True)
    assert ascii_grid.isascii() and "[###]" in ascii_grid
    long = Attention(["a" * 20], ["b"], [[1.0]], [(0, 0)], "0-0")
    assert alignment_grid(long).splitlines()[0].strip() == "a" * 11 + "…"
    assert len(alignment_grid(SAMPLE, legend=False).splitlines()) == 3
    empty = Attention([], [], [], [], "")
    assert alignment_grid(empty) == "(empty alignment)"


def test_save_heatmap_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    png = save_heatmap(SAMPLE, tmp_path / "a.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "<svg" in save_heatmap(SAMPLE, tmp_path / "a.svg").read_text()
    page = save_heatmap(SAMPLE, tmp_path / "a.html", title="one two <b>&").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<td class=\"w") == 6
    assert "&lt;b&gt;&amp;" in page and "<b>&" not in page  # words are escaped
    assert page.count("aligned") >= 2
    with pytest.raises(NmtError, match="use one of .png"):
        save_heatmap(SAMPLE, tmp_path / "a.jpg")
    with pytest.raises(NmtError, match="cannot write"):
        save_heatmap(SAMPLE, tmp_path / "missing" / "a.html")
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # as if matplotlib were missing
    with pytest.raises(NmtError, match=r"needs matplotlib: pip install"):
        save_heatmap(SAMPLE, tmp_path / "b.png")
    assert save_heatmap(SAMPLE, tmp_path / "b.html").is_file()  # HTML needs no matplotlib


# ---- nmt translate -------------------------------------------------------------------------------------------------


def translate_cli(server: ServerHarness, *args: str) -> list[str]:
    return ["translate", "--server", server.address, *args]


def test_cli_text_output(server: ServerHarness, client: TranslatorClient, capsys: pytest.CaptureFixture) -> None:
    assert nmt_main(translate_cli(server, "one two", "three four five")) == 0
    expected = [r.best.text for r in client.translate(["one two", "three four five"])]
    assert capsys.readouterr().out.splitlines() == expected


def test_translate_stream(client: TranslatorClient) -> None:
    for beam in (1, 4):
        deltas = list(client.translate_stream("eight nine ten one", beam_size=beam, scores=True))
        [expected] = client.translate("eight nine ten one", beam_size=beam, scores=True)
        assert [d.translation is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].translation == expected
        assert "".join(d.text for d in deltas) == expected.best.text
        assert [p for d in deltas for p in d.pieces] == expected.best.subword_tokens
        assert [s for d in deltas for s in d.token_scores] == pytest.approx(expected.best.token_scores[:-1])
        assert beam > 1 or len(deltas) > 1  # greedy: words as they are chosen
    with pytest.raises(TranslationError) as error:
        list(client.translate_stream("one", model="nope"))
    assert error.value.code == grpc.StatusCode.NOT_FOUND


def test_cli_stream(server: ServerHarness, client: TranslatorClient, capsys: pytest.CaptureFixture) -> None:
    assert nmt_main(translate_cli(server, "--stream", "one two", "three four five")) == 0
    expected = [r.best.text for r in client.translate(["one two", "three four five"])]
    assert capsys.readouterr().out.splitlines() == expected
    assert nmt_main(translate_cli(server, "--stream", "--beam", "4", "--n-best", "2", "one two")) == 0
    [result] = client.translate("one two", beam_size=4, num_hypotheses=2, scores=True)
    assert capsys.readouterr().out.splitlines() == [
        result.best.text, "> one two", *(f"{i}. {h.text}  (score {h.score:.4f})" for i, h in
                                         enumerate(result.hypotheses, 1)), ""]


def test_cli_n_best_with_scores(server: ServerHarness, client: TranslatorClient,
                                capsys: pytest.CaptureFixture) -> None:
    assert nmt_main(translate_cli(server, "one two", "--model", MODEL, "--version", "1", "--beam", "4",
                                  "--n-best", "3")) == 0
    [result] = client.translate("one two", beam_size=4, num_hypotheses=3, scores=True)
    expected = ["> one two", *(f"{i}. {h.text}  (score {h.score:.4f})" for i, h in enumerate(result.hypotheses, 1)),
                ""]
    assert len(expected) == 5 and capsys.readouterr().out.splitlines() == expected


def test_cli_json(server: ServerHarness, client: TranslatorClient, capsys: pytest.CaptureFixture) -> None:
    assert nmt_main(translate_cli(server, "--json", "--scores", "one two", "seven")) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["text"] for o in objects] == ["one two", "seven"]
    first = objects[0]
    assert (first["model"], first["model_version"], first["source_tokens"]) == (MODEL, "1", ["one", "two"])
    [hypothesis] = first["hypotheses"]
    [expected] = client.translate("one two", scores=True)
    assert hypothesis == {"text": expected.best.text, "tokens": expected.best.tokens, "score": expected.best.score,
                          "subword_tokens": expected.best.subword_tokens, "token_scores": expected.best.token_scores}
    assert nmt_main(translate_cli(server, "--json", "--attention", "one two")) == 0
    [attended] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    attention = attended["hypotheses"][0]["attention"]
    [expected] = client.translate("one two", attention=True)
    assert attention["alignments"] == [list(pair) for pair in expected.best.attention.alignments]
    assert attention["weights"] == expected.best.attention.weights
    assert attention["source_words"] == ["one", "two"] and attention["pharaoh"] == expected.best.attention.pharaoh
    assert "score" not in attended["hypotheses"][0]


def test_cli_reads_stdin_in_batches(server: ServerHarness, client: TranslatorClient, capsys: pytest.CaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import clients.translate_cli

    monkeypatch.setattr(clients.translate_cli, "BATCH_SIZE", 3)  # 4 texts: two requests
    monkeypatch.setattr(sys, "stdin", io.StringIO("one two\n\n  \nthree four five\nseven\r\neight nine ten one\n"))
    assert nmt_main(translate_cli(server)) == 0
    assert capsys.readouterr().out.splitlines() == [r.best.text for r in client.translate(TEXTS)]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:  # typed lines are translated one by one, as they come
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("one two\n\nseven\n"))
    assert nmt_main(translate_cli(server)) == 0
    assert capsys.readouterr().out.splitlines() == [r.best.text for r in client.translate(["one two", "seven"])]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n\n"))
    assert nmt_main(translate_cli(server)) == 2
    assert "nmt translate: error: no text to translate" in capsys.readouterr().err


def test_cli_attention_grid(server: ServerHarness, client: TranslatorClient, capsys: pytest.CaptureFixture) -> None:
    assert nmt_main(translate_cli(server, "--attention", "one two three")) == 0
    out = capsys.readouterr().out
    [result] = client.translate("one two three", attention=True)
    attention = result.best.attention
    grid = alignment_grid(attention).splitlines()
    lines = out.splitlines()
    assert lines[:3] == ["> one two three", f"1. {result.best.text}", f"   alignment: {attention.pharaoh}"]
    assert lines[3:3 + len(grid)] == ["   " + line for line in grid]
    assert lines[3].split() == ["one", "two", "three"]
    for t, word in enumerate(attention.target_words):  # each row: its word, then its aligned cell bracketed
        row = grid[1 + t]
        assert row.startswith(word)
        [(s, _)] = [pair for pair in attention.alignments if pair[1] == t]
        cells = row[max(len(w) for w in attention.target_words) + 1:]
        start = sum(max(3, len(w)) + 2 for w in attention.source_words[:s])  # a column: its word + 2 brackets
        assert cells[start] == "[" and cells.count("[") == 1


def test_cli_plot_files(server: ServerHarness, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    png = tmp_path / "alignment.png"
    assert nmt_main(translate_cli(server, "--plot", str(png), "one two")) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1  # --plot alone keeps the plain output
    assert png.read_bytes().startswith(PNG_MAGIC) and f"wrote {png}" in captured.err
    html = tmp_path / "alignment.html"
    assert nmt_main(translate_cli(server, "--plot", str(html), "one two", "seven")) == 0
    pages = [tmp_path / "alignment-1.html", tmp_path / "alignment-2.html"]
    assert all(p.is_file() for p in pages) and not html.exists()
    assert "<table" in pages[0].read_text() and "<th class=\"src\"><span>one</span>" in pages[0].read_text()
    assert "<span>seven</span>" in pages[1].read_text()
    assert nmt_main(translate_cli(server, "--plot", str(tmp_path / "a.gif"), "one")) == 2
    assert "error: --plot" in capsys.readouterr().err


def test_cli_list_models(server: ServerHarness, capsys: pytest.CaptureFixture) -> None:
    assert nmt_main(translate_cli(server, "--list-models")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["MODEL", "VERSION", "ARCHITECTURE"]
    assert [line.split()[:3] for line in lines[1:]] == [["tiny-bahdanau", "1", "bahdanau"],
                                                         [MODEL, "1", "transformer"]]
    assert lines[2].endswith("default, latest")
    assert nmt_main(translate_cli(server, "--list-models", "--json")) == 0
    assert [json.loads(line)["name"] for line in capsys.readouterr().out.splitlines()] == ["tiny-bahdanau", MODEL]


@pytest.mark.parametrize(("args", "message"), [
    (["  "], "nmt translate: error: INVALID_ARGUMENT: texts[0] is empty or whitespace-only"),
    (["one", "--model", "klingon"], "nmt translate: error: NOT_FOUND: unknown model 'klingon'"),
    (["one", "--beam", "2", "--n-best", "3"], "nmt translate: error: INVALID_ARGUMENT: num_hypotheses 3"),
])
def test_cli_errors_exit_2(server: ServerHarness, capsys: pytest.CaptureFixture, args: list[str],
                           message: str) -> None:
    assert nmt_main(translate_cli(server, *args)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1 and not captured.out


def test_cli_help_does_not_import_grpc() -> None:
    code = ("import argparse, sys, clients.translate_cli as cli; parser = argparse.ArgumentParser(); "
            "cli.add_parser(parser.add_subparsers()); parser.parse_args(['translate', 'one']); "
            "assert 'grpc' not in sys.modules, 'grpc imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent,
                   timeout=60)



def test_an_empty_hypothesis_is_named_not_left_blank() -> None:
    from clients.translate_cli import format_translation

    translation = Translation(source_tokens=["one"], hypotheses=[
        Hypothesis(text="eins", tokens=["eins"], subword_tokens=["▁eins"], score=-0.1),
        Hypothesis(text="", tokens=[], subword_tokens=[], score=-4.2)])  # an alternative: the end of sentence
    out = format_translation("one", translation, verbose=True, attention=False, ascii_only=True)
    assert out.splitlines() == ["> one", "1. eins  (score -0.1000)",
                                "2. (empty: the translation ends here)  (score -4.2000)"]
