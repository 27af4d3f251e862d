"""Fuzzing a live server on loopback (Hypothesis): whatever a client sends, input errors get their own
status code (never UNKNOWN or INTERNAL), and the server stays healthy and translates correctly.

Each test counts the requests it sent in ``SENT``; the last test checks the server afterwards and
prints the totals (``pytest -s tests/test_fuzz.py`` shows them).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.protos import SERVICE_NAME, pb2
from tests.conftest import EN
from tests.harness import ServerHarness
from tests.test_server import MODEL, TEXTS, default_loader, test_config

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)
INPUT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
# what a valid-looking request may also end with: its deadline, its cancellation, a full queue
CALL_OUTCOMES = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
SENT: Counter[str] = Counter()

texts = st.one_of(
    st.text(max_size=60),  # any unicode, control characters included
    st.text(st.characters(codec="utf-8", categories=["Cc", "Cf", "Zs", "Zl", "Zp", "Co", "So"]), max_size=30),
    st.lists(st.sampled_from(EN), min_size=1, max_size=8).map(" ".join),
    st.just(""),
    st.integers(20001, 21000).map(lambda n: "seven " * (n // 6 + 1)),  # over max_chars
    st.integers(60, 400).map(lambda n: "one " * n),  # over max_tokens or the work budget
)
options = st.builds(
    pb2.DecodingOptions,
    beam_size=st.integers(0, 12),
    num_hypotheses=st.integers(0, 12),
    max_length=st.integers(0, 1000),
    length_penalty=st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0])),
    return_attention=st.booleans(),
    return_scores=st.booleans(),
)
requests = st.builds(
    pb2.TranslateRequest,
    texts=st.lists(texts, max_size=70),
    model=st.one_of(st.just(""), st.just(MODEL), st.text(max_size=12)),
    model_version=st.one_of(st.just(""), st.sampled_from(["1", "2", "10", "7", "x"]), st.text(max_size=5)),
    options=options,
)


@pytest.fixture(scope="module")
def harness(repository: Path) -> Iterator[ServerHarness]:
    h = ServerHarness(test_config(repository), default_loader())
    yield h
    h.close()


def assert_well_formed(request: pb2.TranslateRequest, response: pb2.TranslateResponse) -> None:
    assert len(response.translations) == len(request.texts)
    for translation in response.translations:
        assert translation.hypotheses
        for hypothesis in translation.hypotheses:
            assert all(math.isfinite(s) for s in hypothesis.token_scores)


@settings(FUZZ, max_examples=400)
@given(request=requests, timeout=st.one_of(st.none(), st.floats(0.001, 3.0)))
def test_random_requests(harness: ServerHarness, request: pb2.TranslateRequest, timeout: float | None) -> None:
    SENT["Translate"] += 1
    try:
        response = harness.stub.Translate(request, timeout=30 if timeout is None else timeout)
    except grpc.RpcError as error:
        assert error.code() in INPUT_ERRORS | CALL_OUTCOMES, (error.code(), error.details())
        assert error.details() and "Traceback" not in error.details() and "<class" not in error.details()
        return
    assert_well_formed(request, response)


@settings(FUZZ, max_examples=150)
@given(payload=st.binary(max_size=300))
def test_random_bytes_as_the_message(harness: ServerHarness, payload: bytes) -> None:
    SENT["raw bytes"] += 1
    call = harness.channel.unary_unary(f"/{SERVICE_NAME}/Translate", request_serializer=None,
                                       response_deserializer=pb2.TranslateResponse.FromString)
    try:
        call(payload, timeout=10)  # some byte strings are valid messages (e.g. empty = no texts)
    except grpc.RpcError as error:
        assert error.code() in INPUT_ERRORS | {grpc.StatusCode.RESOURCE_EXHAUSTED}, (error.code(), error.details())


@settings(FUZZ, max_examples=40)
@given(batch=st.lists(st.one_of(requests, st.binary(max_size=40)), min_size=1, max_size=12))
def test_random_streams(harness: ServerHarness, batch: list) -> None:
    SENT["TranslateStream messages"] += len(batch)
    raw = [m if isinstance(m, bytes) else m.SerializeToString() for m in batch]
    stream = harness.channel.stream_stream(f"/{SERVICE_NAME}/TranslateStream", request_serializer=None,
                                           response_deserializer=pb2.TranslateResponse.FromString)
    responses = list(stream(iter(raw), timeout=60))
    assert len(responses) == len(raw)  # one per message, bad ones included
    for response in responses:
        if response.HasField("error"):
            assert grpc.StatusCode.INVALID_ARGUMENT.value[0] <= response.error.code  # never OK(0) or UNKNOWN(2)
            assert response.error.code not in (grpc.StatusCode.UNKNOWN.value[0], grpc.StatusCode.INTERNAL.value[0])


@settings(FUZZ, max_examples=40)
@given(texts_=st.lists(st.lists(st.sampled_from(EN), min_size=1, max_size=8).map(" ".join), min_size=1,
                       max_size=16),
       beam=st.integers(1, 8), after=st.floats(0.0, 0.05))
def test_cancellations_midway(harness: ServerHarness, texts_: list[str], beam: int, after: float) -> None:
    SENT["cancelled midway"] += 1
    future = harness.stub.Translate.future(pb2.TranslateRequest(
        texts=texts_, options=pb2.DecodingOptions(beam_size=beam, return_attention=True)), timeout=30)
    time.sleep(after)
    future.cancel()
    with contextlib.suppress(grpc.FutureCancelledError):
        future.result()


def test_server_is_healthy_and_correct_afterwards(harness: ServerHarness, repository: Path) -> None:
    """Runs after the fuzzing above (file order): same answers as a fresh server, health SERVING."""
    fresh = ServerHarness(test_config(repository), default_loader())
    try:
        request = pb2.TranslateRequest(texts=TEXTS, options=pb2.DecodingOptions(beam_size=4, return_scores=True))
        expected = fresh.stub.Translate(request, timeout=30)
    finally:
        fresh.close()
    got = harness.stub.Translate(request, timeout=30)
    assert [t.hypotheses[0].text for t in got.translations] == [t.hypotheses[0].text for t in expected.translations]
    status = harness.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    scheduler = harness.scheduler()
    assert scheduler.queue_depth == 0 and scheduler.running == 0
    print(f"\nfuzzed requests: {dict(SENT)}, total {sum(SENT.values())}")
    assert sum(SENT.values()) > 0 or not SENT  # (the fuzz tests may have been deselected)
