"""The gRPC translation server, in-process on 127.0.0.1 port 0, with a real exported tiny model.

Servers run on their own event loop in a background thread (``tests/harness.py: ServerHarness``); the
tests are plain synchronous gRPC clients. Slow and failing variants wrap the real engine (``SlowEngine``,
``FailingEngine``): the slowness comes from the engine's own per-step cancellation poll, so the
deadline and drain tests exercise the real "leave the batch" path.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from server.config import ServerConfig
from server.core.admission import Pending
from server.core.scheduler import ModelScheduler, form_batch
from server.engine.engine import BatchResult
from server.policy import BatchPolicy, RequestHandle
from server.protos import SERVICE_NAME, pb2, pb2_grpc
from server.types import DecodingOptions, ScoredSequence, SearchResult, SentenceRequest
from tests.conftest import SERVED_MODEL
from tests.harness import ServerHarness

MODEL = SERVED_MODEL
TEXTS = ["one two", "three four five six", "seven", "eight nine ten one two", "two two three"]


# ---- the model: a real exported tiny model version -----------------------------------------------------


def default_loader() -> Callable[..., Any]:
    """How versions are loaded: the real :meth:`server.engine.engine.Engine.load`."""
    from server.core.repository import default_engine_loader

    return default_engine_loader


# ---- harness -----------------------------------------------------------------------------------------


def test_config(repo: Path, **changes: Any) -> ServerConfig:
    """A test server's configuration. No translation cache: these tests see every request decoded
    (tests/test_cache.py tests the cache, tests/test_routing.py serves with the defaults)."""
    base = ServerConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", http_listen="", model_repository=str(repo),
                        provider="cpu", intra_op_threads=1, grace_seconds=5, cache_mb=0)
    return base.with_(**changes)


test_config.__test__ = False  # not a test


@pytest.fixture(scope="module")
def harness(repository: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(test_config(repository), default_loader())
    yield h
    h.close()


class SlowEngine:
    """The real engine, with each per-step cancellation poll taking ``poll_seconds`` (slow decoding).

    Batches without a poll (the repository's smoke translation at load) run untouched and unrecorded."""

    model = None  # no step model of its own: batched statically, no CUDA graphs to record

    def __init__(self, engine: Any, poll_seconds: float) -> None:
        self.engine, self.poll_seconds = engine, poll_seconds
        self.manifest, self.tokenizer, self.provider = engine.manifest, engine.tokenizer, engine.provider
        self.text = engine.text
        self.results: list[Any] = []

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def search_batch(self, requests: Any) -> Any:
        if all(r.is_cancelled is None for r in requests):
            return self.engine.search_batch(requests)

        def slow(check: Callable[[], bool] | None) -> Callable[[], bool]:
            def polled() -> bool:
                time.sleep(self.poll_seconds)
                return bool(check and check())

            return polled

        wrapped = [replace(r, is_cancelled=slow(r.is_cancelled)) for r in requests]
        result = self.engine.search_batch(wrapped)
        self.results.append(result)
        return result


class FailingEngine(SlowEngine):
    """The real engine, failing every batch that holds a sentence with ``max_length == 13``."""

    def search_batch(self, requests: Any) -> Any:
        if any(r.options.max_length == 13 for r in requests):
            raise RuntimeError("injected failure")
        return self.engine.search_batch(requests)


def wrapping_loader(wrapper: Callable[[Any], Any]) -> Callable[..., Any]:
    base = default_loader()

    def load(path: Path, **kwargs: Any) -> Any:
        return wrapper(base(path, **kwargs))

    return load


def translate(harness: ServerHarness, texts: list[str], **options: Any) -> Any:
    model = options.pop("model", "")
    version = options.pop("model_version", "")
    timeout = options.pop("timeout", 30)
    request = pb2.TranslateRequest(texts=texts, model=model, model_version=version,
                                   options=pb2.DecodingOptions(**options))
    return harness.stub.Translate(request, timeout=timeout)


def best(response: Any) -> Any:
    """The best hypothesis of a one-text response."""
    [translation] = response.translations
    return translation.hypotheses[0]


def assert_same_best(got: Any, expected: Any) -> None:
    """Same best hypothesis, up to an exact tie (batching changes padding, hence the last float bits)."""
    if got.text != expected.text:
        assert got.score == pytest.approx(expected.score, abs=1e-4), (got.text, expected.text)


def wait_for(condition: Callable[[], Any], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ---- translation ---------------------------------------------------------------------------------------


def test_translate_one_text(harness: ServerHarness) -> None:
    response = translate(harness, [TEXTS[0]])
    assert (response.model, response.model_version) == (MODEL, "10")  # newest version: numeric order
    [translation] = response.translations
    assert list(translation.source_tokens) == TEXTS[0].split()
    [hypothesis] = translation.hypotheses  # num_hypotheses 0: one
    assert hypothesis.text
    assert list(hypothesis.tokens) == hypothesis.text.split()
    assert "".join(hypothesis.subword_tokens).replace("\u2581", " ").strip() == hypothesis.text
    assert hypothesis.score == 0.0 and not hypothesis.token_scores  # scores only when asked
    assert not hypothesis.HasField("attention")


def test_translate_many_texts_keeps_order(harness: ServerHarness) -> None:
    response = translate(harness, TEXTS, return_scores=True)
    assert [list(t.source_tokens) for t in response.translations] == [t.split() for t in TEXTS]
    for text, translation in zip(TEXTS, response.translations, strict=True):
        assert_same_best(translation.hypotheses[0], best(translate(harness, [text], return_scores=True)))
    direct = harness.engine().translate(TEXTS)  # the engine's own batch agrees
    assert [t.hypotheses[0].text for t in direct] == [t.hypotheses[0].text for t in response.translations]


def test_model_version_and_options_defaults(harness: ServerHarness) -> None:
    response = translate(harness, [TEXTS[1]], model=MODEL, model_version="2")
    assert response.model_version == "2"
    defaults = harness.engine().manifest.defaults
    default_beam = translate(harness, [TEXTS[1]], return_scores=True).translations[0].hypotheses[0]
    explicit = translate(harness, [TEXTS[1]], return_scores=True, beam_size=int(defaults["beam_size"]),
                         length_penalty=float(defaults["length_penalty"])).translations[0].hypotheses[0]
    assert (default_beam.text, default_beam.score) == (explicit.text, pytest.approx(explicit.score))


def test_beam_search_n_best_ordered_by_score(harness: ServerHarness) -> None:
    response = translate(harness, TEXTS[:2], beam_size=4, num_hypotheses=3, return_scores=True)
    for translation in response.translations:
        hypotheses = translation.hypotheses
        assert 1 <= len(hypotheses) <= 3
        scores = [h.score for h in hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.subword_tokens) for h in hypotheses}) == len(hypotheses)  # distinct
        for h in hypotheses:
            assert len(h.token_scores) == len(h.subword_tokens) + 1  # EOS included
            assert all(s <= 0 for s in h.token_scores)
            # score = sum of log-probabilities / length ** length_penalty (default penalty of the model)
            penalty = float(harness.engine().manifest.defaults.get("length_penalty", 1.0))
            assert h.score == pytest.approx(sum(h.token_scores) / len(h.token_scores) ** penalty, rel=1e-4, abs=1e-4)
    greedy = translate(harness, TEXTS[:2], beam_size=1, return_scores=True)
    assert all(len(t.hypotheses) == 1 for t in greedy.translations)


