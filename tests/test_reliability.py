"""Reliability findings of issue 12, each against a real server on loopback: bad input is visible,
metrics are ready for alerting, work per request is bounded, one failing sentence fails one request."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from server.core.scheduler import ModelScheduler, form_batch
from server.frontend.documents.segmenter import Splitting, sentence_spans
from server.frontend.validation import response_bytes_bound
from server.metrics import metrics_table
from server.policy import BatchPolicy, RequestHandle
from server.protos import SERVICE_NAME, pb2
from server.types import DecodingOptions
from tests.conftest import EN
from tests.harness import ServerHarness
from tests.test_server import (
    MODEL,
    TEXTS,
    RecordingEngine,
    SlowEngine,
    _pending,
    default_loader,
    rpc_error,
    submit_one,
    test_config,
    translate,
    wait_for,
    wrapping_loader,
)

TRANSLATE = f"/{SERVICE_NAME}/Translate"
STREAM = f"/{SERVICE_NAME}/TranslateStream"
# Messages that do not parse as a TranslateRequest, by what is wrong with them.
UNDECODABLE = {
    "garbage bytes": b"\xff\xff\xff\xff",
    "invalid UTF-8 in texts": b"\x0a\x02\xc3\x28",
    "truncated field": b"\x0a\x10one two",
}


@pytest.fixture(scope="module")
def harness(repository: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(test_config(repository), default_loader())
    yield h
    h.close()


def raw_unary(harness: ServerHarness, method: str) -> grpc.UnaryUnaryMultiCallable:
    """A call that sends bytes as they are and returns the response bytes."""
    return harness.channel.unary_unary(method, request_serializer=None, response_deserializer=None)


# ---- finding 2: undecodable messages ---------------------------------------------------------------------


@pytest.mark.parametrize("payload", UNDECODABLE.values(), ids=UNDECODABLE.keys())
def test_undecodable_message_is_invalid_argument_counted_and_logged(
    harness: ServerHarness, payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    labels = {"grpc_service": SERVICE_NAME, "grpc_method": "Translate"}
    before = harness.metric("nmt_undecodable_messages_total", labels)
    failed_before = harness.metric("nmt_requests_total", {"model": "", "method": "Translate",
                                                          "code": "INVALID_ARGUMENT"})
    with caplog.at_level(logging.INFO, logger="nmt.server"):
        error = rpc_error(lambda: raw_unary(harness, TRANSLATE)(payload, timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(f"the request message could not be parsed ({len(payload)} bytes)")
        assert "<class" not in error.details() and "DecodeError" not in error.details()
        assert harness.metric("nmt_undecodable_messages_total", labels) == before + 1
        wait_for(lambda: harness.metric("nmt_requests_total", {"model": "", "method": "Translate",
                                                               "code": "INVALID_ARGUMENT"}) == failed_before + 1)
        wait_for(lambda: any(r.getMessage() == "request" for r in caplog.records))
    assert [r.getMessage() for r in caplog.records].count("undecodable message") == 1
    # the server is unharmed
    ok = harness.stub.Translate(pb2.TranslateRequest(texts=[TEXTS[0]]), timeout=10)
    assert len(ok.translations) == 1


def test_undecodable_messages_of_other_services_are_invalid_argument(harness: ServerHarness) -> None:
    health = raw_unary(harness, "/grpc.health.v1.Health/Check")
    assert rpc_error(lambda: health(b"\xff\xff", timeout=10)).code() == grpc.StatusCode.INVALID_ARGUMENT
    reflection = harness.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                               request_serializer=None, response_deserializer=None)
    error = rpc_error(lambda: list(reflection(iter([b"\xff\xff"]), timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- finding 5: one bad message in a stream --------------------------------------------------------------


def test_stream_answers_a_bad_message_with_its_error_and_goes_on(harness: ServerHarness) -> None:
    valid = pb2.TranslateRequest(texts=[TEXTS[0]]).SerializeToString()
    unknown_model = pb2.TranslateRequest(texts=[TEXTS[1]], model="klingon").SerializeToString()
    stream = harness.channel.stream_stream(STREAM, request_serializer=None,
                                           response_deserializer=pb2.TranslateResponse.FromString)
    sent = [valid, UNDECODABLE["invalid UTF-8 in texts"], valid, unknown_model, valid]
    responses = list(stream(iter(sent), timeout=30))
    assert len(responses) == len(sent)
    codes = [grpc.StatusCode.OK.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.OK.value[0],
             grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.OK.value[0]]
    assert [r.error.code for r in responses] == codes
    assert "could not be parsed" in responses[1].error.message
    assert "unknown model 'klingon'" in responses[3].error.message
    first = responses[0].translations[0].hypotheses[0].text
    assert [r.translations[0].hypotheses[0].text for r in responses[::2]] == [first] * 3
    assert all(not r.translations for r in responses[1::2])
    assert responses[0].model == MODEL


# ---- findings 3, 4, 7: metrics ready for alerting ----------------------------------------------------


def scrape(port: int) -> dict[str, Any]:
    """The live ``/metrics`` of a server, parsed: family name -> family."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_value(families: dict[str, Any], name: str, labels: dict[str, str]) -> float | None:
    family = families[name.removesuffix("_total").removesuffix("_count")]
    for sample in family.samples:
        if sample.name == name and sample.labels == labels:
            return sample.value
    return None


