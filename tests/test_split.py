"""``nmt serve --frontends 2``: an engine-core process and two front-ends, as real processes on loopback.

What the split must keep: the same answers as one process, one exact ``/metrics`` (read by a real
Prometheus), a killed front-end replaced while the other serves, a killed core answered with UNAVAILABLE
at once and restarted, cancellation reaching the core's running decode, a drain under load that loses
nothing, and front-ends that never import ONNX Runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import msgspec
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from server.completion import Completion
from server.config import ServerConfig
from server.controls import Controls
from server.errors import ResourceExhausted
from server.frontend.app import server_options
from server.ipc import Cancel, Channel, Done, Failed, Submit, WireSentence, decode, encode
from server.protos import SERVICE_NAME, pb2, pb2_grpc
from server.supervisor import announce_ready
from server.types import DecodingOptions, ScoredSequence, SearchResult, TargetPrefix
from tests.conftest import SERVED_MODEL
from tests.harness import ServerHarness
from tests.test_prometheus import PROMETHEUS, Prometheus, values
from tests.test_server import TEXTS, default_loader, test_config

ROOT = Path(__file__).resolve().parent.parent
# a long decode: EOS is not allowed before max_length, 8 beams, many texts (seconds on the tiny model)
LONG = pb2.TranslateRequest(texts=[" ".join(["one two three four five"] * 20)] * 32, options=pb2.DecodingOptions(
    beam_size=8, max_length=200, min_length=190))


class SplitServer:
    """``nmt serve --frontends N`` as a subprocess; its logs (JSON lines) collected in a file."""

    def __init__(self, repository: Path, workdir: Path, frontends: int = 2, *extra: str) -> None:
        self.log_path = workdir / "serve.log"
        self.log = self.log_path.open("w")
        command = [sys.executable, "-m", "nmt", "serve", "--model-repository", str(repository),
                   "--frontends", str(frontends), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
                   "--metrics-listen", "127.0.0.1:0", "--provider", "cpu", "--intra-op-threads", "1",
                   "--reload-interval", "0", "--grace-seconds", "20", "--cache-mb", "0", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)
        serving = self.wait_log(lambda e: e["message"] == "serving" and "frontends" in e, 240)
        self.port, self.http_port, self.metrics_port = serving["port"], serving["http_port"], serving["metrics_port"]
        self.pids = serving["pids"]
        self.address = f"127.0.0.1:{self.port}"

    def logs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def wait_log(self, match: Any, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            found = [entry for entry in self.logs() if match(entry)]
            if found:
                return found[-1]
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log_path.read_text()[-3000:]
            time.sleep(0.1)

    def stub(self) -> Any:
        """A stub on a channel of its own (a new connection: the kernel picks a front-end for it)."""
        return pb2_grpc.TranslatorStub(grpc.insecure_channel(self.address))

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=5):
                return True
        except urllib.error.HTTPError:
            return False

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


def requests_ok(metrics: dict[tuple[str, tuple], float], method: str = "Translate") -> float:
    return metrics.get(("nmt_requests_total", (("code", "OK"), ("method", method), ("model", SERVED_MODEL))), 0.0)


def own_channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own: gRPC's channels share one connection per target by default."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def split(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SplitServer]:
    # connections age out after a second (the default is 60 s): a restarted front-end gets its share quickly
    server = SplitServer(repository, tmp_path_factory.mktemp("split"), 2, "--max-connection-age", "1")
    try:
        yield server
    finally:
        server.stop()


def test_messages_cross_as_typed_msgpack_and_nothing_else_decodes() -> None:
    """A request's options, controls and partial-word completion, and a result's attention array, arrive as
    they were sent; a message of an unknown kind, or a body that is not its kind's, is refused."""
    completion = Completion("▁Apr", 2, [{7: 2}, {8: 4}])
    options = DecodingOptions(beam_size=4, num_hypotheses=2, return_attention=True,
                              controls=Controls(suppress=((3, 4),), repetition_penalty=1.5))
    sentence = WireSentence([5, 6, 7], options, TargetPrefix((9, 10), completion, spaced=True))
    submit = Submit(3, "tiny", "2", "req-1", 1234.5, [sentence], [80])
    got = decode(encode(submit))
    assert (got.call, got.name, got.version, got.request_id, got.deadline, got.work) == (3, "tiny", "2", "req-1",
                                                                                          1234.5, [80])
    [wire] = got.sentences
    assert (wire.source_ids, wire.options, wire.target_prefix.ids, wire.target_prefix.spaced) == (
        [5, 6, 7], options, (9, 10), True)
    arrived = wire.target_prefix.completion  # compared by identity: field by field
    assert (arrived.text, arrived.start, arrived.states) == (completion.text, completion.start, completion.states)
    attention = np.arange(6, dtype=np.float32).reshape(2, 3)
    done = decode(encode(Done(3, [SearchResult([ScoredSequence([1, 2], -0.5, [-0.2, -0.3], attention)])])))
    np.testing.assert_array_equal(done.results[0].hypotheses[0].attention, attention)
    assert done.results[0].hypotheses[0].tokens == [1, 2]
    assert isinstance(decode(encode(Failed(3, "ResourceExhausted", "queue full"))).error(), ResourceExhausted)
    with pytest.raises(msgspec.DecodeError):
        decode(b"\x80\x05")  # a pickle's first bytes: no such kind
    with pytest.raises(msgspec.ValidationError):
        decode(encode(Submit(3, "tiny", "2", "", None, [], []))[:1] + encode(Done(3, []))[1:])  # a Done as Submit