def test_attention_and_word_alignments(harness: ServerHarness) -> None:
    response = translate(harness, TEXTS[:3], beam_size=2, num_hypotheses=2, return_attention=True)
    for text, translation in zip(TEXTS[:3], response.translations, strict=True):
        assert list(translation.source_tokens) == text.split()
        for h in translation.hypotheses:
            a = h.attention
            assert a.target_length == len(h.tokens) and a.source_length == len(translation.source_tokens)
            weights = np.array(a.weights).reshape(a.target_length, a.source_length)
            assert np.allclose(weights.sum(axis=1), 1.0, atol=1e-4)
            assert (weights >= 0).all()
            assert len(a.word_alignments) == a.target_length
            assert [w.target_index for w in a.word_alignments] == list(range(a.target_length))
            for w in a.word_alignments:
                assert w.source_index == int(weights[w.target_index].argmax())
            assert a.pharaoh == " ".join(f"{w.source_index}-{w.target_index}" for w in a.word_alignments)
    plain = translate(harness, TEXTS[:1], beam_size=2)
    assert not plain.translations[0].hypotheses[0].HasField("attention")


def test_translate_stream_one_response_per_request_in_order(harness: ServerHarness) -> None:
    requests = [pb2.TranslateRequest(texts=[text]) for text in TEXTS] + [pb2.TranslateRequest(texts=TEXTS[:2])]
    responses = list(harness.stub.TranslateStream(iter(requests), timeout=30))
    assert len(responses) == len(requests)
    for request, response in zip(requests, responses, strict=True):
        assert [list(t.source_tokens) for t in response.translations] == [t.split() for t in request.texts]