def test_error_series_exist_at_zero_before_the_first_error(repository: Path) -> None:
    fresh = ServerHarness(test_config(repository), default_loader())  # no request yet
    try:
        families = scrape(fresh.server.metrics_port)
        for model in ("", MODEL):
            for code in ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "INTERNAL"):
                for method in ("Translate", "TranslateStream"):
                    labels = {"model": model, "method": method, "code": code}
                    assert sample_value(families, "nmt_requests_total", labels) == 0.0, labels
        handled = {"grpc_type": "UNARY", "grpc_service": SERVICE_NAME, "grpc_method": "Translate",
                   "grpc_code": "INVALID_ARGUMENT"}
        assert sample_value(families, "grpc_server_handled_total", handled) == 0.0
        for version in ("1", "2", "10"):
            labels = {"model": MODEL, "version": version}
            assert sample_value(families, "nmt_cancelled_sentences_total", labels) == 0.0
            assert sample_value(families, "nmt_queue_duration_seconds_count", labels) == 0.0
            assert sample_value(families, "nmt_inference_duration_seconds_count", {**labels, "stage": "decode"}) == 0
        # the first error then moves an existing series (what rate() and increase() need)
        rpc_error(lambda: fresh.stub.Translate(pb2.TranslateRequest(texts=[""]), timeout=10))
        labels = {"model": "", "method": "Translate", "code": "INVALID_ARGUMENT"}
        wait_for(lambda: sample_value(scrape(fresh.server.metrics_port), "nmt_requests_total", labels) == 1.0)
    finally:
        fresh.close()


def test_process_metrics_are_exported(harness: ServerHarness) -> None:
    families = scrape(harness.server.metrics_port)
    assert sample_value(families, "process_resident_memory_bytes", {}) > 10e6
    assert sample_value(families, "process_open_fds", {}) > 0
    assert sample_value(families, "process_cpu_seconds_total", {}) > 0
    assert "python_gc_objects_collected" in families


def test_the_metrics_table_matches_the_live_metrics(harness: ServerHarness) -> None:
    readme = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text(encoding="utf-8")
    start = readme.index("<!-- metrics-table")
    documented = readme[readme.index("\n", start) + 1 : readme.index("<!-- /metrics-table -->")].strip()
    live = metrics_table(scrape(harness.server.metrics_port).values())
    assert documented == live, "docs/metrics.md's table is stale: regenerate it with `python -m server.metrics`"


# ---- finding 1: bounded work per request, interleaving, earliest deadline first ---------------------------


def test_request_over_the_work_budget_is_refused_before_compute(repository: Path) -> None:
    h = ServerHarness(test_config(repository, max_request_work=2000), default_loader())
    try:
        texts = ["one two three four five six seven eight nine ten"] * 8
        error = rpc_error(lambda: translate(h, texts, beam_size=8))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request too large" in error.details() and "limit is 2000 (max_request_work)" in error.details()
        assert h.metric("nmt_source_tokens_total", {"model": MODEL, "version": "10"}) == 0  # nothing encoded
        assert len(translate(h, texts[:2], beam_size=2).translations) == 2  # within the budget
    finally:
        h.close()


def test_response_over_the_size_budget_is_refused_before_compute(repository: Path) -> None:
    h = ServerHarness(test_config(repository, max_response_bytes=20_000), default_loader())
    try:
        texts = [" ".join(["seven eight nine"] * 10)] * 4
        error = rpc_error(lambda: translate(h, texts, beam_size=4, num_hypotheses=4, return_attention=True))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limit is 20000 (max_response_bytes)" in error.details()
        assert h.metric("nmt_source_tokens_total", {"model": MODEL, "version": "10"}) == 0
        assert len(translate(h, texts[:1], beam_size=4).translations) == 1  # no attention: small enough
    finally:
        h.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(EN + ["ü", "日本", "x" * 30, "?!", "ninety-seven"]), min_size=1, max_size=40),
       count=st.integers(1, 3), beam=st.integers(1, 4), extra=st.integers(0, 3), attention=st.booleans(),
       penalty=st.sampled_from([0.0, 1.0, 10.0]), max_length=st.sampled_from([0, 1, 5, 512]))
