"""The HTTP/JSON face against a live server on loopback: the same answers as gRPC, gateway status codes,
the deadline header, client disconnects, CORS, readiness during drain and the metrics."""

from __future__ import annotations

import http.client
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from server.config import ServerConfig
from server.frontend.http_face import HTTP_STATUS, http_routes, parse_timeout
from server.logs import JsonFormatter
from server.protos import SERVICE_NAME, pb2, translator_descriptor
from tests.harness import ServerHarness
from tests.test_server import MODEL, TEXTS, FailingEngine, SlowEngine, default_loader, wait_for, wrapping_loader

REQUEST = {"texts": ["one two three", "four five"],
           "options": {"beamSize": 3, "numHypotheses": 2, "returnAttention": True, "returnScores": True}}


def http_config(repo: Path, **changes: Any) -> ServerConfig:
    base = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="127.0.0.1:0", model_repository=str(repo),
                        provider="cpu", intra_op_threads=1, grace_seconds=5)
    return base.with_(**changes)


def call(h: ServerHarness, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 30) -> tuple[int, dict[str, str], Any]:
    """One HTTP request to the harness's HTTP port: status, headers (lower-case names), parsed JSON body."""
    connection = http.client.HTTPConnection("127.0.0.1", h.server.http_port, timeout=timeout)
    try:
        data = body if isinstance(body, str | bytes) or body is None else json.dumps(body)
        connection.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        raw = response.read()
        kind = response.getheader("content-type") or ""
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                json.loads(raw) if raw and "json" in kind else raw)
    finally:
        connection.close()


@pytest.fixture(scope="module")
def both(tiny_models: dict[str, Path], tiny_repository: Path) -> Iterator[ServerHarness]:
    """Both architectures (tiny-transformer, tiny-bahdanau), gRPC and HTTP."""
    h = ServerHarness(http_config(tiny_repository), default_loader())
    yield h
    h.close()


def test_routes_come_from_the_proto_annotations() -> None:
    routes = {(r.verb, r.path): (r.method.name, r.body) for r in http_routes(translator_descriptor())}
    assert routes[("POST", "/v1/translate")] == ("Translate", "*")
    assert routes[("GET", "/v1/models")] == ("ListModels", "")
    assert routes[("POST", "/v1/translate:stream")] == ("TranslateStreaming", "*")  # server-sent events
    assert "TranslateStream" not in {name for name, _ in routes.values()}  # a request stream: gRPC only


def events(raw: bytes) -> list[tuple[str, dict]]:
    """A ``text/event-stream`` body: (event name, its JSON data) per event ("message" unless named)."""
    found = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            fields = dict(line.split(": ", 1) for line in block.splitlines())
            found.append((fields.get("event", "message"), json.loads(fields["data"])))
    return found


