"""Model hot reload: new, broken, changed and removed versions on a live server on loopback.

Each test copies the session's tiny Transformer (tests/conftest.py) into its own temporary repository
and changes that directory while a :class:`ServerHarness` serves it. Scans are triggered directly
(``server.reload()``, what SIGHUP and the poller call) except where the poller or the signal itself is
the subject. Versions appear atomically, as ``nmt export`` makes them: copied under a hidden name, then
renamed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from server.config import ServerConfig
from server.core.repository import LoadSettings, ModelRepository, VersionRefused
from server.logs import JsonFormatter
from server.protos import pb2, pb2_grpc
from tests.harness import ServerHarness
from tests.test_server import TEXTS, SlowEngine, test_config, wrapping_loader

MODEL = "tiny"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def version_dir(tiny_models: dict[str, Path]) -> Path:
    return Path(tiny_models["transformer"])


def add_version(repo: Path, version: str, source: Path, name: str = MODEL) -> Path:
    """Copy ``source`` to ``repo/name/version`` atomically (hidden copy, then rename)."""
    (repo / name).mkdir(parents=True, exist_ok=True)
    scratch = repo / name / f".incoming-{version}"
    shutil.copytree(source, scratch)
    target = repo / name / version
    os.rename(scratch, target)
    return target


@pytest.fixture
def repo(tmp_path: Path, version_dir: Path) -> Path:
    """A repository holding ``tiny/1``."""
    root = tmp_path / "repo"
    add_version(root, "1", version_dir)
    return root


@pytest.fixture
def logs() -> Iterator[list[dict[str, Any]]]:
    """The server's log lines, as the JSON objects ``nmt serve`` writes."""
    lines: list[dict[str, Any]] = []
    formatter = JsonFormatter()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(formatter.format(record)))

    logger = logging.getLogger("nmt.server")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def serve(repo: Path, loader: Callable[..., Any] | None = None, **changes: Any) -> ServerHarness:
    changes.setdefault("reload_interval", 0)  # scans are triggered by the test unless it says otherwise
    return ServerHarness(test_config(repo, **changes), loader or wrapping_loader(lambda e: e))


def scan(h: ServerHarness) -> Any:
    return h.run(h.server.reload())


def listed(h: ServerHarness) -> list[tuple[str, str, bool]]:
    return [(m.name, m.version, m.is_latest) for m in h.stub.ListModels(pb2.ListModelsRequest(), timeout=10).models]


def health(h: ServerHarness, service: str) -> int:
    return h.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def translate(h: ServerHarness, text: str = TEXTS[0], **fields: Any) -> Any:
    return h.stub.Translate(pb2.TranslateRequest(texts=[text], **fields), timeout=30)


def info_series(h: ServerHarness, name: str, version: str) -> float | None:
    mv_labels = {"model": name, "version": version, "architecture": "transformer", "provider": "CPUExecutionProvider"}
    return h.registry.get_sample_value("nmt_model_info", mv_labels)


