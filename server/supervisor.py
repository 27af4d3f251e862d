"""``nmt serve --frontends N``: one engine-core process, N front-end processes, one ``/metrics``.

One Python process with one event loop tops out near a thousand requests a second whatever the device,
and the engine's per-step Python shares that process's interpreter lock with gRPC. With ``--frontends N``
the serving is split the way vLLM splits its API servers from its engine core: the engine core
(:mod:`server.core.process`) owns the model repository, the schedulers and the device; N front-ends
(:mod:`server.frontend.process`) do everything else per request and share the gRPC and HTTP ports
(SO_REUSEPORT); they exchange token ids and search results over a Unix socket (:mod:`server.ipc`). This
process, the supervisor, starts them, restarts them, serves ``/metrics`` for all of them and orders the
shutdown:

* **Ports**: each port is reserved here first (bound with SO_REUSEPORT, never listening), so ``port 0``
  resolves to one free port that every front-end then shares, and a port taken by another program
  fails the start with a clear error.
* **Metrics**: every worker writes its metrics into files of a private directory (prometheus_client's
  multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``); ``/metrics`` here sums them, so counts stay exact
  across processes and across restarts (a dead process's counters stay counted; its live gauges go).
* **A front-end that dies** is restarted; only its own calls are lost (the core cancels them). **If the
  core dies**, the front-ends answer UNAVAILABLE at once and readiness turns false; the core is
  restarted (it loads and smoke-tests the models again) and the front-ends reconnect by themselves.
  A worker that keeps dying is restarted after a growing pause (up to ``MAX_BACKOFF_SECONDS``).
* **SIGTERM/SIGINT**: the front-ends drain (stop accepting, finish their calls within
  ``grace_seconds``), then the core stops, then this process. **SIGHUP** goes to the core, which scans
  the model repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, multiprocess, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from common.errors import NmtError
from server.config import ServerConfig, split_host_port
from server.metrics import current_versions_only

log = logging.getLogger("nmt.server")

START_TIMEOUT_SECONDS = 600.0  # a core loads, verifies and smoke-tests every model before it serves
MAX_BACKOFF_SECONDS = 5.0
STABLE_SECONDS = 10.0  # a worker that ran this long restarts at once when it dies
KILL_AFTER_SECONDS = 5.0  # past the grace period: a worker still running is killed


@dataclass(frozen=True)
class ServedModels:
    """What the core said it serves when it started (for the start-up message)."""

    names: list[str]
    default_model: str


@dataclass
class Worker:
    """One child process: its role, its current process and when it started."""

    role: str  # "core" or "frontend-<i>"
    module: str
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    restarts: int = 0


def reserve_port(address: str) -> tuple[socket.socket, int]:
    """Bind ``address`` (host:port, port 0: a free one) with SO_REUSEPORT, not listening: the port is held
    for the front-ends (which bind it the same way) and nobody else; returns the socket and the port."""
    host, port = split_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise NmtError(f"cannot listen on {address}: {error}") from error
    return sock, sock.getsockname()[1]


def announce_ready(ready_file: Path, fields: dict[str, Any]) -> None:
    """Write a worker's ready file atomically: the supervisor never reads it half written."""
    partial = ready_file.with_name(ready_file.name + ".partial")
    partial.write_text(json.dumps(fields))
    os.replace(partial, ready_file)


def with_port(address: str, port: int) -> str:
    return f"{address.rpartition(':')[0]}:{port}"


class WorkerMetrics(Collector):
    """The workers' metrics (prometheus_client's multiprocess files, summed), without the series of model
    versions that are no longer loaded (:func:`server.metrics.current_versions_only`)."""

    def __init__(self, directory: Path) -> None:
        self.files = multiprocess.MultiProcessCollector(None, path=str(directory))

    def collect(self) -> Iterable[Metric]:
        return current_versions_only(self.files.collect())


class ServiceProcessMetrics(Collector):
    """The standard ``process_*`` metrics of the whole service: CPU seconds, memory and open descriptors
    summed over the supervisor and its workers (a worker's own collector cannot report through the
    multiprocess files); start time and descriptor limit are the supervisor's."""

    SUMMED = ("process_cpu_seconds_total", "process_virtual_memory_bytes", "process_resident_memory_bytes",
              "process_open_fds")

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids

    def collect(self) -> Iterable[Metric]:
        supervisor, *workers = self.pids()
        added = dict.fromkeys(self.SUMMED, 0.0)
        for pid in workers:
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                for sample in family.samples:
                    if sample.name in added:
                        added[sample.name] += sample.value
        families = list(ProcessCollector(pid=lambda: supervisor, registry=None).collect())
        for family in families:
            family.samples = [s._replace(value=s.value + added.get(s.name, 0.0)) for s in family.samples]
        return families