@pytest.mark.parametrize("model", ["tiny-transformer", "tiny-bahdanau"])
def test_server_sent_events_equal_grpc_streaming(both: ServerHarness, model: str) -> None:
    body = {"texts": ["three four five six"], "model": model, "options": {"beamSize": 1, "returnScores": True}}
    status, headers, raw = call(both, "POST", "/v1/translate:stream", body, {"x-request-id": "sse-1"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-request-id"] == "sse-1"
    got = [json_format.ParseDict(data, pb2.TranslationDelta()) for _, data in events(raw)]
    expected = list(both.stub.TranslateStreaming(json_format.ParseDict(body, pb2.TranslateRequest()), timeout=30))
    assert {name for name, _ in events(raw)} == {"message"} and len(got) > 1
    assert got[-1].final == expected[-1].final and not any(d.HasField("final") for d in got[:-1])
    best = got[-1].final.translations[0].hypotheses[0]  # (how pieces group into messages depends on timing)
    assert "".join(d.text for d in got) == best.text and [p for d in got for p in d.subword_tokens] == list(
        best.subword_tokens)


def test_server_sent_events_errors(both: ServerHarness) -> None:
    status, headers, body = call(both, "POST", "/v1/translate:stream", {"texts": ["one", "two"]})
    assert status == 400 and body["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # before any event: a status
    assert "exactly one text" in body["message"]
    status, _, body = call(both, "POST", "/v1/translate:stream", {"texts": ["one"], "model": "nope"})
    assert status == 404 and body["code"] == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("model", ["tiny-transformer", "tiny-bahdanau"])
def test_json_round_trip_equals_grpc(both: ServerHarness, model: str) -> None:
    status, headers, body = call(both, "POST", "/v1/translate", {**REQUEST, "model": model})
    assert status == 200 and headers["content-type"].startswith("application/json")
    request = json_format.ParseDict({**REQUEST, "model": model}, pb2.TranslateRequest())
    expected = both.stub.Translate(request, timeout=30)
    got = json_format.ParseDict(body, pb2.TranslateResponse())
    assert got == expected  # texts, words, scores, attention weights and alignments, bit for bit
    assert body == json_format.MessageToDict(expected, always_print_fields_with_no_presence=True)
    first = body["translations"][0]["hypotheses"][0]
    assert first["attention"]["targetLength"] * first["attention"]["sourceLength"] == len(first["attention"]["weights"])
    assert len(body["translations"]) == 2 and len(body["translations"][1]["hypotheses"]) == 2
    # snake_case field names are accepted too (the proto3 JSON mapping)
    status, _, snake = call(both, "POST", "/v1/translate", {"texts": ["one two three"], "model": model,
                                                            "options": {"beam_size": 3, "return_scores": True}})
    assert status == 200 and snake["translations"][0]["hypotheses"][0]["score"] < 0


def test_list_models_equals_grpc(both: ServerHarness) -> None:
    status, _, body = call(both, "GET", "/v1/models")
    assert status == 200
    assert json_format.ParseDict(body, pb2.ListModelsResponse()) == both.stub.ListModels(pb2.ListModelsRequest())
    assert {m["architecture"] for m in body["models"]} == {"transformer", "bahdanau"}


def test_gateway_status_table_covers_every_code() -> None:
    assert set(HTTP_STATUS) == set(grpc.StatusCode)
    expected = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "DEADLINE_EXCEEDED": 504,
                "UNAVAILABLE": 503, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "INTERNAL": 500,
                "CANCELLED": 499, "UNIMPLEMENTED": 501}
    assert {code.name: HTTP_STATUS[code] for code in grpc.StatusCode if code.name in expected} == expected
    assert parse_timeout("250m") == pytest.approx(0.25) and parse_timeout("2S") == 2 and parse_timeout("1M") == 60


@pytest.mark.parametrize(("body", "status", "code", "words"), [
    ({"texts": []}, 400, grpc.StatusCode.INVALID_ARGUMENT, "no texts"),
    ({"texts": ["one"], "options": {"beamSize": 99}}, 400, grpc.StatusCode.INVALID_ARGUMENT, "beam_size"),
    ({"texts": ["one"], "model": "nope"}, 404, grpc.StatusCode.NOT_FOUND, "unknown model"),
    ({"texts": ["one"], "model": "tiny-transformer", "modelVersion": "7"}, 404, grpc.StatusCode.NOT_FOUND, "7"),
    ({"textz": ["one"]}, 400, grpc.StatusCode.INVALID_ARGUMENT, "no field named"),
    ('{"texts": ["one"', 400, grpc.StatusCode.INVALID_ARGUMENT, "JSON mapping"),
    ({"texts": "one"}, 400, grpc.StatusCode.INVALID_ARGUMENT, "JSON mapping"),
])
def test_errors_have_the_gateway_status_and_a_status_body(both: ServerHarness, body: Any, status: int,
                                                          code: grpc.StatusCode, words: str) -> None:
    got, headers, payload = call(both, "POST", "/v1/translate", body)
    assert got == status
    assert set(payload) == {"code", "message", "details"} and payload["code"] == code.value[0]
    assert words in payload["message"]
    assert headers["x-request-id"]
    if not isinstance(body, str) and "textz" not in body and body.get("texts") != "one":  # the same error as gRPC
        with pytest.raises(grpc.RpcError) as error:
            both.stub.Translate(json_format.ParseDict(body, pb2.TranslateRequest()), timeout=30)
        assert error.value.code() == code and error.value.details() == payload["message"]


def test_request_id_and_metrics(both: ServerHarness) -> None:
    labels = {"model": "tiny-transformer", "method": "http:Translate", "code": "OK"}
    for model in ("", "tiny-bahdanau"):  # the HTTP series exist at zero from start-up, as the gRPC ones
        assert both.registry.get_sample_value("nmt_requests_total", {**labels, "model": model,
                                                                     "code": "DATA_LOSS"}) == 0.0
    before = both.metric("nmt_requests_total", labels)
    grpc_before = both.metric("grpc_server_handled_total", {"grpc_type": "UNARY", "grpc_service": SERVICE_NAME,
                                                            "grpc_method": "Translate", "grpc_code": "OK"})
    status, headers, _ = call(both, "POST", "/v1/translate", {"texts": ["one"], "model": "tiny-transformer"},
                              headers={"x-request-id": "ui-42"})
    assert status == 200 and headers["x-request-id"] == "ui-42"
    assert both.metric("nmt_requests_total", labels) == before + 1
    assert both.metric("nmt_request_duration_seconds_count", {"model": "tiny-transformer",
                                                              "method": "http:Translate"}) >= 1
    assert both.metric("grpc_server_handled_total", {"grpc_type": "UNARY", "grpc_service": SERVICE_NAME,
                                                     "grpc_method": "Translate", "grpc_code": "OK"}) == grpc_before
    status, _, _ = call(both, "GET", "/v1/models")
    assert both.metric("nmt_requests_total", {"model": "", "method": "http:ListModels", "code": "OK"}) >= 1


def test_page_and_probes(both: ServerHarness) -> None:
    status, headers, page = call(both, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"static/explorer.js" in page and b"<script src=\"http" not in page  # nothing from a CDN
    for asset in ("explorer.js", "explorer.css"):
        assert call(both, "GET", f"/static/{asset}")[0] == 200
    assert call(both, "GET", "/healthz")[:1] == (200,)
    assert call(both, "GET", "/readyz")[2]["status"] == "ready"


def test_cors_absent_unless_configured(both: ServerHarness, repository: Path) -> None:
    origin = {"origin": "http://ui.example"}
    _, headers, _ = call(both, "GET", "/v1/models", headers=origin)
    assert "access-control-allow-origin" not in headers
    preflight = {**origin, "access-control-request-method": "POST"}
    status, headers, _ = call(both, "OPTIONS", "/v1/translate", headers=preflight)
    assert status >= 400 and "access-control-allow-origin" not in headers

    h = ServerHarness(http_config(repository, cors_origins="http://ui.example, https://other.example"),
                      default_loader())
    try:
        status, headers, _ = call(h, "OPTIONS", "/v1/translate",
                                  headers={**origin, "access-control-request-method": "POST",
                                           "access-control-request-headers": "content-type, grpc-timeout"})
        assert status == 204 and headers["access-control-allow-origin"] == "http://ui.example"
        assert "POST" in headers["access-control-allow-methods"]
        assert "grpc-timeout" in headers["access-control-allow-headers"]
        status, headers, _ = call(h, "POST", "/v1/translate", {"texts": ["one"]}, headers=origin)
        assert status == 200 and headers["access-control-allow-origin"] == "http://ui.example"
        assert headers["access-control-expose-headers"] == "x-request-id"
        status, headers, _ = call(h, "POST", "/v1/translate", {"texts": []}, headers=origin)  # errors too
        assert status == 400 and headers["access-control-allow-origin"] == "http://ui.example"
        status, headers, _ = call(h, "GET", "/nope", headers=origin)  # and those aiohttp's router raises
        assert status == 404 and headers["access-control-allow-origin"] == "http://ui.example"
        _, headers, _ = call(h, "GET", "/v1/models", headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in headers
    finally:
        h.close()


def test_deadline_header_queue_full_and_client_disconnect(repository: Path) -> None:
    config = http_config(repository, queue_size=4, max_texts=4)
    h = ServerHarness(config, wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.1)))
    cancelled = {"model": MODEL, "version": "10"}
    try:
        long_text = " ".join(TEXTS)
        status, _, body = call(h, "POST", "/v1/translate", {"texts": [long_text]}, headers={"grpc-timeout": "250m"})
        assert status == 504 and body["code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", cancelled) == 1)  # it left its batch
        assert h.metric("nmt_requests_total", {"model": MODEL, "method": "http:Translate",
                                               "code": "DEADLINE_EXCEEDED"}) == 1
        status, _, body = call(h, "POST", "/v1/translate", {"texts": ["one"]}, headers={"grpc-timeout": "soon"})
        assert status == 400 and "grpc-timeout" in body["message"]

        # the client goes away mid-translation: the call is cancelled and its sentence leaves the batch
        payload = json.dumps({"texts": [long_text]}).encode()
        raw = socket.create_connection(("127.0.0.1", h.server.http_port))
        raw.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_for(lambda: h.scheduler().running)
        raw.close()
        wait_for(lambda: h.metric("nmt_cancelled_sentences_total", cancelled) == 2)
        wait_for(lambda: h.metric("nmt_requests_total", {"model": MODEL, "method": "http:Translate",
                                                         "code": "CANCELLED"}) == 1)
        wait_for(lambda: not h.scheduler().running)

        # a full queue: 429
        first = h.stub.Translate.future(pb2.TranslateRequest(texts=[TEXTS[0]]), timeout=30)
        wait_for(lambda: h.scheduler().running)
        queued = h.stub.Translate.future(pb2.TranslateRequest(texts=TEXTS[:4]), timeout=30)
        wait_for(lambda: h.scheduler().queue_depth == 4)
        status, _, body = call(h, "POST", "/v1/translate", {"texts": [TEXTS[1]]})
        assert status == 429 and body["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "queue full" in body["message"]
        first.result(), queued.result()
    finally:
        h.close()


def test_inference_failure_is_500(repository: Path) -> None:
    h = ServerHarness(http_config(repository), wrapping_loader(lambda e: FailingEngine(e, poll_seconds=0)))
    try:
        status, _, body = call(h, "POST", "/v1/translate", {"texts": ["one two"], "options": {"maxLength": 13}})
        assert status == 500 and body["code"] == grpc.StatusCode.INTERNAL.value[0]
        assert "injected failure" not in body["message"]  # no internals leak
        assert call(h, "POST", "/v1/translate", {"texts": ["one two"]})[0] == 200  # the server carries on
    finally:
        h.close()


def test_readyz_flips_during_drain(repository: Path) -> None:
    h = ServerHarness(http_config(repository), wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.1)))
    try:
        assert call(h, "GET", "/readyz")[0] == 200
        inflight = h.stub.Translate.future(pb2.TranslateRequest(texts=[" ".join(TEXTS)]), timeout=30)
        wait_for(lambda: h.scheduler().running)
        done = h.start_shutdown(grace=20)
        wait_for(lambda: h.server.servicer.draining)
        status, _, body = call(h, "GET", "/readyz")
        assert status == 503 and body["reason"] == "draining"
        assert call(h, "GET", "/healthz")[0] == 200  # alive: it is finishing its work
        status, _, body = call(h, "POST", "/v1/translate", {"texts": ["one"]})
        assert status == 503 and body["code"] == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "shutting down" in body["message"]
        assert inflight.result(timeout=30).translations  # the in-flight call finished
        done.result(timeout=30)
        with pytest.raises(OSError):  # the HTTP port is closed with the server
            call(h, "GET", "/healthz", timeout=2)
    finally:
        h.close()