def test_the_messages_of_one_turn_leave_in_one_write_and_arrive_in_order() -> None:
    """A channel queues what one turn of the event loop sends and writes it at the start of the next turn, in
    one write; the other end parses every frame of it, in order. Closing writes what is still queued."""

    async def scenario() -> tuple[list[int], int]:
        left, right = socket.socketpair()
        loop = asyncio.get_running_loop()
        arrived: list[int] = []
        _, sender = await loop.create_unix_connection(lambda: Channel(lambda c, m: None, lambda c: None), sock=left)
        await loop.create_unix_connection(lambda: Channel(lambda c, m: arrived.append(m.call), lambda c: None),
                                          sock=right)
        writes = []
        write = sender.transport.write
        sender.transport.write = lambda data: writes.append(len(data)) or write(data)
        for call in range(100):
            sender.send(Cancel(call))
        assert writes == [], "nothing written within the turn that sent"
        while len(arrived) < 100:
            await asyncio.sleep(0.01)
        sender.send(Cancel(100))
        sender.close()  # before the next turn: what is queued leaves first
        while len(arrived) < 101:
            await asyncio.sleep(0.01)
        return arrived, len(writes)

    arrived, count = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert arrived == list(range(101)) and count == 2


def test_the_supervisor_never_reads_a_ready_file_half_written(tmp_path: Path) -> None:
    """A worker announces itself while the supervisor polls for the file: the poll must see all of it or none.

    A plain ``write_text`` creates the file empty before it writes (a CI run failed on that empty read);
    in this loop it was read half written in most of the rounds."""
    rounds, fields = 300, {"models": ["demo"] * 50, "default_model": "demo"}
    unreadable: list[int] = []

    def poll() -> None:
        for i in range(rounds):
            ready = tmp_path / f"core.{i}.ready"
            while not ready.exists():
                time.sleep(0)
            try:
                assert json.loads(ready.read_text()) == fields
            except ValueError:
                unreadable.append(i)

    poller = threading.Thread(target=poll)
    poller.start()
    for i in range(rounds):
        announce_ready(tmp_path / f"core.{i}.ready", fields)
    poller.join(30)
    assert not poller.is_alive() and unreadable == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"core.{i}.ready" for i in range(rounds))


