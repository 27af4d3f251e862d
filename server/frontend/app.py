"""Server assembly: model repository, interceptor, servicer, gRPC server, health, reflection, metrics and shutdown.

::

    server = TranslationServer(config, opener=open_repository)  # server.core.process: load the models here
    port = await server.start()          # binds config.listen (port 0: a free port)
    ...
    await server.reload()                # what SIGHUP and the poller do: load new versions, drop removed ones
    await server.shutdown()              # what SIGTERM / SIGINT do

The repository is the one registry of the served models: each model version owns its engine and its
scheduler (created at load, started and closed here through the repository); the servicer resolves a
model version there and hands it the request. The repository changes at run time (hot reload, see
:mod:`server.core.repository`): every ``reload_interval`` seconds, on SIGHUP, and through
:meth:`TranslationServer.reload_model_version` (which a model version whose engine breaks calls
itself); per-model health follows each change. The interceptor (:mod:`server.frontend.interceptor`) does what
every call shares: request ids, bearer-token authentication (:mod:`server.frontend.auth`), request logs, request
and gRPC metrics, the in-flight count. The gRPC port is plaintext, TLS or mutual TLS (:mod:`server.frontend.tls`);
reflection (:mod:`server.frontend.reflection`, both ``v1`` and ``v1alpha``) can be turned off. Certificates and
the tokens file are read when the server is created, so a bad one fails before any model loads. The
HTTP/JSON face and the alignment explorer (:mod:`server.frontend.http_face`, ``http_listen``) run on the same event
loop and call the same servicer through the same interceptor.

Shutdown, in order: health turns NOT_SERVING (overall, per model and for the service), scans stop, new
Translator requests get UNAVAILABLE (the servicer; over HTTP 503, and ``/readyz`` answers 503) while
those in flight on either face (counted by the interceptor) finish within ``grace_seconds`` and callers
move away (no new call for ``DRAIN_QUIET_SECONDS``, also within the grace period), the gRPC
server stops (cancelling whatever is left), the HTTP face closes, the schedulers stop and the metrics
endpoint closes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from common.errors import NmtError
from server.config import ServerConfig, compat_apis, split_host_port
from server.frontend.auth import Authenticator
from server.frontend.interceptor import RequestInterceptor
from server.frontend.servicer import TranslatorService
from server.frontend.tls import server_credentials, tls_mode
from server.metrics import ServerMetrics
from server.protos import SERVICE_NAME, method_types, pb2_grpc, translator_descriptor

# (config, metrics) -> a model repository: server.core.process.open_repository in one process
RepositoryOpener = Callable[[ServerConfig, ServerMetrics], Awaitable[Any]]

log = logging.getLogger("nmt.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE_NAME = health.SERVICE_NAME  # "grpc.health.v1.Health"
STOP_SECONDS = 1.0  # after the drain: how long other open calls (health watches) get before cancellation
# Drain: callers that still route here (a health watch or a balancer not yet updated) get UNAVAILABLE and
# retry elsewhere; the server stops once none has called for this long (or the grace period is over).
DRAIN_QUIET_SECONDS = 0.5
MIN_PING_INTERVAL_MS = 10_000  # clients may send HTTP/2 keepalive pings this often (gRPC's default: 5 minutes)


def server_options(config: ServerConfig, *, reuse_port: bool = False) -> list[tuple[str, int]]:
    """gRPC server channel arguments: accept the clients' keepalive pings (also on connections with no call,
    e.g. a proxy's pooled ones) and, with ``max_connection_age``, send GOAWAY after that age; the calls already
    on the connection keep it until they end (gRPC's unbounded default grace: a long stream is never cut). The
    port is shared (SO_REUSEPORT) only with ``reuse_port``: the front-ends of one server; else a taken port
    fails."""
    options = [("grpc.so_reuseport", int(reuse_port)), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS)]
    if config.max_connection_age > 0:
        options.append(("grpc.max_connection_age_ms", int(config.max_connection_age * 1000)))
    return options


class TranslationServer:
    """The whole serving process, started and stopped in-process (tests) or by ``nmt serve``."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        registry: CollectorRegistry | None = None,
        opener: RepositoryOpener | None = None,
        repository: Any = None,
        reuse_port: bool = False,
    ) -> None:
        self.config = config.validate()
        self.metrics = ServerMetrics(registry)
        self.metrics.init_service(SERVICE_NAME, method_types())  # every series at 0 from the start: rate() works
        if config.http_listen:  # the HTTP stack (aiohttp, ~10 MiB) is loaded only when the face is on
            from server.frontend.http_face import http_routes

            self.metrics.init_http(route.method.name for route in http_routes(translator_descriptor()))
        self.credentials = server_credentials(config)  # None: plaintext
        self.authenticator = Authenticator.from_file(config.auth_tokens_file) if config.auth_tokens_file else None
        self.interceptor = RequestInterceptor(self.metrics, service=SERVICE_NAME, authenticator=self.authenticator)
        self.opener = opener
        self.repository = repository  # a ModelRepository, or a front-end's RemoteRepository
        self.reuse_port = reuse_port  # share the ports with the other front-ends of the server
        self.health = health.aio.HealthServicer()
        self.servicer: TranslatorService | None = None
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_http: Any = None
        self.metrics_port: int | None = None
        self.http: Any = None  # the HTTP/JSON face and the explorer page (--http-listen): an http_face.HttpFace
        self.http_port: int | None = None
        self._shutdown_task: asyncio.Task | None = None
        self._signal_task: asyncio.Task | None = None
        self._health_models: set[str] = set()  # model names given a health status
        # --frontends N: after this front-end's drain, wait (until the deadline) for the other front-ends' drains,
        # so that no health watch ends while the server still answers calls (server.frontend.process)
        self.after_drain: Callable[[float], Awaitable[None]] | None = None
        self._stopped = asyncio.Event()

    # ---- start -----------------------------------------------------------------------------------------

    async def start(self) -> int:
        """Open the model repository (``opener``: load the models here), unless given one (a front-end's view of
        the engine core, :class:`server.frontend.remote.RemoteRepository`); start its schedulers and the
        servers; return the gRPC port."""
        config = self.config
        if self.repository is None:
            if self.opener is None:
                raise NmtError("no model repository to serve: give TranslationServer a repository or an opener "
                               "(server.core.process.open_repository)")
            self.repository = await self.opener(config, self.metrics)
        self.repository.start()

        self.servicer = TranslatorService(repository=self.repository, config=config, metrics=self.metrics)
        self.server = grpc.aio.server(interceptors=[self.interceptor],
                                      options=server_options(config, reuse_port=self.reuse_port))
        pb2_grpc.add_TranslatorServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self._sync_health()
        self.repository.add_listener(self._sync_health)
        if config.reflection:
            from server.frontend.reflection import enable_server_reflection

            enable_server_reflection([SERVICE_NAME, HEALTH_SERVICE_NAME], self.server)
        try:
            if self.credentials is None:
                self.port = self.server.add_insecure_port(config.listen)
            else:
                self.port = self.server.add_secure_port(config.listen, self.credentials)
        except RuntimeError as error:  # grpcio raises on a failed bind
            raise NmtError(f"cannot listen on {config.listen}: {error}") from error
        if self.port == 0:
            raise NmtError(f"cannot listen on {config.listen}")
        await self.server.start()
        if config.metrics_listen:
            try:
                self.metrics_http = self.metrics.serve_http(config.metrics_listen)
            except OSError as error:
                await self.server.stop(0)
                raise NmtError(f"cannot serve metrics on {config.metrics_listen}: {error}") from error
            self.metrics_port = self.metrics_http.server_port
        if config.http_listen:
            await self._start_http(config.http_listen)
        self.repository.watch(config.reload_interval)
        self._warn_about_auth()
        log.info("serving", extra={"fields": {
            "listen": config.listen, "port": self.port, "metrics_port": self.metrics_port, "http_port": self.http_port,
            "models": [f"{mv.name}/{mv.version}" for mv in self.repository],
            "default_model": self.repository.default_model, "tls": tls_mode(config),
            "auth": f"bearer tokens ({len(self.authenticator)})" if self.authenticator else "off",
            "reflection": config.reflection, "reload_interval": config.reload_interval}})
        return self.port

    async def _start_http(self, address: str) -> None:
        """The HTTP/JSON face on the same event loop, calling the same servicer through the same interceptor."""
        from server.frontend.compat import compat_routes
        from server.frontend.http_face import HttpFace

        self.http = HttpFace(service=translator_descriptor(), servicer=self.servicer, interceptor=self.interceptor,
                             ready=self.readiness, cors=self.config.cors_origins)
        compat_routes(self.http.app, self.servicer, self.interceptor, compat_apis(self.config.compat_apis))
        try:
            self.http_port = await self.http.start(address, reuse_port=self.reuse_port)
        except OSError as error:
            await self.server.stop(0)
            if self.metrics_http is not None:
                self.metrics_http.shutdown()
                self.metrics_http.server_close()
            raise NmtError(f"cannot serve HTTP on {address}: {error}") from error

    def readiness(self) -> tuple[bool, str]:
        """Ready for traffic (``/readyz``): not draining, and the newest version of every model serving."""
        if self.servicer is None or self.servicer.draining:
            return False, "draining" if self.servicer is not None else "starting"
        down = [name for name in self.repository.names if not self.repository.serving(name)]
        return (False, f"not serving: {', '.join(down)}") if down else (True, "")

    def _warn_about_auth(self) -> None:
        """Tokens crossing a network in plaintext, and tokens restricted to models that are not loaded."""
        if self.authenticator is None:
            return
        host = split_host_port(self.config.listen)[0]
        if self.credentials is None and host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("bearer tokens on a plaintext port: anyone on the path can read them; set tls_cert and "
                        "tls_key, or terminate TLS in front of this server", extra={"fields": {
                            "listen": self.config.listen}})
        unknown = sorted(self.authenticator.model_names - set(self.repository.names))
        if unknown:
            log.warning("the tokens file names models that are not loaded", extra={"fields": {"models": unknown}})

    # ---- hot reload ------------------------------------------------------------------------------------

    async def reload(self) -> Any:
        """Scan the model repository once (what SIGHUP and the poller do): new versions are loaded, verified,
        smoke-tested and served beside the old ones (the newest becomes the latest); broken ones are refused
        with a log line; removed ones drain and close. Returns what changed."""
        assert self.repository is not None, "start() first"
        return await self.repository.scan()

    async def reload_model_version(self, name: str, version: str) -> Any:
        """Replace the loaded version ``name``/``version`` by a fresh copy from its directory (new ONNX Runtime
        sessions and scheduler); call it when the version's sessions keep failing.

        Contract (:meth:`server.core.repository.ModelRepository.reload_version`): health for ``name`` turns
        NOT_SERVING at once while this version is its newest; the fresh copy is loaded off the event loop and
        checked like any new version (manifest, sha256 of every file, a smoke translation). On success it
        serves every new request, health for ``name`` is SERVING again, and the old copy's queued and running
        requests finish on it (within ``grace_seconds``) before it is closed; the new version is returned.
        On failure :class:`server.core.repository.VersionRefused` is raised (logged, counted in
        ``nmt_model_loads_total{result="refused"}``), the old copy stays in place and health stays
        NOT_SERVING; calling again retries. :class:`server.errors.NotFound` if the version is not loaded.
        Safe to call concurrently with scans and with itself (they are serialized)."""
        assert self.repository is not None, "start() first"
        return await self.repository.reload_version(name, version)

    async def _sync_health(self) -> None:
        """Health of the server (``""``) and of the Translator service: SERVING while something decodes (a
        front-end's engine core may be away, and then nothing here can answer). Per model: SERVING while the
        model's newest version works, NOT_SERVING otherwise and once its last version is gone."""
        assert self.repository is not None
        overall = SERVING if self.repository.available else NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, overall)
        names = set(self.repository.names)
        for name in sorted(names | self._health_models):
            await self.health.set(name, SERVING if self.repository.serving(name) else NOT_SERVING)
        self._health_models |= names

    # ---- stop ------------------------------------------------------------------------------------------

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain and stop (idempotent: a second call waits for the first one's end)."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self._shutdown(grace))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, grace: float | None) -> None:
        grace = self.config.grace_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        log.info("shutting down", extra={"fields": {"grace_seconds": grace}})
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING, and it stays so
        if self.repository is not None:
            await self.repository.stop_scans()
        if self.servicer is not None:
            self.servicer.start_draining()
            remaining = max(0.0, deadline - time.monotonic())
            drained = await self.interceptor.wait_idle(remaining, quiet=DRAIN_QUIET_SECONDS)
            if not drained:
                log.warning("grace period over with requests in flight; cancelling them")
            if self.after_drain is not None:
                await self.after_drain(deadline)
        if self.server is not None:
            # Translator calls are done (or out of time); what is left are health watches and reflection
            # streams, which never end by themselves: give them a moment, not the rest of the grace period.
            await self.server.stop(min(STOP_SECONDS, max(0.0, deadline - time.monotonic())))
        if self.http is not None:
            await self.http.stop()
        if self.servicer is not None:
            await self.servicer.close()
        if self.repository is not None:
            await self.repository.close(timeout=max(0.0, deadline - time.monotonic()))
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
        log.info("stopped")
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start the graceful shutdown; SIGHUP scans the model repository (:meth:`reload`)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("signal received", extra={"fields": {"signal": sig.name}})
        self._signal_task = asyncio.get_running_loop().create_task(self.shutdown())

    def _on_sighup(self) -> None:
        log.info("signal received", extra={"fields": {"signal": "SIGHUP"}})
        if self.repository is not None:  # else still loading: the first scan is under way
            self.repository.scan_soon()

    async def __aenter__(self) -> TranslationServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown(grace=0 if exc[0] else None)
