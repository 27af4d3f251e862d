"""``TranslateStreaming``: a text's stable prefix as the search goes (:mod:`server.frontend.streaming`,
:meth:`server.engine.decode.RunningDecode._report_stable`).

Against the real server in this process (both tiny architectures) and the engine underneath: the deltas join
to what ``Translate`` returns for the same request (greedy, beam 4, n-best, target prefixes), greedy reports
each piece as it is chosen, text comes in whole words, a stable prefix never retracts (every report on a
random mix of sentences, beams and prefixes), and a client that cancels mid-stream frees the decode. The split
server's streaming is tested in ``tests/test_split.py``.
"""

from __future__ import annotations

import http.client
import json
import random
import shutil
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from server.engine.engine import Engine
from server.protos import pb2
from server.types import DecodingOptions, SentenceRequest
from tests.harness import ServerHarness
from tests.test_server import SlowEngine, default_loader, rpc_error, test_config, wait_for, wrapping_loader

TEXTS = ["one two", "three four five six", "seven eight nine ten one two", "two two three four"]
ARCHS = ("transformer", "bahdanau")


@pytest.fixture(scope="module")
def repository(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("streaming")
    for arch, version in tiny_models.items():
        shutil.copytree(version, root / arch / "1")
    return root


@pytest.fixture(scope="module")
def harness(repository: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(test_config(repository, default_model="transformer"), default_loader())
    yield h
    h.close()


def request(arch: str, text: str, prefix: str = "", **options: Any) -> Any:
    return pb2.TranslateRequest(texts=[text], model=arch, target_prefixes=[prefix] if prefix else [],
                                options=pb2.DecodingOptions(return_scores=True, **options))


def stream(h: ServerHarness, req: Any) -> list[Any]:
    return list(h.stub.TranslateStreaming(req, timeout=30))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beam,hypotheses", [(1, 1), (4, 1), (4, 3)])
@pytest.mark.parametrize("prefix", ["", "drei"])
def test_the_deltas_join_to_what_translate_returns(harness, arch, beam, hypotheses, prefix):
    for text in TEXTS:
        req = request(arch, text, prefix, beam_size=beam, num_hypotheses=hypotheses, return_attention=True)
        deltas = stream(harness, req)
        unary = harness.stub.Translate(req, timeout=30)
        assert [d.HasField("final") for d in deltas] == [False] * (len(deltas) - 1) + [True]
        final = deltas[-1].final
        assert [h.subword_tokens for h in final.translations[0].hypotheses] == \
            [h.subword_tokens for h in unary.translations[0].hypotheses]
        best = final.translations[0].hypotheses[0]
        assert best.text == unary.translations[0].hypotheses[0].text
        assert "".join(d.text for d in deltas) == best.text
        assert [p for d in deltas for p in d.subword_tokens] == list(best.subword_tokens)
        np.testing.assert_allclose([s for d in deltas for s in d.token_scores], best.token_scores[:-1], atol=1e-6)
        sent = ""
        for delta in deltas[:-1]:  # whole words only: what was sent ends where a word ends
            sent += delta.text
            assert best.text.startswith(sent)
            assert sent == "" or best.text[len(sent):][:1] in ("", " ")
        assert all(d.subword_tokens for d in deltas[:-1])  # a message only when the stable prefix grew
        streamed = sum(d.attention.target_length for d in deltas)  # attention rows of the closed words
        assert streamed == sum(len(d.text.split()) for d in deltas[:-1]) and not deltas[-1].HasField("attention")
        matrix = best.attention
        assert all(d.attention.source_length == matrix.source_length for d in deltas[:-1])
        np.testing.assert_allclose([w for d in deltas for w in d.attention.weights],
                                   matrix.weights[: streamed * matrix.source_length], atol=1e-5)
        assert [(a.source_index, a.target_index) for d in deltas for a in d.attention.word_alignments] == [
            (a.source_index, a.target_index) for a in matrix.word_alignments[:streamed]]
        if beam == 1:  # pieces go out as they are chosen (reports that arrive while one is sent are merged)
            assert len(deltas) > 1


def test_continuous_batching_streams_sentences_that_join_a_running_decode(repository):
    """Streams that join the running decode while others decode (``--batching continuous``) join to what
    ``Translate`` returns, as in static batches."""
    h = ServerHarness(test_config(repository, default_model="transformer", batching="continuous"), default_loader())
    try:
        requests = [request(arch, text, beam_size=beam) for arch in ARCHS[:1] for text in TEXTS for beam in (1, 3)]
        with ThreadPoolExecutor(len(requests)) as pool:
            streams = list(pool.map(lambda r: stream(h, r), requests * 2))
        for req, deltas in zip(requests * 2, streams, strict=True):
            expected = h.stub.Translate(req, timeout=30).translations[0].hypotheses[0]
            assert "".join(d.text for d in deltas) == expected.text
            assert [p for d in deltas for p in d.subword_tokens] == list(expected.subword_tokens)
    finally:
        h.close()


def test_word_timings_are_metrics(harness):
    before = harness.metric("nmt_stream_first_word_seconds_count", {"model": "transformer"})
    gaps = harness.metric("nmt_stream_word_gap_seconds_count", {"model": "transformer"})
    deltas = stream(harness, request("transformer", "three four five six", beam_size=1))
    worded = sum(bool(d.text) for d in deltas)
    assert worded > 1
    assert harness.metric("nmt_stream_first_word_seconds_count", {"model": "transformer"}) == before + 1
    assert harness.metric("nmt_stream_word_gap_seconds_count", {"model": "transformer"}) == gaps + worded - 1


def test_a_min_length_no_translation_can_meet_is_refused(harness):
    req = request("transformer", "one", beam_size=1, min_length=40)  # longer than the source allows (2 x 2 + 10)
    for call in (lambda: stream(harness, req), lambda: harness.stub.Translate(req, timeout=30)):
        error = rpc_error(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_length 40 cannot be met" in error.details()


def test_sampling_streams_every_word_as_it_is_drawn(harness):
    """Sampling (beam 1) decides each piece as it is drawn, like greedy decoding; with a seed the stream and
    Translate draw the same translation."""
    for arch in ARCHS:
        req = request(arch, "eight nine ten one two three", beam_size=1, sampling_topk=5, sampling_temperature=1.5,
                      sampling_seed=11)
        deltas = stream(harness, req)
        best = harness.stub.Translate(req, timeout=30).translations[0].hypotheses[0]
        assert deltas[-1].final.translations[0].hypotheses[0] == best
        assert "".join(d.text for d in deltas) == best.text and len(deltas) > 1


def test_a_deadline_ends_the_stream(repository):
    h = ServerHarness(test_config(repository, default_model="transformer"),
                      wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.05)))
    try:
        # greedy: words from the first steps (beams agree on them only after ~19 steps, about the deadline here)
        long = request("transformer", " ".join(TEXTS * 8), max_length=200, min_length=190, beam_size=1)
        deltas = []
        with pytest.raises(grpc.RpcError) as error:
            for delta in h.stub.TranslateStreaming(long, timeout=1.0):
                deltas.append(delta)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert deltas and not any(d.HasField("final") for d in deltas)  # words came before the deadline
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", {"model": "transformer", "version": "1"}) == 1)
    finally:
        h.close()


def test_alternatives_come_whole_in_the_last_message(harness):
    req = request("transformer", "one two three", "eins", return_alternatives=True, num_hypotheses=3, beam_size=2)
    deltas = stream(harness, req)
    assert len(deltas) == 1 and deltas[0].final == harness.stub.Translate(req, timeout=30)
    assert deltas[0].text == deltas[0].final.translations[0].hypotheses[0].text


def test_one_text_per_request(harness):
    error = rpc_error(lambda: stream(harness, pb2.TranslateRequest(texts=["one", "two"])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly one text" in error.details()
    error = rpc_error(lambda: stream(harness, pb2.TranslateRequest(texts=["one"], model="nope")))
    assert error.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("arch", ARCHS)
def test_a_stable_prefix_never_retracts(tiny_models, arch):
    """Every report of every sentence, on a random mix of beam sizes, lengths and target prefixes decoded
    together: each extends the one before, and the sentence's best hypothesis begins with it."""
    engine = Engine.load(tiny_models[arch], provider="cpu", intra_op_threads=1)
    rng = random.Random(7)
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    reports: list[list[list[int]]] = []
    requests = []
    for i in range(40):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 9)))
        beam = rng.choice([1, 2, 3, 4, 8])
        options = DecodingOptions(beam_size=beam, num_hypotheses=rng.randint(1, beam), length_penalty=rng.choice(
            [0.6, 1.0]), max_length=rng.choice([8, 40]))
        prefix = engine.target_prefix(rng.choice(["", "", "eins", "zwei drei"]))
        reports.append([])
        requests.append(SentenceRequest(engine.tokenize(text), options, text=text, target_prefix=prefix,
                                        on_stable=lambda tokens, scores, rows, i=i: reports[i].append(tokens)))
    results = engine.translate_batch(requests).translations
    early = 0
    for result, request_, seen in zip(results, requests, reports, strict=True):
        best = result.hypotheses[0].token_ids
        for before, after in zip([[], *seen], seen, strict=False):
            assert len(after) > len(before) and after[: len(before)] == before
        for tokens in seen:
            assert best[: len(tokens)] == tokens
        if request_.options.beam_size == 1 and seen:  # greedy: every step's token, as it is chosen
            assert [len(b) - len(a) for a, b in zip(seen, seen[1:], strict=False)] == [1] * (len(seen) - 1)
            assert seen[-1] == best
        early += request_.options.beam_size > 1 and bool(seen)
    assert early > 0  # beam search decided tokens before the end in some sentences