def test_list_models(harness: ServerHarness) -> None:
    models = harness.stub.ListModels(pb2.ListModelsRequest(), timeout=10).models
    assert [(m.name, m.version) for m in models] == [(MODEL, "1"), (MODEL, "2"), (MODEL, "10")]
    assert [m.is_latest for m in models] == [False, False, True]
    manifest = harness.engine().manifest
    for m in models:
        assert m.is_default
        assert m.architecture == manifest.architecture
        assert (m.source_language, m.target_language) == (manifest.source_language, manifest.target_language)
        assert m.execution_provider == harness.engine().provider
        assert m.precision == manifest.precision
        assert m.max_beam_size == 8 and m.default_beam_size == min(8, manifest.defaults["beam_size"])
        assert m.training_corpus == str(manifest.training.get("corpus", ""))


def test_request_id_is_echoed(harness: ServerHarness) -> None:
    request = pb2.TranslateRequest(texts=[TEXTS[3]])
    _, call = harness.stub.Translate.with_call(request, metadata=(("x-request-id", "abc-123"),), timeout=10)
    assert ("x-request-id", "abc-123") in call.trailing_metadata()
    _, call = harness.stub.Translate.with_call(request, timeout=10)
    generated = dict(call.trailing_metadata())["x-request-id"]
    assert len(generated) == 32
    error = rpc_error(lambda: harness.stub.Translate(pb2.TranslateRequest(), metadata=(("x-request-id", "bad-1"),)))
    assert ("x-request-id", "bad-1") in error.trailing_metadata()


# ---- health and reflection -----------------------------------------------------------------------------


def test_health_serving_overall_per_model_and_service(harness: ServerHarness) -> None:
    for service in ("", MODEL, SERVICE_NAME):
        reply = harness.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    error = rpc_error(lambda: harness.health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(harness: ServerHarness) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    database = ProtoReflectionDescriptorDatabase(harness.channel)
    services = database.get_services()
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
    pool = DescriptorPool(database)
    service = pool.FindServiceByName(SERVICE_NAME)
    assert [m.name for m in service.methods] == ["Translate", "TranslateStream", "ListModels", "Score",
                                                  "TranslateStreaming", "ListLanguages", "DetectLanguage",
                                                  "CreateGlossary", "ListGlossaries", "GetGlossary", "DeleteGlossary"]
    assert "subword_tokens" in pool.FindMessageTypeByName("translation.v1.Hypothesis").fields_by_name


# ---- errors --------------------------------------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
ERROR_CASES = [
    ("no texts", {"texts": []}, INVALID, "no texts"),
    ("empty text", {"texts": ["ok", ""]}, INVALID, "texts[1] is empty"),
    ("whitespace text", {"texts": [" \t\n"]}, INVALID, "texts[0] is empty or whitespace-only"),
    ("too many texts", {"texts": ["one"] * 65}, INVALID, "too many texts: 65, the limit is 64"),
    ("too many characters", {"texts": ["a" * 20001]}, INVALID, "20001 characters, the limit is 20000"),
    ("too many characters in all", {"texts": ["a" * 19000] * 6}, INVALID, "the limit is 100000 per request"),
    # a text read as one sentence (a text cut into sentences has each too long one cut again)
    ("too many tokens", {"texts": [" ".join(["one"] * 300)], "sentence_splitting": pb2.SPLIT_OFF}, INVALID,
     "tokens, the limit is 256"),
    ("too many tokens, large request", {"texts": ["day 1 of May"] * 4 + ["number 1 " * 222],
                                        "sentence_splitting": pb2.SPLIT_OFF}, INVALID,
     "texts[4] sentence 0 has"),  # tokenized off the event loop
    ("beam over max", {"options": {"beam_size": 9}}, INVALID, "beam_size 9 is over the limit of 8"),
    ("n-best over beam", {"options": {"beam_size": 2, "num_hypotheses": 3}}, INVALID,
     "num_hypotheses 3 is larger than the beam size 2"),
    ("n-best over default beam", {"options": {"num_hypotheses": 8}}, INVALID, "(the model's default)"),
    ("max_length over limit", {"options": {"max_length": 513}}, INVALID, "max_length 513 is over the limit of 512"),
    ("negative length penalty", {"options": {"length_penalty": -1.0}}, INVALID, "length_penalty -1.0 must be"),
    ("nan length penalty", {"options": {"length_penalty": math.nan}}, INVALID, "length_penalty nan must be"),
    ("unknown model", {"model": "klingon"}, grpc.StatusCode.NOT_FOUND, "unknown model 'klingon'; available: tiny"),
    ("unknown version", {"model": MODEL, "model_version": "7"}, grpc.StatusCode.NOT_FOUND,
     "model 'tiny' has no version '7'; available: 1, 2, 10"),
]


@pytest.mark.parametrize(("request_fields", "code", "message"), [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_errors_have_status_and_message(harness: ServerHarness, request_fields: dict, code: grpc.StatusCode,
                                        message: str) -> None:
    fields = {"texts": [TEXTS[0]], **request_fields}
    options = pb2.DecodingOptions(**fields.pop("options", {}))
    request = pb2.TranslateRequest(options=options, **fields)
    error = rpc_error(lambda: harness.stub.Translate(request, timeout=10))
    assert error.code() == code
    assert message in error.details()
    # in a stream the failing request gets its error in its response, and the valid one after it is answered
    valid = pb2.TranslateRequest(texts=[TEXTS[0]])
    failed, answered = harness.stub.TranslateStream(iter([request, valid]), timeout=10)
    assert (failed.error.code, failed.error.message) == (code.value[0], error.details())
    assert not failed.translations
    assert answered.error.code == 0 and len(answered.translations) == 1


def test_deadline_shorter_than_the_work_leaves_the_batch(repository: Path) -> None:
    h = ServerHarness(test_config(repository), wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.1)))
    try:
        long_text = " ".join(TEXTS)
        error = rpc_error(lambda: translate(h, [long_text], timeout=0.25))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        cancelled = {"model": MODEL, "version": "10"}
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", cancelled) == 1)
        [result] = h.engine().results  # the batch ended early: its only sentence left it
        assert result.cancelled == 1 and result.results == [None]
        # a cancelled call also leaves its batch
        future = h.stub.Translate.future(pb2.TranslateRequest(texts=[long_text]), timeout=30)
        wait_for(lambda: h.scheduler().running)
        future.cancel()
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", cancelled) == 2)
        assert h.engine().results[-1].cancelled == 1
        assert h.metric("nmt_requests_total", {"model": MODEL, "method": "Translate", "code": "CANCELLED"}) == 1
    finally:
        h.close()


def test_deadline_that_cannot_be_met_is_refused_before_compute(repository: Path) -> None:
    h = ServerHarness(test_config(repository), wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.02)))
    try:
        translate(h, [TEXTS[0]])  # measures the cost rate
        batches = len(h.engine().results)
        rate = h.scheduler().seconds_per_cost
        assert rate is not None and rate > 0
        assert h.scheduler().estimate_seconds(cost=20 * 10) > 1.0  # 20 sentences of about 10 tokens
        error = rpc_error(lambda: translate(h, TEXTS * 4, timeout=0.5))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline cannot be met" in error.details()
        assert len(h.engine().results) == batches  # no compute was spent on it
    finally:
        h.close()