def wait_for(condition: Callable[[], Any], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class Traffic:
    """Client threads translating one text at a time, back to back, recording every outcome."""

    def __init__(self, h: ServerHarness, clients: int = 4) -> None:
        self.h, self.stop = h, threading.Event()
        self.served: list[tuple[float, str]] = []  # (time the response came, version that served it)
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        i = index
        while not self.stop.is_set():
            try:
                response = translate(self.h, TEXTS[i % len(TEXTS)])
                self.served.append((time.monotonic(), response.model_version))
            except grpc.RpcError as error:
                self.failures.append(f"{error.code().name}: {error.details()}")
            i += 1

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


# ---- new versions --------------------------------------------------------------------------------------


def test_new_version_and_new_model_are_served_after_a_scan(repo: Path, version_dir: Path, logs: list) -> None:
    h = serve(repo)
    try:
        assert translate(h).model_version == "1"
        assert scan(h).changed is False  # nothing new: nothing happens
        add_version(repo, "2", version_dir)
        add_version(repo, "1", version_dir, name="other")
        shutil.copytree(version_dir, repo / MODEL / ".copying")  # hidden: work in progress, ignored
        result = scan(h)
        assert result.loaded == [("other", "1"), (MODEL, "2")] and not result.refused
        assert listed(h) == [("other", "1", True), (MODEL, "1", False), (MODEL, "2", True)]
        zero = h.registry.get_sample_value("nmt_generated_tokens_total", {"model": "other", "version": "1"})
        assert zero == 0  # exported from its load on
        response = translate(h)
        assert (response.model, response.model_version) == (MODEL, "2")  # the newest is the latest; a model
        # that sorts first ("other") does not take over the default: that was decided at start-up
        assert translate(h, model_version="1").model_version == "1"  # the old one still serves
        assert translate(h, model="other").model == "other"
        assert health(h, "other") == SERVING and health(h, MODEL) == SERVING
        assert info_series(h, "other", "1") == 1 and info_series(h, MODEL, "2") == 1
        assert h.metric("nmt_model_loads_total", {"model": MODEL, "result": "loaded"}) == 2
        assert h.metric("nmt_model_loads_total", {"model": "other", "result": "loaded"}) == 1
        assert h.registry.get_sample_value("nmt_model_loads_total", {"model": "other", "result": "refused"}) == 0
        loaded = [line for line in logs if line["message"] == "model loaded"]
        assert {(line["model"], line["version"]) for line in loaded} >= {(MODEL, "2"), ("other", "1")}
    finally:
        h.close()


def test_poller_finds_versions_and_reload_interval_is_configurable(repo: Path, version_dir: Path) -> None:
    assert ServerConfig.from_env({"NMT_RELOAD_INTERVAL": "2.5"}).reload_interval == 2.5
    assert ServerConfig().reload_interval == 10.0
    from nmt.cli import build_parser

    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--reload-interval" in help_text and "NMT_RELOAD_INTERVAL" in help_text and "SIGHUP" in help_text
    h = serve(repo, reload_interval=0.1)
    try:
        add_version(repo, "2", version_dir)
        wait_for(lambda: (MODEL, "2", True) in listed(h))
        assert translate(h).model_version == "2"
    finally:
        h.close()


def test_hot_reload_under_concurrent_traffic_has_no_failed_requests(repo: Path, version_dir: Path) -> None:
    # slow decoding keeps requests queued and running on the old version while it goes (30 ms per step on 1)
    base = wrapping_loader(lambda e: e)

    def load(path: Path, **kwargs: Any) -> Any:
        return SlowEngine(base(path, **kwargs), poll_seconds=0.03 if path.name == "1" else 0.002)

    h = serve(repo, load, reload_interval=0.05)
    traffic = Traffic(h, clients=4)
    try:
        wait_for(lambda: len(traffic.served) >= 20)
        add_version(repo, "2", version_dir)  # found by the poller
        wait_for(lambda: (MODEL, "2", True) in listed(h))
        swapped = time.monotonic()
        old = h.model_version(MODEL, "1")
        wait_for(lambda: len([t for t, _ in traffic.served if t > swapped]) >= 20)
        # a long request on the old version is running when its directory goes
        running = h.stub.Translate.future(pb2.TranslateRequest(texts=[" ".join(TEXTS)], model_version="1"),
                                          timeout=30)
        wait_for(lambda: old.scheduler.running or running.done())
        shutil.rmtree(repo / MODEL / "1")
        wait_for(lambda: (MODEL, "1", False) not in listed(h))
        assert running.result().model_version == "1"  # it finished where it started
        removed = time.monotonic()
        wait_for(lambda: len([t for t, _ in traffic.served if t > removed]) >= 20)
    finally:
        traffic.finish()
    try:
        assert traffic.failures == []
        versions = [v for _, v in traffic.served]
        assert "1" in versions and "2" in versions
        assert {v for t, v in traffic.served if t > removed} == {"2"}
        h.run(h.server.repository.drained())
        assert info_series(h, MODEL, "1") is None and info_series(h, MODEL, "2") == 1
        assert health(h, MODEL) == SERVING
    finally:
        h.close()


# ---- broken versions -----------------------------------------------------------------------------------


def tamper(version: Path) -> str:
    with open(version / "decoder.onnx", "ab") as handle:
        handle.write(b"\0")
    return "decoder.onnx does not match its sha256"


def bad_manifest(version: Path) -> str:
    (version / "manifest.json").write_text('{"format": "nmt-model/1", "name": ', encoding="utf-8")
    return "cannot read"


def missing_file(version: Path) -> str:
    (version / "spm.model").unlink()
    return "spm.model is listed in manifest.json but missing"


@pytest.mark.parametrize("damage", [tamper, bad_manifest, missing_file])
def test_broken_version_is_refused_while_the_old_one_serves(repo: Path, version_dir: Path, logs: list,
                                                            damage: Callable[[Path], str], tmp_path: Path) -> None:
    h = serve(repo)
    try:
        broken = tmp_path / "broken"  # damaged before it appears, as a bad export would be
        shutil.copytree(version_dir, broken)
        expected = damage(broken)
        add_version(repo, "2", broken)
        shutil.rmtree(broken)
        result = scan(h)
        assert list(result.refused) == [(MODEL, "2")] and expected in result.refused[(MODEL, "2")]
        [refusal] = [line for line in logs if line["message"] == "model version refused"]
        assert (refusal["level"], refusal["model"], refusal["version"]) == ("warning", MODEL, "2")
        assert expected in refusal["reason"]
        assert listed(h) == [(MODEL, "1", True)] and translate(h).model_version == "1"
        assert health(h, MODEL) == SERVING
        assert h.metric("nmt_model_loads_total", {"model": MODEL, "result": "refused"}) == 1
        scan(h)  # unchanged files are not tried again
        assert h.metric("nmt_model_loads_total", {"model": MODEL, "result": "refused"}) == 1
        assert len([line for line in logs if line["message"] == "model version refused"]) == 1
        shutil.rmtree(repo / MODEL / "2")  # fixed: the version is replaced by a good copy
        add_version(repo, "2", version_dir)
        assert scan(h).loaded == [(MODEL, "2")]
        assert translate(h).model_version == "2"
    finally:
        h.close()


def test_failing_smoke_translation_refuses_the_version(repo: Path, version_dir: Path, logs: list) -> None:
    class Mute:  # loads and verifies, but translates nothing
        model = None

        def __init__(self, engine: Any) -> None:
            self.engine, self.manifest, self.provider = engine, engine.manifest, engine.provider

        def tokenize(self, text: str) -> list[int]:
            return self.engine.tokenize(text)

        def search_batch(self, requests: Any) -> Any:
            raise RuntimeError("session failed")

    h = serve(repo, wrapping_loader(lambda e: e if e.manifest.version == "1" else Mute(e)))
    try:
        add_version(repo, "2", version_dir)
        manifest = json.loads((repo / MODEL / "2" / "manifest.json").read_text())
        manifest["version"] = "2"  # the manifest's own version: informational, used here to pick the mute one
        (repo / MODEL / "2" / "manifest.json").write_text(json.dumps(manifest))
        result = scan(h)
        assert "smoke translation failed: session failed" in result.refused[(MODEL, "2")]
        assert any(line["message"] == "model version refused" and "session failed" in line["reason"]
                   for line in logs)
        assert listed(h) == [(MODEL, "1", True)] and translate(h).model_version == "1"
    finally:
        h.close()


def test_hashes_are_checked_before_any_onnx_session(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime

    tamper(repo / MODEL / "1")
    sessions: list[str] = []
    real = onnxruntime.InferenceSession

    def session(path: str, *args: Any, **kwargs: Any) -> Any:
        sessions.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    repository = ModelRepository(repo, settings=LoadSettings(provider="cpu"))
    with pytest.raises(VersionRefused, match="decoder.onnx does not match its sha256"):
        repository.load_version(MODEL, "1", repo / MODEL / "1")
    assert sessions == []


def test_start_refuses_broken_versions_and_fails_only_when_nothing_loads(repo: Path, version_dir: Path,
                                                                         logs: list) -> None:
    tamper(add_version(repo, "2", version_dir))
    h = serve(repo)
    try:
        assert listed(h) == [(MODEL, "1", True)]  # the same path as a scan: refused, logged, counted
        assert h.metric("nmt_model_loads_total", {"model": MODEL, "result": "refused"}) == 1
        assert any(line["message"] == "model version refused" and line["version"] == "2" for line in logs)
    finally:
        h.close()
    tamper(repo / MODEL / "1")
    from common.errors import NmtError

    with pytest.raises(NmtError, match="holds no model that loads.*tiny/1: cannot load"):
        serve(repo)


# ---- removed and changed versions ----------------------------------------------------------------------


def test_removed_version_drains_then_disappears(repo: Path, version_dir: Path) -> None:
    add_version(repo, "2", version_dir)
    add_version(repo, "1", version_dir, name="other")
    h = serve(repo, wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.02)), default_model=MODEL)
    try:
        old = h.model_version(MODEL, "2")
        running = h.stub.Translate.future(pb2.TranslateRequest(texts=[" ".join(TEXTS)]), timeout=30)
        wait_for(lambda: old.scheduler.running)
        queued = h.stub.Translate.future(pb2.TranslateRequest(texts=[TEXTS[1]], model_version="2"), timeout=30)
        wait_for(lambda: old.scheduler.queue_depth)
        shutil.rmtree(repo / MODEL / "2")
        shutil.rmtree(repo / "other")
        assert sorted(scan(h).removed) == [("other", "1"), (MODEL, "2")]
        assert listed(h) == [(MODEL, "1", True)]  # at once: no new request goes to a removed version
        error = pytest.raises(grpc.RpcError, translate, h, model_version="2").value
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert translate(h).model_version == "1"
        assert health(h, MODEL) == SERVING and health(h, "other") == NOT_SERVING
        assert info_series(h, MODEL, "2") == 1  # still draining
        assert running.result().model_version == "2" and queued.result().model_version == "2"
        h.run(h.server.repository.drained())
        assert info_series(h, MODEL, "2") is None and info_series(h, "other", "1") is None
        assert h.registry.get_sample_value("nmt_queue_depth", {"model": MODEL, "version": "2"}) is None
        assert old.scheduler._closed and old.users == 0
    finally:
        h.close()