@example(words=["one", "?!", "ü"], count=1, beam=1, extra=0, attention=False, penalty=0.0, max_length=5)  # 2 sentences
@example(words=["one"] * 18 + ["x" * 30] * 2 + ["one"] * 3, count=1, beam=1, extra=0, attention=True, penalty=0.0,
         max_length=1)  # a short output of a long source: its source pieces and words outweigh the hypothesis
def test_response_size_bound_holds_for_real_responses(harness: ServerHarness, words: list[str], count: int,
                                                      beam: int, extra: int, attention: bool, penalty: float,
                                                      max_length: int) -> None:
    texts = [" ".join(words[i:] or words) for i in range(count)]
    hypotheses = min(beam, 1 + extra)
    response = translate(harness, texts, beam_size=beam, num_hypotheses=hypotheses, return_attention=attention,
                         return_scores=True, length_penalty=penalty, max_length=max_length)
    engine = harness.engine()
    options = DecodingOptions(beam_size=beam, num_hypotheses=hypotheses, return_attention=attention,
                              max_length=max_length or 256)
    bound = 0
    for text in texts:  # as the server reads it: a text of several sentences is a document, with its own hypothesis
        sentences = [text[s:e] for s, e in sentence_spans(text, "en", Splitting.SENTENCES)]
        each = replace(options, num_hypotheses=hypotheses + 1) if len(sentences) > 1 else options
        bound += sum(response_bytes_bound(s, len(engine.tokenize(s)) + 1, each, engine.tokenizer.max_piece_bytes)
                     for s in sentences)
    assert response.ByteSize() <= bound


def test_form_batch_stays_within_the_batch_work() -> None:
    queue = [_pending(tokens=5, seq=i, work=100) for i in range(10)]
    batch = form_batch(queue, queue[3], BatchPolicy(batch_work=450))
    assert queue[3] in batch and len(batch) == 4
    alone = form_batch([_pending(5, 0, work=900), *queue], queue[0], BatchPolicy(batch_work=50))
    assert alone == [queue[0]]  # the most urgent sentence always goes, even over the budget


def test_small_request_behind_a_huge_one_meets_its_deadline(repository: Path) -> None:
    """A huge request is split into batches of at most ``batch_work``; a one-sentence request with a 1 s
    deadline sent just after it goes first at the next batch boundary (earliest deadline first)."""
    slow = wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.002))  # ~2 ms per sentence per step
    h = ServerHarness(test_config(repository, batch_work=1500), slow)
    try:
        huge = h.stub.Translate.future(pb2.TranslateRequest(
            texts=[" ".join(EN[: 4 + i % 6]) for i in range(64)],
            options=pb2.DecodingOptions(beam_size=8, num_hypotheses=8, length_penalty=10, return_attention=True)),
            timeout=120)
        wait_for(lambda: h.scheduler().running > 0)
        start = time.monotonic()
        small = translate(h, ["seven"], timeout=1.0)
        latency = time.monotonic() - start
        assert len(small.translations) == 1 and latency < 1.0
        batches = h.engine().results
        assert len(huge.result().translations) == 64
        assert max(len(r.translations) for r in batches) < 64  # the huge request took several batches
        assert len(batches) >= 64 * 8 * 20 // 1500
    finally:
        h.close()


def test_earliest_deadline_first() -> None:
    """Queued behind a running batch: the request due first is decoded first, whatever the arrival order."""
    options = DecodingOptions(beam_size=1)

    async def scenario() -> list[str]:
        engine = RecordingEngine(seconds=0.05)
        scheduler = ModelScheduler(engine, policy=BatchPolicy(max_batch_sentences=1))
        scheduler.start()
        order: list[str] = []

        async def call(name: str, timeout: float | None) -> None:
            await submit_one(scheduler, options, RequestHandle.with_timeout(timeout))
            order.append(name)

        blocker = asyncio.ensure_future(call("blocker", None))
        await asyncio.sleep(0.01)  # the blocker's batch is running
        calls = [call("no deadline", None), call("due in 30 s", 30), call("due in 5 s", 5), call("due in 10 s", 10)]
        await asyncio.gather(blocker, *calls)
        await scheduler.close()
        return order

    assert asyncio.run(scenario()) == ["blocker", "due in 5 s", "due in 10 s", "due in 30 s", "no deadline"]


# ---- fault isolation ------------------------------------------------------------------------------------