def test_full_queue_gives_resource_exhausted(repository: Path) -> None:
    config = test_config(repository, queue_size=4, max_texts=4)
    h = ServerHarness(config, wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.05)))
    try:
        first = h.stub.Translate.future(pb2.TranslateRequest(texts=[TEXTS[0]]), timeout=30)
        wait_for(lambda: h.scheduler().running)
        queued = h.stub.Translate.future(pb2.TranslateRequest(texts=TEXTS[:4]), timeout=30)
        wait_for(lambda: h.scheduler().queue_depth == 4)
        error = rpc_error(lambda: translate(h, [TEXTS[1]]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in error.details() and "limit 4" in error.details()
        assert len(first.result().translations) == 1 and len(queued.result().translations) == 4
    finally:
        h.close()


def test_engine_failure_fails_only_its_request(repository: Path) -> None:
    h = ServerHarness(test_config(repository), wrapping_loader(lambda e: FailingEngine(e, 0)))
    try:
        call = h.stub.Translate.with_call
        error = rpc_error(lambda: call(pb2.TranslateRequest(texts=[TEXTS[0]], options=pb2.DecodingOptions(
            max_length=13)), timeout=10, metadata=(("x-request-id", "req-13"),)))
        assert error.code() == grpc.StatusCode.INTERNAL
        assert error.details() == ("inference failed for request req-13 (RuntimeError); the server logged the "
                                   "details under this request id")  # the exception itself stays in the log
        # an invalid request next to valid ones fails alone, and the batcher keeps running
        futures = [h.stub.Translate.future(pb2.TranslateRequest(texts=[text]), timeout=30) for text in TEXTS]
        bad = h.stub.Translate.future(pb2.TranslateRequest(texts=[TEXTS[0]],
                                                           options=pb2.DecodingOptions(beam_size=99)), timeout=30)
        assert all(len(f.result().translations) == 1 for f in futures)
        assert bad.exception().code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        h.close()


# ---- load --------------------------------------------------------------------------------------------


def assert_batched_as_alone(got: Any, expected: Any) -> None:
    """What batching keeps exact and what it keeps within float tolerance: the same tokens, text and word
    alignments (up to an exact tie between two hypotheses' scores); scores and attention weights within 1e-5,
    since the padding of other sentences in the batch changes how the kernels sum the last float bits."""
    if got.text != expected.text:  # an exact tie, decided the other way
        assert got.score == pytest.approx(expected.score, abs=1e-4), (got.text, expected.text)
        return
    assert list(got.subword_tokens) == list(expected.subword_tokens) and list(got.tokens) == list(expected.tokens)
    assert got.attention.pharaoh == expected.attention.pharaoh
    assert got.score == pytest.approx(expected.score, abs=1e-5)
    np.testing.assert_allclose(got.token_scores, expected.token_scores, atol=1e-5)
    np.testing.assert_allclose(got.attention.weights, expected.attention.weights, atol=1e-5)


def test_64_concurrent_clients_are_batched(harness: ServerHarness) -> None:
    texts = [f"number {i}" if i % 2 else f"day {i % 28 + 1} of May" for i in range(64)]
    options = pb2.DecodingOptions(return_scores=True, return_attention=True)
    alone = {text: best(translate(harness, [text], return_scores=True, return_attention=True)) for text in texts}
    labels = {"model": MODEL, "version": "10"}

    def histogram() -> tuple[float, float, float]:  # batches, sentences, batches of one sentence
        return (harness.metric("nmt_batch_size_sentences_count", labels),
                harness.metric("nmt_batch_size_sentences_sum", labels),
                harness.metric("nmt_batch_size_sentences_bucket", {**labels, "le": "1.0"}))

    before = histogram()
    channels = [grpc.insecure_channel(harness.address) for _ in texts]  # 64 clients, one connection each
    try:
        futures = [pb2_grpc.TranslatorStub(c).Translate.future(
            pb2.TranslateRequest(texts=[t], options=options), timeout=60)
            for c, t in zip(channels, texts, strict=True)]
        responses = [f.result() for f in futures]
    finally:
        for c in channels:
            c.close()
    for text, response in zip(texts, responses, strict=True):
        assert list(response.translations[0].source_tokens) == text.split()
        assert_batched_as_alone(best(response), alone[text])
    batches, sentences, singles = (after - b for after, b in zip(histogram(), before, strict=True))
    assert sentences == 64
    assert singles < batches < 64  # batches of several sentences formed


# ---- metrics -------------------------------------------------------------------------------------------

EXPECTED_METRICS = {
    "nmt_requests": "counter",
    "nmt_request_duration_seconds": "histogram",
    "nmt_queue_duration_seconds": "histogram",
    "nmt_inference_duration_seconds": "histogram",
    "nmt_batch_size_sentences": "histogram",
    "nmt_batch_size_tokens": "histogram",
    "nmt_batch_padding_ratio": "histogram",
    "nmt_generated_tokens": "counter",
    "nmt_source_tokens": "counter",
    "nmt_cancelled_sentences": "counter",
    "nmt_queue_depth": "gauge",
    "nmt_inflight_requests": "gauge",
    "nmt_model_info": "gauge",
    "grpc_server_started": "counter",
    "grpc_server_handled": "counter",
    "grpc_server_handling_seconds": "histogram",
}


def test_metrics_endpoint_after_traffic(harness: ServerHarness) -> None:
    translate(harness, TEXTS[:2])
    rpc_error(lambda: translate(harness, [], timeout=5))
    harness.stub.ListModels(pb2.ListModelsRequest(), timeout=5)
    url = f"http://127.0.0.1:{harness.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in EXPECTED_METRICS.items():
        assert name in families, name
        assert families[name].type == kind, name

    def samples(name: str, suffix: str = "") -> list[Any]:
        return [s for s in families[name].samples if s.name == name + suffix]

    ok = [s for s in samples("nmt_requests", "_total") if s.labels == {"model": MODEL, "method": "Translate",
                                                                        "code": "OK"}]
    assert ok and ok[0].value >= 1
    assert any(s.labels["code"] == "INVALID_ARGUMENT" for s in samples("nmt_requests", "_total"))
    stages = {s.labels["stage"] for s in samples("nmt_inference_duration_seconds", "_count")}
    assert stages == {"encode", "join", "decode"}
    [info] = [s for s in samples("nmt_model_info") if s.labels["version"] == "10"]
    assert info.value == 1 and info.labels["model"] == MODEL and info.labels["provider"]
    handled = {(s.labels["grpc_method"], s.labels["grpc_code"]) for s in samples("grpc_server_handled", "_total")}
    assert {("Translate", "OK"), ("Translate", "INVALID_ARGUMENT"), ("ListModels", "OK")} <= handled
    started = [s for s in samples("grpc_server_started", "_total") if s.labels["grpc_method"] == "Translate"]
    assert started[0].labels == {"grpc_type": "UNARY", "grpc_service": SERVICE_NAME, "grpc_method": "Translate"}
    assert samples("grpc_server_handling_seconds", "_count")
    for counter in ("nmt_generated_tokens", "nmt_source_tokens"):
        values = {s.labels["version"]: s.value for s in samples(counter, "_total")}
        assert values["10"] > 0 and set(values) == {"1", "2", "10"}  # every version exported from the start
    assert {s.labels["version"] for s in samples("nmt_cancelled_sentences", "_total")} == {"1", "2", "10"}
    assert {s.labels["version"] for s in samples("nmt_queue_depth")} == {"1", "2", "10"}
    for s in families["nmt_requests"].samples:  # bounded labels: no texts, no request ids
        assert set(s.labels) == {"model", "method", "code"}


def test_a_versions_series_bound_once_follow_its_removal_and_return() -> None:
    """A scheduler's series (:meth:`ServerMetrics.version_series`) are the exported ones; a removed version's are
    gone from the scrape and stay gone when its old scheduler writes on; a version loaded again gets new ones."""
    from prometheus_client import CollectorRegistry

    from server.metrics import ServerMetrics

    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    labels = {"model": "m", "version": "1"}
    old = metrics.version_series("m", "1")
    old.queue_depth.set(3)
    old.decode_duration.observe(0.5)
    assert registry.get_sample_value("nmt_queue_depth", labels) == 3
    assert registry.get_sample_value("nmt_inference_duration_seconds_sum", {**labels, "stage": "decode"}) == 0.5
    metrics.remove_model("m", "1")
    old.queue_depth.set(5)  # the removed version's scheduler, draining
    assert registry.get_sample_value("nmt_queue_depth", labels) is None
    assert registry.get_sample_value("nmt_inference_duration_seconds_count", {**labels, "stage": "decode"}) is None
    metrics.version_series("m", "1").queue_depth.set(1)
    assert registry.get_sample_value("nmt_queue_depth", labels) == 1


# ---- shutdown ------------------------------------------------------------------------------------------


def test_graceful_shutdown_drains(repository: Path) -> None:
    h = ServerHarness(test_config(repository), wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.1)))
    try:
        stream_requests: queue.Queue = queue.Queue()
        stream = h.stub.TranslateStream(iter(stream_requests.get, None), timeout=30)
        stream_requests.put(pb2.TranslateRequest(texts=[TEXTS[0]]))
        assert len(next(stream).translations) == 1  # an open stream, idle between requests
        inflight = h.stub.Translate.future(pb2.TranslateRequest(texts=[" ".join(TEXTS)]), timeout=30)
        wait_for(lambda: h.scheduler().running)
        done = h.start_shutdown(grace=20)
        with pytest.raises(grpc.RpcError) as closed:  # the idle stream is closed at once
            next(stream)
        assert closed.value.code() == grpc.StatusCode.UNAVAILABLE
        stream_requests.put(None)
        status = h.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        status = h.health.Check(health_pb2.HealthCheckRequest(service=MODEL), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        error = rpc_error(lambda: translate(h, [TEXTS[0]], timeout=5))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in error.details()
        assert not inflight.done()
        response = inflight.result(timeout=30)  # the in-flight request finished
        assert len(response.translations) == 1 and response.translations[0].hypotheses
        done.result(timeout=30)
        with pytest.raises(grpc.RpcError):  # the server is gone
            translate(h, [TEXTS[0]], timeout=2)
    finally:
        h.close()


# ---- units: batching policy and configuration -----------------------------------------------------------


def _pending(tokens: int, seq: int, work: int = 1) -> Pending:
    sentence = SentenceRequest(list(range(tokens - 1)), DecodingOptions(beam_size=1))
    return Pending(RequestHandle(), sentence, tokens, work, None, 0.0, seq)  # type: ignore[arg-type]


def test_form_batch_respects_budget_and_sorts_by_length() -> None:
    lengths = [10, 3, 50, 4, 11, 12, 3, 9]
    queue = [_pending(n, i) for i, n in enumerate(lengths)]
    batch = form_batch(queue, queue[0], BatchPolicy(batch_tokens=48, max_batch_sentences=4))
    assert queue[0] in batch
    assert len(batch) * max(p.tokens for p in batch) <= 48 and len(batch) <= 4
    assert [p.tokens for p in batch] == sorted(p.tokens for p in batch)
    assert [p.tokens for p in batch] == [9, 10, 11, 12]  # neighbours in length, not the short ones
    alone = form_batch(queue, queue[2], BatchPolicy(batch_tokens=60, max_batch_sentences=4))
    assert [p.tokens for p in alone] == [50]  # the oldest always goes, even when nothing fits beside it


class RecordingEngine:
    """A stand-in engine for batching-policy tests: records batch sizes, takes ``seconds`` per batch."""

    tokenizer = SimpleNamespace(max_piece_bytes=8)

    model = None

    def __init__(self, seconds: float) -> None:
        self.seconds, self.batches = seconds, []

    def tokenize(self, text: str) -> list[int]:
        return [5, 6]

    def search_batch(self, requests: Any) -> BatchResult:
        self.batches.append(len(requests))
        time.sleep(self.seconds)
        return BatchResult([SearchResult() for _ in requests], 0.0, self.seconds, 0, 0, 0.0, 0)


async def submit_one(scheduler: ModelScheduler, options: DecodingOptions, request: RequestHandle | None = None) -> Any:
    """One sentence of two tokens through ``scheduler`` (a :class:`RecordingEngine`'s)."""
    return await scheduler.submit([SentenceRequest([5, 6], options)], [8], request)


def test_batcher_waits_only_for_companions_it_can_expect() -> None:
    """A lone caller never pays max_wait; callers of a finished batch get max_wait to come back together."""
    options = DecodingOptions(beam_size=1)

    async def scenario() -> tuple[float, float, list[int]]:
        engine = RecordingEngine(seconds=0.02)
        scheduler = ModelScheduler(engine, policy=BatchPolicy(max_wait_seconds=2.0))
        scheduler.start()
        start = time.monotonic()
        await submit_one(scheduler, options)
        lone = time.monotonic() - start

        async def caller(i: int) -> None:
            await submit_one(scheduler, options)
            await asyncio.sleep(0.01 * i)  # the callers come back at different moments ...
            await submit_one(scheduler, options)

        start = time.monotonic()
        await asyncio.gather(*(caller(i) for i in range(4)))
        together = time.monotonic() - start
        await scheduler.close()
        return lone, together, engine.batches

    lone, together, batches = asyncio.run(scenario())
    assert lone < 1.0  # not the 2 s max_wait: nothing else was outstanding
    assert batches == [1, 4, 4]  # ... yet they are batched together again, without splitting
    assert together < 1.0  # and without waiting out max_wait: the batch starts once all 4 are back


class EchoEngine(RecordingEngine):
    """A :class:`RecordingEngine` whose search result is each sentence's own source ids."""

    def search_batch(self, requests: Any) -> BatchResult:
        result = super().search_batch(requests)
        result.results[:] = [SearchResult([ScoredSequence(list(r.source_ids), 0.0, [])]) for r in requests]
        return result


def test_a_call_is_answered_once_in_order_and_a_withdrawn_one_never() -> None:
    """``enqueue`` (the engine core's way in, no task per call): the answer comes once, with the results in the
    request's order; a withdrawn call's queued sentences leave the queue and it is never answered."""

    async def scenario() -> tuple[list[tuple], RequestHandle, int, list[int]]:
        engine = EchoEngine(seconds=0.05)
        scheduler = ModelScheduler(engine, policy=BatchPolicy(max_batch_sentences=1))
        scheduler.start()
        answers: list[tuple] = []
        done = asyncio.Event()

        def sentences(*ids: int) -> list[SentenceRequest]:
            return [SentenceRequest([i], DecodingOptions(beam_size=1)) for i in ids]

        def answer(name: str) -> Any:
            return lambda results, error: (answers.append((name, results, error)), done.set())

        scheduler.enqueue(sentences(1, 2, 3), [8] * 3, RequestHandle(), answer("a"))
        withdrawn = RequestHandle()
        call = scheduler.enqueue(sentences(4, 5), [8] * 2, withdrawn, answer("b"))
        await asyncio.sleep(0.02)  # the first sentence runs, four are queued
        scheduler.withdraw(withdrawn, call)
        queued = scheduler.queue_depth
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.1)  # nothing else comes
        await scheduler.close()
        return answers, withdrawn, queued, engine.batches

    answers, withdrawn, queued, batches = asyncio.run(scenario())
    assert queued == 2  # the withdrawn call's two sentences left the queue at once
    assert len(answers) == 1
    name, results, error = answers[0]
    assert (name, error) == ("a", None)
    assert [r.hypotheses[0].tokens for r in results] == [[1], [2], [3]]
    assert withdrawn.is_cancelled() and batches == [1, 1, 1]