def test_shutdown_closes_versions_still_draining(repo: Path, version_dir: Path) -> None:
    add_version(repo, "2", version_dir)
    h = serve(repo, wrapping_loader(lambda e: SlowEngine(e, poll_seconds=0.05)))
    old = h.model_version(MODEL, "2")
    running = h.stub.Translate.future(pb2.TranslateRequest(texts=[" ".join(TEXTS)]), timeout=30)
    try:
        wait_for(lambda: old.scheduler.running)
        shutil.rmtree(repo / MODEL / "2")
        assert scan(h).removed == [(MODEL, "2")]
    finally:
        h.close()  # while version 2 still drains
    assert old.scheduler._closed and h.model_version(MODEL, "1").scheduler._closed
    assert running.exception(10) is not None  # cut off by the shutdown (grace 0), not left hanging


def test_a_version_whose_files_change_is_reloaded(repo: Path) -> None:
    h = serve(repo)
    try:
        before = h.model_version()
        os.utime(repo / MODEL / "1" / "spm.model")  # e.g. `nmt export --force` rewrote it
        assert scan(h).replaced == [(MODEL, "1")]
        assert h.model_version() is not before and translate(h).model_version == "1"
        tamper(repo / MODEL / "1")  # changed into something broken: refused, the loaded copy keeps serving
        assert list(scan(h).refused) == [(MODEL, "1")]
        assert h.model_version().healthy and translate(h).model_version == "1"
    finally:
        h.close()