def test_an_event_stream_client_that_goes_away_frees_the_decode(repository):
    """The HTTP face's server-sent events: a client that closes its connection after the first event ends the call
    (its translation cancelled, its rows freed), counted CANCELLED."""
    h = ServerHarness(test_config(repository, default_model="transformer", http_listen="127.0.0.1:0"),
                      wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.02)))
    try:
        body = json.dumps({"texts": [" ".join(TEXTS * 8)], "model": "transformer",
                           "options": {"maxLength": 200, "minLength": 190}})
        connection = http.client.HTTPConnection("127.0.0.1", h.server.http_port, timeout=30)
        connection.request("POST", "/v1/translate:stream", body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")  # the first event
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        cancelled = {"model": "transformer", "version": "1"}
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", cancelled) == 1)
        wait_for(lambda: h.metric("nmt_requests_total", {"model": "transformer", "method": "http:TranslateStreaming",
                                                         "code": "CANCELLED"}) == 1)
    finally:
        h.close()


def test_cancelling_mid_stream_frees_the_decode(repository):
    h = ServerHarness(test_config(repository, default_model="transformer"),
                      wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.02)))
    try:
        long = request("transformer", " ".join(TEXTS * 8), max_length=200, min_length=190)  # within its limit
        call = h.stub.TranslateStreaming(long, timeout=60)
        first = next(call)  # greedy: the first piece, from the running decode
        assert first.subword_tokens and not first.HasField("final")
        call.cancel()
        cancelled = {"model": "transformer", "version": "1"}
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", cancelled) == 1)
        assert h.engine("transformer").results[-1].results == [None]  # it left the decode before its end
        # the call's own count lands when its handler ends, which may come after the decode saw the cancel
        wait_for(lambda: h.metric("nmt_requests_total", {"model": "transformer", "method": "TranslateStreaming",
                                                         "code": "CANCELLED"}) == 1)
    finally:
        h.close()