def test_config_flags_env_and_validation(tmp_path: Path) -> None:
    import argparse

    from common.errors import NmtError
    from nmt.cli import build_parser

    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser, environ={"NMT_LISTEN": "0.0.0.0:6000", "NMT_MAX_BEAM": "4"})
    config = ServerConfig.from_args(parser.parse_args(["--max-beam", "5"]))
    assert (config.listen, config.max_beam) == ("0.0.0.0:6000", 5)  # flag beats environment
    assert ServerConfig.from_env({"NMT_BATCH_TOKENS": "512"}).batch_tokens == 512
    assert ServerConfig().listen == "127.0.0.1:50051"
    with pytest.raises(NmtError, match="batch_tokens"):
        ServerConfig(batch_tokens=100, max_tokens=256).validate()
    with pytest.raises(NmtError, match="listen"):
        ServerConfig(listen="nowhere").validate()
    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser, environ={"NMT_ORT_SPINNING": "yes"})
    assert ServerConfig.from_args(parser.parse_args([])).ort_spinning is True  # booleans: --flag / --no-flag
    assert ServerConfig.from_args(parser.parse_args(["--no-ort-spinning"])).ort_spinning is False
    assert ServerConfig.from_env({"NMT_ORT_SPINNING": "off"}).ort_spinning is False
    with pytest.raises(NmtError, match="NMT_ORT_SPINNING"):
        ServerConfig.from_env({"NMT_ORT_SPINNING": "maybe"})
    parser = argparse.ArgumentParser()  # choices are case-insensitive and stored in their canonical spelling
    ServerConfig.add_arguments(parser, environ={"NMT_PROVIDER": "CPU"})
    config = ServerConfig.from_args(parser.parse_args(["--log-level", "debug"]))
    assert (config.provider, config.log_level) == ("cpu", "DEBUG")
    assert ServerConfig.from_env({"NMT_LOG_LEVEL": "warning"}).log_level == "WARNING"
    with pytest.raises(NmtError, match="log_level must be one of DEBUG, INFO, WARNING, ERROR, got 'loud'"):
        ServerConfig(log_level="loud").validate()
    with pytest.raises(SystemExit):
        parser.parse_args(["--provider", "tpu"])
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--listen", "--metrics-listen", "--batch-tokens", "--max-wait-ms", "--grace-seconds", "NMT_LISTEN"):
        assert flag in help_text