# ---- reloading a failing version -----------------------------------------------------------------------


def test_reload_model_version_swaps_engines_without_failed_requests(repo: Path) -> None:
    gate = threading.Event()
    gate.set()

    def load(path: Path, **kwargs: Any) -> Any:
        gate.wait(30)  # lets the test look at health while a reload is loading
        return SlowEngine(wrapping_loader(lambda e: e)(path, **kwargs), poll_seconds=0.002)

    h = serve(repo, load)
    traffic = Traffic(h, clients=3)
    try:
        wait_for(lambda: len(traffic.served) >= 10)
        old = h.model_version()
        gate.clear()
        future = asyncio.run_coroutine_threadsafe(h.server.reload_model_version(MODEL, "1"), h.loop)
        wait_for(lambda: health(h, MODEL) == NOT_SERVING)
        gate.set()
        new = future.result(30)
        assert new is h.model_version() and new is not old and new.engine is not old.engine
        assert health(h, MODEL) == SERVING
        swapped = time.monotonic()
        wait_for(lambda: len([t for t, _ in traffic.served if t > swapped]) >= 10)
        h.run(h.server.repository.drained())
        assert old.scheduler._closed and not new.scheduler._closed
        assert new.engine.results  # the traffic goes through the fresh engine now
        assert info_series(h, MODEL, "1") == 1
        # a reload whose fresh copy is broken: refused, health stays NOT_SERVING, the old copy stays
        tamper(repo / MODEL / "1")
        with pytest.raises(VersionRefused, match="sha256"):
            h.run(h.server.reload_model_version(MODEL, "1"))
        assert health(h, MODEL) == NOT_SERVING and h.model_version() is new
    finally:
        traffic.finish()
    try:
        assert traffic.failures == []
        assert h.metric("nmt_model_loads_total", {"model": MODEL, "result": "loaded"}) == 2
        assert h.metric("nmt_model_loads_total", {"model": MODEL, "result": "refused"}) == 1
    finally:
        h.close()


# ---- SIGHUP --------------------------------------------------------------------------------------------


def test_sighup_makes_nmt_serve_scan(repo: Path, version_dir: Path) -> None:
    command = [sys.executable, "-m", "nmt", "serve", "--model-repository", str(repo), "--listen", "127.0.0.1:0",
               "--metrics-listen", "", "--http-listen", "", "--provider", "cpu", "--intra-op-threads", "1",
               "--reload-interval", "0"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parent.parent)
    try:
        def next_log(message: str) -> dict[str, Any]:
            for line in process.stderr:
                if line.startswith("{") and (entry := json.loads(line))["message"] == message:
                    return entry
            raise AssertionError(f"no {message!r} log line")

        port = next_log("serving")["port"]
        add_version(repo, "2", version_dir)
        process.send_signal(signal.SIGHUP)
        loaded = next_log("model loaded")
        assert (loaded["model"], loaded["version"]) == (MODEL, "2")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb2_grpc.TranslatorStub(channel)
            response = stub.Translate(pb2.TranslateRequest(texts=[TEXTS[0]]), timeout=30)
            assert response.model_version == "2"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