def test_frontends_never_import_onnxruntime() -> None:
    code = "import sys, server.frontend.process; print(sorted(m for m in sys.modules if m.startswith('onnxruntime')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_answers_equal_the_one_process_server(split: SplitServer, repository: Path) -> None:
    """Translate (greedy, beam 4 with attention and n-best, a target prefix), Score, the stream, the streamed
    translation and the model list answer as the one-process server does."""
    requests = [
        pb2.TranslateRequest(texts=TEXTS[:3]),
        pb2.TranslateRequest(texts=TEXTS[:2], options=pb2.DecodingOptions(
            beam_size=4, num_hypotheses=2, return_attention=True, return_scores=True)),
        pb2.TranslateRequest(texts=TEXTS[:1], target_prefixes=["drei"]),
    ]
    score = pb2.ScoreRequest(texts=TEXTS[:2], targets=["drei eins", "zwei"], return_attention=True)
    one = ServerHarness(test_config(repository, http_listen=""), default_loader())
    try:
        split_stub = split.stub()
        for request in requests:
            assert split_stub.Translate(request, timeout=30) == one.stub.Translate(request, timeout=30)
        assert split_stub.Score(score, timeout=30) == one.stub.Score(score, timeout=30)
        streamed = list(split_stub.TranslateStream(iter(requests), timeout=30))
        assert streamed == [one.stub.Translate(r, timeout=30) for r in requests]
        for request in (pb2.TranslateRequest(texts=LONG.texts[:1], options=pb2.DecodingOptions(  # long enough to
                beam_size=1, min_length=60, max_length=64, return_attention=True)),  # stream words before the end
                        pb2.TranslateRequest(
                texts=TEXTS[3:4], target_prefixes=["drei"], options=pb2.DecodingOptions(beam_size=4))):
            deltas = list(split_stub.TranslateStreaming(request, timeout=30))  # the core's Progress messages
            best = deltas[-1].final.translations[0].hypotheses[0]
            assert "".join(d.text for d in deltas) == best.text  # (message boundaries depend on timing)
            assert [p for d in deltas for p in d.subword_tokens] == list(best.subword_tokens)
            rows = [w for d in deltas for w in d.attention.weights]  # attention rows crossed in Progress messages
            assert rows == pytest.approx(list(best.attention.weights[: len(rows)]), abs=1e-5)
            assert len(rows) > 0 or request.options.beam_size == 4
            assert deltas[-1].final == one.stub.Translate(request, timeout=30)
            assert len(deltas) > 1 or request.options.beam_size == 4  # greedy: words before the end
        models = split_stub.ListModels(pb2.ListModelsRequest(), timeout=10)
        assert [(m.name, m.version) for m in models.models] == [
            (m.name, m.version) for m in one.stub.ListModels(pb2.ListModelsRequest(), timeout=10).models]
        body = json.dumps({"texts": TEXTS[:2]}).encode()
        answer = json.load(urllib.request.urlopen(f"http://127.0.0.1:{split.http_port}/v1/translate", body, 30))
        assert [t["hypotheses"][0]["text"] for t in answer["translations"]] == [
            t.hypotheses[0].text for t in one.stub.Translate(pb2.TranslateRequest(texts=TEXTS[:2])).translations]
        with pytest.raises(grpc.RpcError) as error:  # errors keep their status across the split
            split_stub.Translate(pb2.TranslateRequest(texts=["one"], model="nope"), timeout=10)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        one.close()


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not on PATH (apt-get install -y prometheus)")
def test_one_metrics_endpoint_counts_every_request_exactly(split: SplitServer, tmp_path: Path) -> None:
    """Requests over many connections (both front-ends) are counted once each in the one /metrics, which a
    real Prometheus scrapes; the core's counters (tokens) are there too."""
    prometheus = Prometheus(f"127.0.0.1:{split.metrics_port}", tmp_path)
    try:
        prometheus.wait_for(lambda: values(prometheus.query('up{job="translator"}')) == [1.0], 30, "a scrape")
        before = split.metrics()
        sent = 24
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: split.stub().Translate(pb2.TranslateRequest(texts=[TEXTS[i % 3]]), timeout=30),
                          range(sent)))
        after = split.metrics()
        assert requests_ok(after) - requests_ok(before) == sent
        handled = ("grpc_server_handled_total", (("grpc_code", "OK"), ("grpc_method", "Translate"),
                                                 ("grpc_service", SERVICE_NAME), ("grpc_type", "UNARY")))
        assert after[handled] - before.get(handled, 0) == sent
        assert after[("nmt_inflight_requests", ())] == 0
        generated = sum(v for (name, _), v in after.items() if name == "nmt_generated_tokens_total")
        assert generated > sum(v for (name, _), v in before.items() if name == "nmt_generated_tokens_total")
        total = f'sum(nmt_requests_total{{job="translator", code="OK", method="Translate", model="{SERVED_MODEL}"}})'
        prometheus.wait_for(lambda: values(prometheus.query(total)) == [requests_ok(after)], 20, "the counts scraped")
    finally:
        prometheus.stop()


