"""``nmt serve --demo`` serves its first model while a child process builds the others.

The child here is a real ``nmt export`` of the session's tiny Bahdanau model (the demo's own child trains
for minutes): it adds a model to the repository while the server serves, and the server serves it as soon
as the child exits, with hot reload off. A child that fails is logged and changes nothing; a server that
stops first stops the child.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nmt.demo import DEMO_DEFAULT_MODEL, DEMO_MODELS, BackgroundBuild, demo_build_command, demo_default_model
from server.config import ServerConfig
from server.protos import pb2
from tests.harness import ServerHarness

LATER = [name for name in DEMO_MODELS if name != DEMO_DEFAULT_MODEL][0]  # the model built in the background


@pytest.fixture()
def demo_repository(tiny_models: dict[str, Path], tmp_path: Path) -> Path:
    """A repository holding the first demo model only (the tiny Transformer): the state after the first build."""
    root = tmp_path / "models"
    shutil.copytree(tiny_models["transformer"], root / DEMO_DEFAULT_MODEL / "1")
    return root


@pytest.fixture()
def harness(demo_repository: Path) -> Iterator[ServerHarness]:
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="",
                          model_repository=str(demo_repository), default_model=demo_default_model(demo_repository),
                          provider="cpu", intra_op_threads=1, grace_seconds=1, reload_interval=0)
    h = ServerHarness(config)
    yield h
    h.close()


@pytest.fixture()
def demo_log() -> Iterator[list[logging.LogRecord]]:
    """The records of the ``nmt.demo`` logger (``nmt`` does not propagate once ``nmt serve`` configured it)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("nmt.demo")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


def listed(h: ServerHarness) -> list[str]:
    return [m.name for m in h.stub.ListModels(pb2.ListModelsRequest(), timeout=10).models]


def test_a_model_built_in_the_background_is_served_when_the_child_exits(
        harness: ServerHarness, demo_repository: Path, tiny_runs: dict[str, Path], tmp_path: Path,
        demo_log: list[logging.LogRecord]) -> None:
    command = [sys.executable, "-m", "nmt", "export", "--no-stage-processes", str(tiny_runs["bahdanau"]),
               "--name", LATER, "--model-repository", str(demo_repository), "--parity-sentences", "2", "--no-progress"]
    build = BackgroundBuild(command, tmp_path / "runs" / "demo-build.log", [LATER])
    assert listed(harness) == [DEMO_DEFAULT_MODEL]
    task = asyncio.run_coroutine_threadsafe(build.run(harness.server), harness.loop)
    while not task.done():  # the first model answers while the child builds
        request = pb2.TranslateRequest(texts=["one two"])
        assert harness.stub.Translate(request, timeout=30).translations[0].hypotheses[0].text
        time.sleep(0.2)
    task.result()
    assert sorted(listed(harness)) == sorted([LATER, DEMO_DEFAULT_MODEL])
    assert harness.server.repository.default_model == DEMO_DEFAULT_MODEL  # not taken over by the new model
    request = pb2.TranslateRequest(texts=["one two"], model=LATER)
    assert harness.stub.Translate(request, timeout=30).translations[0].hypotheses[0].text
    assert LATER in build.log_path.read_text()  # the child's output
    assert [r.getMessage() for r in demo_log] == ["building models in the background", "background build done"]


def test_a_failed_background_build_is_logged_and_changes_nothing(
        harness: ServerHarness, tmp_path: Path, demo_log: list[logging.LogRecord]) -> None:
    command = [sys.executable, "-c", "import sys; print('out of disk'); sys.exit(3)"]
    build = BackgroundBuild(command, tmp_path / "demo-build.log", [LATER])
    harness.run(build.run(harness.server))
    assert listed(harness) == [DEMO_DEFAULT_MODEL]
    assert build.log_path.read_text() == "out of disk\n"
    failed = demo_log[-1]
    assert failed.levelno == logging.ERROR and failed.fields["exit_code"] == 3  # type: ignore[attr-defined]


def test_a_child_interrupted_with_the_server_is_no_failure(harness: ServerHarness, tmp_path: Path,
                                                           demo_log: list[logging.LogRecord]) -> None:
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # e.g. pytest started as `(cmd &)` by a shell
        pytest.skip("SIGINT is ignored in this process, so the build child inherits that: Ctrl-C cannot reach it")
    command = [sys.executable, "-m", "nmt", "serve", "--demo", "--demo-only", "--model-repository",
               str(tmp_path / "models"), "--demo-runs", str(tmp_path / "runs")]
    build = BackgroundBuild(command, tmp_path / "demo-build.log", [LATER])
    task = asyncio.run_coroutine_threadsafe(build.run(harness.server), harness.loop)
    deadline = time.monotonic() + 120
    while "building" not in (build.log_path.read_text() if build.log_path.exists() else ""):
        assert time.monotonic() < deadline, "the child did not start building"
        time.sleep(0.1)
    child = [p for p in os.listdir("/proc") if p.isdigit() and "--demo-only" in _cmdline(p) and str(tmp_path) in
             _cmdline(p)]
    assert len(child) == 1
    os.kill(int(child[0]), signal.SIGINT)  # what Ctrl-C in the terminal sends the whole process group
    task.result(timeout=60)
    assert listed(harness) == [DEMO_DEFAULT_MODEL]
    stopped = demo_log[-1]
    assert stopped.levelno == logging.INFO and "interrupted" in stopped.getMessage()
    assert stopped.fields["exit_code"] == 130  # type: ignore[attr-defined]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_server_that_stops_first_stops_the_child(harness: ServerHarness, tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]
    build = BackgroundBuild(command, tmp_path / "demo-build.log", [LATER])
    task = asyncio.run_coroutine_threadsafe(build.run(harness.server), harness.loop)
    deadline = time.monotonic() + 30
    while not build.log_path.exists() or not build.log_path.read_text():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    pid = int(build.log_path.read_text())
    task.cancel()  # what asyncio.run does to the task when the server's loop ends
    deadline = time.monotonic() + 10
    while True:  # terminated and reaped: the pid is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the child outlived the server"
        time.sleep(0.05)


def test_the_demo_picks_its_default_model_and_builds_the_rest_with_nmt(tmp_path: Path,
                                                                       demo_repository: Path) -> None:
    assert demo_default_model(demo_repository) == DEMO_DEFAULT_MODEL
    assert demo_default_model(tmp_path / "empty") == ""
    (demo_repository / "mine" / "1").mkdir(parents=True)  # a repository of one's own keeps the server's rule
    shutil.copytree(demo_repository / DEMO_DEFAULT_MODEL / "1", demo_repository / "mine" / "1", dirs_exist_ok=True)
    assert demo_default_model(demo_repository) == ""
    command = demo_build_command(tmp_path / "models", tmp_path / "runs")
    assert command[:3] == [sys.executable, "-m", "nmt"] and "--demo-only" in command