class PoisonEngine(SlowEngine):
    """The real engine, raising on every batch that holds the text ``poison`` (records the batches tried);
    a batch holding the text ``hold`` waits for :attr:`release`, so that requests can queue behind it."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, poll_seconds=0.0)
        self.tried: list[list[str]] = []
        self.release = threading.Event()

    def search_batch(self, requests: Any) -> Any:
        texts = [r.text for r in requests]
        self.tried.append(texts)
        if "hold" in texts:
            self.release.wait(30)
        if "poison" in texts:
            raise RuntimeError("injected fault: session run failed")
        return self.engine.search_batch(requests)


def test_fault_in_one_sentence_fails_only_its_request(repository: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = ServerHarness(test_config(repository), wrapping_loader(PoisonEngine))
    try:
        engine = h.engine()
        with caplog.at_level(logging.INFO, logger="nmt.server"):
            held = h.stub.Translate.future(pb2.TranslateRequest(texts=["hold"]), timeout=30)
            wait_for(lambda: ["hold"] in engine.tried)  # the worker is busy: what follows queues up together
            good = [h.stub.Translate.future(pb2.TranslateRequest(texts=[text]), timeout=30) for text in TEXTS]
            bad = h.stub.Translate.future(pb2.TranslateRequest(texts=["poison"]), timeout=30,
                                          metadata=(("x-request-id", "poisoned-1"),))
            wait_for(lambda: h.scheduler().queue_depth == len(TEXTS) + 1)
            engine.release.set()
            assert len(held.result().translations) == 1
            assert all(len(f.result().translations) == 1 for f in good)
            error = bad.exception()
        assert error.code() == grpc.StatusCode.INTERNAL and "request poisoned-1" in error.details()
        assert "injected fault" not in error.details()
        assert any("poison" in tried and len(tried) > 1 for tried in engine.tried)  # it shared a batch
        assert ["poison"] in engine.tried  # ... then ran alone
        failed = [r for r in caplog.records if r.getMessage() == "inference failed"]
        assert failed and failed[0].fields["request_id"] == "poisoned-1" and failed[0].exc_info
        # the server carries on
        assert len(translate(h, TEXTS[:2]).translations) == 2
    finally:
        h.close()


class BreakableEngine(SlowEngine):
    """The real engine, which fails every call (the smoke translation too) once ``broken`` is set."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, poll_seconds=0.0)
        self.broken = False

    def search_batch(self, requests: Any) -> Any:
        if self.broken:
            raise RuntimeError("injected fault: the session is broken")
        return self.engine.search_batch(requests)


def test_a_broken_engine_is_marked_not_serving_and_reloaded(repository: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    h = ServerHarness(test_config(repository, reload_interval=0), wrapping_loader(BreakableEngine))
    try:
        broken = h.engine()
        loads = {"model": MODEL, "result": "loaded"}
        loaded_before = h.metric("nmt_model_loads_total", loads)
        with caplog.at_level(logging.INFO, logger="nmt.server"):
            broken.broken = True
            for i in range(3):  # three failed requests in a row: the engine is probed, fails, is reloaded
                error = rpc_error(lambda i=i: translate(h, [TEXTS[i]]))
                assert error.code() == grpc.StatusCode.INTERNAL
            # the swap, its log line and the load counter happen one after the other: wait for all three
            wait_for(lambda: h.engine() is not broken
                     and "model version reloaded" in [r.getMessage() for r in caplog.records]
                     and h.metric("nmt_model_loads_total", loads) == loaded_before + 1, timeout=30)
            messages = [r.getMessage() for r in caplog.records]
        assert "engine broken: a known-good sentence fails too" in messages
        assert len(translate(h, TEXTS[:2]).translations) == 2
        status = h.health.Check(health_pb2.HealthCheckRequest(service=MODEL), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        h.close()


def test_a_poisoned_request_does_not_reload_a_healthy_engine(repository: Path) -> None:
    """Failures caused by one input: the probe translates fine, so the engine stays."""
    h = ServerHarness(test_config(repository, reload_interval=0), wrapping_loader(PoisonEngine))
    try:
        engine = h.engine()
        for _ in range(4):
            assert rpc_error(lambda: translate(h, ["poison"])).code() == grpc.StatusCode.INTERNAL
        assert len(translate(h, TEXTS[:1]).translations) == 1
        assert h.engine() is engine
    finally:
        h.close()


def test_closing_a_scheduler_answers_the_running_batch() -> None:
    """Closed with no time left while a batch runs (shutdown, or a removed version past its grace period):
    the running and queued sentences get UNAVAILABLE instead of hanging."""

    async def scenario() -> list[BaseException | list]:
        scheduler = ModelScheduler(RecordingEngine(seconds=0.5), policy=BatchPolicy(max_batch_sentences=1))
        scheduler.start()
        calls = [asyncio.ensure_future(submit_one(scheduler, DecodingOptions())) for _ in ("a", "b")]
        await asyncio.sleep(0.1)  # "a" is running, "b" queued
        await asyncio.wait_for(scheduler.close(timeout=0), 5)
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)

    outcomes = asyncio.run(scenario())
    assert [type(o).__name__ for o in outcomes] == ["Unavailable", "Unavailable"]