def test_every_process_freezes_start_ups_objects_and_reports_its_collections(split: SplitServer) -> None:
    """The core and each front-end move start-up's objects out of the garbage collector's reach (a log line
    each), and the one /metrics sums every process's collections."""
    frozen = [e for e in split.logs() if e["message"].startswith("start-up's objects frozen")]
    assert len({e["pid"] for e in frozen}) >= 3 and all(e["objects"] > 10_000 for e in frozen), frozen

    def collections() -> float:
        return sum(v for (name, _), v in split.metrics().items() if name == "nmt_gc_pause_seconds_count")

    before = collections()
    for i in range(20):
        split.stub().Translate(pb2.TranslateRequest(texts=[TEXTS[i % 3]]), timeout=30)
    until(lambda: collections() > before, 10, "the processes' collections measured")


def test_cancelling_a_call_frees_its_rows_in_the_core(split: SplitServer) -> None:
    before = split.metrics()

    def started(metrics: dict) -> float:  # sentences whose batch started (their queue time observed)
        return sum(v for (name, _), v in metrics.items() if name == "nmt_queue_duration_seconds_count")

    future = split.stub().Translate.future(LONG, timeout=60)
    until(lambda: started(split.metrics()) > started(before), 10, "the long call's first batch decoding in the core")
    time.sleep(0.2)
    future.cancel()

    def total(metrics: dict) -> float:  # every series, also those the cancellation adds after this line
        return sum(v for (name, _), v in metrics.items() if name == "nmt_cancelled_sentences_total")

    # the running batch's sentences leave the decode (counted), the queued ones the queue (batch_work splits
    # the request into several batches)
    until(lambda: total(split.metrics()) > total(before), 10, "the running sentences left the decode")
    depth = [k for k in split.metrics() if k[0] == "nmt_queue_depth"]
    until(lambda: sum(split.metrics()[k] for k in depth) == 0, 10, "the queued sentences withdrawn")
    start = time.monotonic()  # the core is free again at once
    split.stub().Translate(pb2.TranslateRequest(texts=TEXTS[:1]), timeout=30)
    assert time.monotonic() - start < 2


def test_connections_age_out_by_default() -> None:
    """Without an age, a long-lived client never leaves the front-end (or replica) it first reached."""
    assert ("grpc.max_connection_age_ms", 60_000) in server_options(ServerConfig())


def connections(pid: int, port: int) -> int:
    """The established client connections of process ``pid`` on ``port``."""
    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)


def test_a_killed_frontend_loses_only_its_calls_and_is_replaced(split: SplitServer) -> None:
    victim = split.pids["frontend-0"]
    long_lived = [pb2_grpc.TranslatorStub(own_channel(split.address)) for _ in range(9)]  # clients that keep their
    # channel (a connection each), opened before the kill
    for stub in long_lived:
        stub.Translate(pb2.TranslateRequest(texts=TEXTS[:1]), timeout=30)
    outcomes: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                with grpc.insecure_channel(split.address) as channel:
                    pb2_grpc.TranslatorStub(channel).Translate(pb2.TranslateRequest(texts=TEXTS[:2]), timeout=30)
                outcomes.append("OK")
            except grpc.RpcError as error:
                outcomes.append(error.code().name)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    restarted = split.wait_log(lambda e: e["message"] == "worker process restarted" and e["worker"] == "frontend-0")
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert restarted["pid"] != victim
    split.pids["frontend-0"] = restarted["pid"]
    assert set(outcomes) <= {"OK", "UNAVAILABLE"} and outcomes.count("OK") > len(outcomes) // 2
    for _ in range(8):  # every connection is served again
        with grpc.insecure_channel(split.address) as channel:
            assert pb2_grpc.TranslatorStub(channel).Translate(pb2.TranslateRequest(texts=TEXTS[:1]),
                                                              timeout=30).translations
    # the long-lived clients' connections age out and spread again: the new front-end gets some of them
    deadline = time.monotonic() + 20
    while connections(restarted["pid"], split.port) == 0:
        assert time.monotonic() < deadline, "no long-lived client reached the restarted front-end"
        for stub in long_lived:
            stub.Translate(pb2.TranslateRequest(texts=TEXTS[:1]), timeout=30)
        time.sleep(0.3)