def test_http_listen_empty_disables_it(repository: Path) -> None:
    h = ServerHarness(http_config(repository, http_listen=""), default_loader())
    try:
        assert h.server.http is None and h.server.http_port is None
    finally:
        h.close()


def test_bearer_tokens_over_http(tiny_models: dict[str, Path], tiny_repository: Path, tmp_path: Path) -> None:
    admin, partner = "0c8f5b1e2d7a4c9b8e6f3a2d1c0b9a87", "Zx9-partner_token.v2"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{admin}\n{partner} tiny-transformer\n")
    h = ServerHarness(http_config(tiny_repository, auth_tokens_file=str(tokens)), default_loader())
    try:
        status, _, body = call(h, "POST", "/v1/translate", {"texts": ["one"]})
        assert status == 401 and body["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        bearer = {"authorization": f"Bearer {partner}"}
        status, _, body = call(h, "POST", "/v1/translate", {"texts": ["one"], "model": "tiny-bahdanau"}, bearer)
        assert status == 403 and body["code"] == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert call(h, "POST", "/v1/translate", {"texts": ["one"], "model": "tiny-transformer"}, bearer)[0] == 200
        status, _, body = call(h, "GET", "/v1/models", headers=bearer)
        assert status == 200 and {m["name"] for m in body["models"]} == {"tiny-transformer"}
        body = call(h, "GET", "/v1/models", headers={"authorization": f"Bearer {admin}"})[2]
        assert {m["name"] for m in body["models"]} == {"tiny-transformer", "tiny-bahdanau"}
        assert call(h, "GET", "/readyz")[0] == 200  # probes stay open
    finally:
        h.close()


@pytest.fixture
def logs() -> Iterator[list[tuple[str, str]]]:
    """(logger, line) of every record of the project's loggers and of aiohttp's, each formatted as ``nmt serve``
    writes the project's (:class:`JsonFormatter`); aiohttp's own records would reach stderr unformatted."""
    lines: list[tuple[str, str]] = []
    formatter = JsonFormatter()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((record.name, formatter.format(record)))

    # aiohttp's records from WARNING up: those Python writes to stderr as they are when nothing handles them
    handlers = {logging.getLogger("nmt"): Collect(), logging.getLogger("aiohttp"): Collect(logging.WARNING)}
    project, level = logging.getLogger("nmt"), logging.getLogger("nmt").level
    project.setLevel(logging.INFO)
    for logger, handler in handlers.items():
        logger.addHandler(handler)
    yield lines
    for logger, handler in handlers.items():
        logger.removeHandler(handler)
    project.setLevel(level)


def request_lines(logs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The "request" log lines; every project line is one line of JSON and aiohttp logged nothing."""
    assert [line for name, line in logs if not name.startswith("nmt")] == []
    assert all("\n" not in line for _, line in logs)
    return [entry for entry in (json.loads(line) for _, line in logs) if entry["message"] == "request"]


@pytest.mark.parametrize(("verb", "path", "body", "status", "code", "label"), [
    ("GET", "/nope", None, 404, grpc.StatusCode.NOT_FOUND, "http:unknown"),
    ("GET", "/static/nope.js", None, 404, grpc.StatusCode.NOT_FOUND, "http:unknown"),
    ("GET", "/v1/translate", None, 405, grpc.StatusCode.UNIMPLEMENTED, "http:unknown"),
    ("POST", "/healthz", "{}", 405, grpc.StatusCode.UNIMPLEMENTED, "http:unknown"),
    ("POST", "/v1/translate", " " * (9 << 20), 400, grpc.StatusCode.INVALID_ARGUMENT, "http:Translate"),
], ids=["unknown-path", "missing-file", "wrong-verb", "wrong-verb-probe", "body-over-the-limit"])
def test_errors_aiohttp_raises_are_status_json_counted_and_logged(
        both: ServerHarness, logs: list[tuple[str, str]], verb: str, path: str, body: str | None, status: int,
        code: grpc.StatusCode, label: str) -> None:
    labels = {"model": "", "method": label, "code": code.name}
    before = both.registry.get_sample_value("nmt_requests_total", labels)
    assert before is not None  # the series exists from start-up
    got, headers, payload = call(both, verb, path, body, headers={"x-request-id": "bad-1"})
    assert got == status and headers["content-type"].startswith("application/json")
    assert set(payload) == {"code", "message", "details"} and payload["code"] == code.value[0]
    assert headers["x-request-id"] == "bad-1"
    if status == 405:
        assert path in payload["message"] and headers["allow"]
    assert both.metric("nmt_requests_total", labels) == before + 1
    [line] = request_lines(logs)
    assert (line["method"], line["model"], line["code"], line["request_id"]) == (label, "", code.name, "bad-1")
    assert line["error"] == payload["message"]


def raw_request(h: ServerHarness, data: bytes) -> tuple[int, dict[str, str], Any]:
    """Send ``data`` as it is; the answer (the server closes the connection after it)."""
    with socket.create_connection(("127.0.0.1", h.server.http_port), timeout=30) as raw:
        raw.sendall(data)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (field.partition(":") for field in fields)}
    return int(status_line.split()[1]), headers, json.loads(body)


@pytest.mark.parametrize(("data", "words"), [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-request-id: " + b"x" * 20_000 + b"\r\n\r\n",
     "over the limit of 8190 bytes"),
    (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(64) + b"\r\n\r\n", "HTTPS"),  # a TLS client hello
], ids=["header-over-the-limit", "tls"])
def test_requests_that_are_not_http_are_status_json_counted_and_logged(
        both: ServerHarness, logs: list[tuple[str, str]], data: bytes, words: str) -> None:
    """They fail in aiohttp's parser, before any handler or middleware."""
    labels = {"model": "", "method": "http:unknown", "code": "INVALID_ARGUMENT"}
    before = both.metric("nmt_requests_total", labels)
    status, headers, payload = raw_request(both, data)
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert payload["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and words in payload["message"]
    assert "xxxx" not in payload["message"]  # the header is not repeated (it may be a token)
    assert both.metric("nmt_requests_total", labels) == before + 1
    [line] = request_lines(logs)
    assert (line["method"], line["code"], line["error"]) == ("http:unknown", "INVALID_ARGUMENT", payload["message"])
    assert line["request_id"] == headers["x-request-id"]


@pytest.mark.parametrize(("error", "status", "code"), [
    (RuntimeError("probe bug"), 500, grpc.StatusCode.INTERNAL),
    (TimeoutError(), 504, grpc.StatusCode.DEADLINE_EXCEEDED),
], ids=["bug", "timeout"])
def test_a_handler_that_raises_answers_a_status(both: ServerHarness, logs: list[tuple[str, str]],
                                                 error: Exception, status: int, code: grpc.StatusCode) -> None:
    face = both.server.http

    def broken() -> tuple[bool, str]:
        raise error

    ready, face.ready = face.ready, broken
    try:
        got, headers, payload = call(both, "GET", "/readyz", headers={"x-request-id": "probe-1"})
    finally:
        face.ready = ready
    assert got == status and headers["content-type"].startswith("application/json")
    assert payload["code"] == code.value[0] and "probe bug" not in payload["message"]
    [line] = request_lines(logs)
    assert (line["code"], line["request_id"]) == (code.name, "probe-1")
    failures = [json.loads(text) for _, text in logs if json.loads(text)["level"] == "error"]
    if isinstance(error, RuntimeError):  # a bug: its traceback, inside one JSON line
        assert len(failures) == 1 and "probe bug" in failures[0]["exception"]
    else:
        assert failures == []


def test_query_parameters_that_are_no_fields_are_ignored_on_get(both: ServerHarness) -> None:
    status, _, body = call(both, "GET", "/v1/models?_=123&utm_source=mail")
    assert status == 200 and body == call(both, "GET", "/v1/models")[2]
    status, _, body = call(both, "POST", "/v1/translate", {"texts": ["one"], "_": 123})  # a body: still refused
    assert status == 400 and "no field named" in body["message"]