class Supervisor:
    """Starts, watches and stops the engine core and the front-ends of one server."""

    def __init__(self, config: ServerConfig) -> None:
        if config.frontends < 1:
            raise NmtError("the supervisor runs front-end processes: set --frontends to 1 or more")
        self.config = config.validate()
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.repository: ServedModels | None = None
        self.workers = [Worker("core", "server.core.process"),
                        *(Worker(f"frontend-{i}", "server.frontend.process") for i in range(config.frontends))]
        self._dir = Path(tempfile.mkdtemp(prefix="nmt-serve-"))  # 0700: the socket and metrics are ours
        self._metrics_dir = self._dir / "metrics"
        self._metrics_dir.mkdir()
        self._address = str(self._dir / "core.sock")  # the core's Unix socket (server.ipc)
        self._all_drained = self._dir / "frontends.drained"  # written once every front-end has drained
        self._held: list[socket.socket] = []
        self._metrics_http: Any = None
        self._watchers: list[asyncio.Task] = []
        self._stopping = False
        self._stopped = asyncio.Event()
        self._shutdown_task: asyncio.Task | None = None
        self._configs: dict[str, str] = {}  # the workers' configuration (ports resolved) by kind, as JSON

    @property
    def core(self) -> Worker:
        return self.workers[0]

    @property
    def frontends(self) -> list[Worker]:
        return self.workers[1:]

    # ---- start -----------------------------------------------------------------------------------------

    async def start(self) -> int:
        """Reserve the ports, start the core (wait until it serves), then the front-ends; serve /metrics.
        Returns the gRPC port."""
        config = self.config
        try:
            sock, self.port = reserve_port(config.listen)
            self._held.append(sock)
            changes: dict[str, Any] = {"listen": with_port(config.listen, self.port), "metrics_listen": ""}
            if config.http_listen:
                sock, self.http_port = reserve_port(config.http_listen)
                self._held.append(sock)
                changes["http_listen"] = with_port(config.http_listen, self.http_port)
            self._configs = {"core": replace(config, **changes).to_json(),  # the core scans the repository:
                             "frontend": replace(config, **changes, reload_interval=0).to_json()}  # not these
            if config.metrics_listen:
                registry = CollectorRegistry()
                registry.register(WorkerMetrics(self._metrics_dir))
                registry.register(ServiceProcessMetrics(lambda: [os.getpid(), *(w.process.pid for w in self.workers
                                                                               if w.process is not None)]))
                host, port = split_host_port(config.metrics_listen)
                try:
                    self._metrics_http, _ = start_http_server(port, addr=host, registry=registry)
                except OSError as error:
                    raise NmtError(f"cannot serve metrics on {config.metrics_listen}: {error}") from error
                self.metrics_port = self._metrics_http.server_port
            ready = await self._spawn(self.core)
            self.repository = ServedModels(ready["models"], ready["default_model"])
            await asyncio.gather(*(self._spawn(w) for w in self.frontends))
        except BaseException:
            await self._stop_all()
            self._cleanup()
            raise
        self._watchers = [asyncio.get_running_loop().create_task(self._watch(w), name=f"watch-{w.role}")
                          for w in self.workers]
        log.info("serving", extra={"fields": {
            "listen": with_port(config.listen, self.port), "port": self.port, "http_port": self.http_port,
            "metrics_port": self.metrics_port, "frontends": config.frontends, "models": self.repository.names,
            "pids": {w.role: w.process.pid for w in self.workers if w.process}}})
        return self.port

    async def _spawn(self, worker: Worker) -> dict[str, Any]:
        """Start ``worker``'s process and wait for its ready file; returns what it wrote there."""
        ready_file = self._dir / f"{worker.role}.{worker.restarts}.ready"
        kind = worker.role.split("-")[0]
        env = dict(os.environ, NMT_WORKER_CONFIG=self._configs[kind], NMT_CORE_ADDRESS=self._address,
                   NMT_READY_FILE=str(ready_file), PROMETHEUS_MULTIPROC_DIR=str(self._metrics_dir),
                   NMT_DRAINED_FILE=str(self._drained_file(worker)), NMT_ALL_DRAINED_FILE=str(self._all_drained))
        worker.process = await asyncio.create_subprocess_exec(sys.executable, "-m", worker.module, env=env)
        worker.started = time.monotonic()
        deadline = worker.started + START_TIMEOUT_SECONDS
        while not ready_file.exists():
            if worker.process.returncode is not None:
                raise NmtError(f"the {worker.role} process exited with status {worker.process.returncode} before "
                               "it served (its log is above)")
            if time.monotonic() > deadline:
                raise NmtError(f"the {worker.role} process did not serve within {START_TIMEOUT_SECONDS:.0f} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.process.wait(), 0.05)
        return json.loads(ready_file.read_text())

    # ---- watch and restart -----------------------------------------------------------------------------

    async def _watch(self, worker: Worker) -> None:
        """Restart ``worker`` whenever its process ends while the server is not stopping."""
        backoff = 0.0
        while True:
            assert worker.process is not None
            code = await worker.process.wait()
            multiprocess.mark_process_dead(worker.process.pid, str(self._metrics_dir))
            if self._stopping:
                return
            ran = time.monotonic() - worker.started
            backoff = 0.0 if ran >= STABLE_SECONDS else min(MAX_BACKOFF_SECONDS, max(0.1, backoff * 2))
            log.error("worker process died; restarting it", extra={"fields": {
                "worker": worker.role, "pid": worker.process.pid, "status": code, "ran_seconds": round(ran, 1),
                "restart_in_seconds": backoff}})
            await asyncio.sleep(backoff)
            worker.restarts += 1
            try:
                await self._spawn(worker)
            except NmtError as error:
                log.error("worker restart failed", extra={"fields": {"worker": worker.role, "error": str(error)}})
                continue  # its process has ended: the loop waits on it and tries again
            log.info("worker process restarted", extra={"fields": {"worker": worker.role,
                                                                      "pid": worker.process.pid}})

    # ---- signals and stop ------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT drain and stop everything; SIGHUP makes the core scan the model repository."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda sig=sig: self._on_signal(sig))
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("signal received", extra={"fields": {"signal": sig.name}})
        self._shutdown_task = asyncio.get_running_loop().create_task(self.shutdown())

    async def reload(self) -> None:
        """Have the core scan the model repository (new versions load, removed ones drain)."""
        process = self.core.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGHUP)

    async def shutdown(self) -> None:
        """Front-ends drain and stop, then the core, then the metrics endpoint (idempotent)."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        log.info("shutting down", extra={"fields": {"grace_seconds": self.config.grace_seconds}})
        await self._stop_all()
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._cleanup()
        log.info("stopped")
        self._stopped.set()

    def _drained_file(self, worker: Worker) -> Path:
        return self._dir / f"{worker.role}.{worker.restarts}.drained"

    async def _stop_all(self) -> None:
        self._stopping = True
        grace = self.config.grace_seconds + KILL_AFTER_SECONDS
        release = asyncio.get_running_loop().create_task(self._release_frontends(self.config.grace_seconds))
        await asyncio.gather(*(_terminate(w, grace) for w in self.frontends))
        release.cancel()
        await _terminate(self.core, grace)

    async def _release_frontends(self, timeout: float) -> None:
        """Tell the draining front-ends when all of them are done (each waits for that before it closes its
        health watches), as one process keeps its watches until its last call has ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                w.process is None or w.process.returncode is not None or self._drained_file(w).exists()
                for w in self.frontends):
            await asyncio.sleep(0.02)
        announce_ready(self._all_drained, {})

    def _cleanup(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None
        for sock in self._held:
            sock.close()
        self._held.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


async def _terminate(worker: Worker, timeout: float) -> None:
    """SIGTERM ``worker``'s process; SIGKILL it when it has not ended after ``timeout`` seconds."""
    process = worker.process
    if process is None or process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        log.warning("worker did not stop in time; killing it", extra={"fields": {"worker": worker.role}})
        process.kill()
        await process.wait()


async def supervise(config: ServerConfig, on_started: Callable[[Supervisor], None] | None = None) -> None:
    """Run the split server until SIGTERM / SIGINT (what ``nmt serve --frontends N`` does)."""
    supervisor = Supervisor(config)
    supervisor.install_signal_handlers()
    await supervisor.start()
    if on_started is not None:
        on_started(supervisor)
    await supervisor.wait_for_termination()