def mapped_packages(pid: int) -> set[str]:
    """The site-packages distributions whose files (native libraries) the process ``pid`` maps."""
    paths = (line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return {path.split("site-packages/")[1].split("/")[0] for path in paths if "site-packages/" in path}


def test_nmt_serve_command_serves_and_stops_on_sigterm(repository: Path) -> None:
    command = [sys.executable, "-m", "nmt", "serve", "--model-repository", str(repository), "--listen",
               "127.0.0.1:0", "--provider", "cpu", "--intra-op-threads", "1", "--grace-seconds", "5"]
    # environment variables configure too
    env = {**os.environ, "NMT_METRICS_LISTEN": "", "NMT_HTTP_LISTEN": "", "NMT_MAX_BEAM": "3"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=Path(__file__).resolve().parent.parent)
    try:
        lines = []
        for line in process.stderr:  # JSON-lines logs (skipping any native library chatter)
            if line.startswith("{"):
                lines.append(json.loads(line))
                if lines[-1]["message"] == "serving":
                    break
        port = lines[-1]["port"]
        assert lines[-1]["metrics_port"] is None
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb2_grpc.TranslatorStub(channel)
            response, call = stub.Translate.with_call(pb2.TranslateRequest(texts=[TEXTS[0]]), timeout=30,
                                                      metadata=(("x-request-id", "cli-test"),))
            assert len(response.translations) == 1
            assert {m.max_beam_size for m in stub.ListModels(pb2.ListModelsRequest(), timeout=10).models} == {3}
        # the HTTP face is off and protoc runs in a process of its own: the server never loads the HTTP stack
        # or the compiler (18 MiB of its memory); the probe sees such a library where one is loaded (aiohttp here)
        assert not {"aiohttp", "grpc_tools"} & mapped_packages(process.pid)
        importlib.import_module("aiohttp.http_parser")
        assert "aiohttp" in mapped_packages(os.getpid())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        logs = lines + [json.loads(line) for line in process.stderr if line.startswith("{")]
        [request_log] = [entry for entry in logs if entry.get("request_id") == "cli-test"]
        assert request_log["code"] == "OK" and request_log["method"] == "Translate" and request_log["model"] == MODEL
        assert [entry["message"] for entry in logs][-2:] == ["shutting down", "stopped"]
        # the commands it suggests name the port it bound, not the 0 it was given
        hint = process.stdout.read()
        assert f"serving {MODEL} on 127.0.0.1:{port} (metrics: off); try:" in hint
        assert f'--server 127.0.0.1:{port} --model {MODEL}' in hint and "127.0.0.1:0" not in hint
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
        process.stdout.close()