def test_a_killed_core_answers_unavailable_at_once_and_recovers(split: SplitServer) -> None:
    stub = split.stub()
    stub.Translate(pb2.TranslateRequest(texts=TEXTS[:1]), timeout=30)
    in_flight = stub.Translate.future(LONG, timeout=60)
    until(lambda: split.metrics()[("nmt_inflight_requests", ())] >= 1, 10, "the long call in flight")
    os.kill(split.pids["core"], signal.SIGKILL)
    start = time.monotonic()
    assert in_flight.exception(timeout=5).code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 1.0
    with pytest.raises(grpc.RpcError) as error:
        stub.Translate(pb2.TranslateRequest(texts=TEXTS[:1]), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 1.0
    assert not split.ready()
    # the services a readiness probe and the client's health-checked balancing read ("" and the Translator),
    # and the model's, on every front-end (each channel is a connection of its own: the kernel spreads them)
    healths = [health_pb2_grpc.HealthStub(own_channel(split.address)) for _ in range(6)]
    services = ("", SERVICE_NAME, SERVED_MODEL)

    def statuses() -> set[int]:
        return {h.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status for h in healths for s in services}

    until(lambda: statuses() == {health_pb2.HealthCheckResponse.NOT_SERVING}, 1, "NOT_SERVING on the core's death")
    restarted = split.wait_log(lambda e: e["message"] == "worker process restarted" and e["worker"] == "core", 120)
    split.pids["core"] = restarted["pid"]
    until(split.ready, 30, "ready again")
    until(lambda: statuses() == {health_pb2.HealthCheckResponse.SERVING}, 10, "health SERVING again")
    assert stub.Translate(pb2.TranslateRequest(texts=TEXTS[:1]), timeout=30).translations


def channels_by_frontend(server: SplitServer, count: int) -> dict[int, list[grpc.Channel]]:
    """``count`` connected channels, by the pid of the front-end that holds each (read from both ends' sockets)."""
    ours = psutil.Process()
    frontends = [pid for role, pid in server.pids.items() if role.startswith("frontend")]
    by_pid: dict[int, list[grpc.Channel]] = {pid: [] for pid in frontends}
    for _ in range(count):
        before = {c.laddr.port for c in ours.net_connections("tcp") if c.raddr and c.raddr.port == server.port}
        channel = own_channel(server.address)
        pb2_grpc.TranslatorStub(channel).ListModels(pb2.ListModelsRequest(), timeout=10)
        [port] = {c.laddr.port for c in ours.net_connections("tcp")
                  if c.raddr and c.raddr.port == server.port} - before
        holder = next(pid for pid in frontends if any(c.raddr and c.raddr.port == port
                                                      for c in psutil.Process(pid).net_connections("tcp")))
        by_pid[holder].append(channel)
    return by_pid


def test_sigterm_drains_under_load_and_loses_nothing(repository: Path, tmp_path: Path) -> None:
    server = SplitServer(repository, tmp_path, 2)
    try:
        by_pid = channels_by_frontend(server, 16)
        (_, calling), (_, watching) = sorted(by_pid.items(), key=lambda item: -len(item[1]))[:2]
        assert calling and watching, by_pid  # 16 connections over 2 front-ends: both hold some
        # every call on one front-end, long enough (190 steps, beam 4) to run on for seconds after the signal
        calls = [pb2_grpc.TranslatorStub(calling[i % len(calling)]).Translate.future(pb2.TranslateRequest(
            texts=[LONG.texts[0]] * 8, options=pb2.DecodingOptions(beam_size=4, max_length=200, min_length=190)),
            timeout=60) for i in range(24)]
        until(lambda: server.metrics()[("nmt_inflight_requests", ())] >= 6, 10, "calls in flight")
        # health watches on the other front-end, which has no call: none may end while the server still answers
        # calls, as in one process, whose watches stay open until its last call has ended
        watch_ends: list[float] = []

        def watch(channel: grpc.Channel) -> None:
            stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            with contextlib.suppress(grpc.RpcError):
                for _ in stream:
                    pass
            watch_ends.append(time.monotonic())

        watchers = [threading.Thread(target=watch, args=(channel,)) for channel in watching]
        for thread in watchers:
            thread.start()
        time.sleep(0.3)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert all(len(call.result(timeout=60).translations) == 8 for call in calls)
        last_call = time.monotonic()
        assert last_call - signalled > 2  # the calls outlast a front-end's own drain (0.5 s quiet) and stop (1 s)
        assert server.process.wait(60) == 0
        for thread in watchers:
            thread.join(10)
        assert len(watch_ends) == len(watching) and min(watch_ends) >= last_call - 0.05, (
            min(watch_ends) - signalled, last_call - signalled)
        messages = [(e["message"], e.get("worker", "")) for e in server.logs()]
        assert messages[-1] == ("stopped", "")
        order = [m for m, _ in messages]
        stops = [i for i, m in enumerate(order) if m == "stopped"]  # each front-end's, then the supervisor's
        assert len(stops) == 3 and stops[1] < order.index("engine core stopping") < stops[2]
        assert not [e for e in server.logs() if e["level"] == "error"]  # a front-end closing its own connection
        # to the core is not the core going away
    finally:
        server.stop()


def test_hot_reload_reaches_the_frontends(repository: Path, tmp_path: Path) -> None:
    """SIGHUP to nmt serve makes the core scan; the front-ends take the new catalog (and the new version's
    tokenizer) and route to the new version; a removed version leaves the catalog and /metrics (whose
    process_* metrics cover every process of the service)."""
    repo = tmp_path / "repo"
    shutil.copytree(repository / SERVED_MODEL / "1", repo / SERVED_MODEL / "1")
    server = SplitServer(repo, tmp_path, 1)
    try:
        stub = server.stub()
        assert [m.version for m in stub.ListModels(pb2.ListModelsRequest(), timeout=10).models] == ["1"]
        shutil.copytree(repository / SERVED_MODEL / "1", repo / SERVED_MODEL / "7")
        server.process.send_signal(signal.SIGHUP)
        until(lambda: [m.version for m in stub.ListModels(pb2.ListModelsRequest(), timeout=10).models] == ["1", "7"],
              60, "the new version listed by the front-end")
        response = stub.Translate(pb2.TranslateRequest(texts=TEXTS[:1]), timeout=30)
        assert response.model_version == "7" and response.translations[0].hypotheses

        def versions_in_metrics() -> set[str]:
            return {dict(labels)["version"] for _, labels in server.metrics() if "version" in dict(labels)}

        assert versions_in_metrics() == {"1", "7"}
        shutil.rmtree(repo / SERVED_MODEL / "1")
        server.process.send_signal(signal.SIGHUP)
        until(lambda: [m.version for m in stub.ListModels(pb2.ListModelsRequest(), timeout=10).models] == ["7"],
              60, "the removed version gone from the front-end")
        until(lambda: versions_in_metrics() == {"7"}, 60, "the removed version's series gone from /metrics")
        # process_* of the whole service: more than the supervisor alone holds (the core has the engine)
        core_rss = int(Path(f"/proc/{server.pids['core']}/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
        assert server.metrics()[("process_resident_memory_bytes", ())] > core_rss
    finally:
        server.stop()


def test_a_taken_port_fails_the_start_with_a_clear_error(repository: Path) -> None:
    """The supervisor reserves the ports before any worker starts: a port another program holds is named."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "nmt", "serve", "--frontends", "1", "--model-repository",
                                 str(repository), "--listen", f"127.0.0.1:{port}", "--http-listen", "",
                                 "--metrics-listen", ""], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Address already in use" in result.stderr
