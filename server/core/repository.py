"""The model repository: every ``<root>/<name>/<version>/manifest.json``, loaded as an engine with its scheduler,
and kept in step with the directory while the server runs (hot reload).

Like Triton's layout: the directory names are the model name and version (the manifest's own
``name``/``version`` are informational). Versions sort numerically when they are integers (``2`` <
``10``), other versions sort after them by name; the last one is the newest and serves requests that
name no version. The default model is the configured one, else the first name in sorted order.
Directories whose name starts with a dot are ignored (copy a version in as ``.tmp`` and rename it).

The repository is the one registry of the served models: each :class:`ModelVersion` owns its engine
and the :class:`server.core.scheduler.ModelScheduler` that is the one way into it; the repository starts
and closes the schedulers. A request holds its version through :meth:`ModelRepository.acquire` from
resolution to response, so a version is closed only once nobody uses it.

One path loads a version, at start-up and later alike (:meth:`ModelRepository.scan`):

1. **load**: the engine loader reads ``manifest.json``, checks the sha256 of every listed file
   (:func:`common.model_format.manifest.read_manifest`) and only then opens the ONNX Runtime sessions;
2. **smoke test**: one short sentence is translated through the new engine;
3. **register**: its scheduler starts, it is put beside the model's other versions (the newest
   becomes the latest), its metric series appear and the change listeners run (health).

A version that fails 1 or 2 is *refused*: one JSON log line ``model version refused`` with the
reason, ``nmt_model_loads_total{result="refused"}``, and the versions already served carry on. It
is not tried again until its files change (size, mtime or inode of any file in its directory).
A loaded version whose files change is reloaded the same way and swapped in (the old one keeps
serving if the new files are refused). A version whose directory disappears is *removed*: no new
request is routed to it, the requests holding it finish (at most ``grace_seconds``), then its
scheduler closes, its engine is dropped and its metric series go.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from common.errors import NmtError
from common.model_format.layout import discover_versions, version_key
from server.core.scheduler import ModelScheduler, smoke_test
from server.errors import NotFound
from server.metrics import ServerMetrics
from server.policy import BatchPolicy, RequestHandle
from server.text import TextCodec
from server.types import SearchResult, SentenceRequest
from server.versions import Held, ManifestFields, VersionIndex

log = logging.getLogger("nmt.server")

# (version_dir, provider, intra_op_threads, inter_op_threads, spinning, prepack, **device) -> an Engine
EngineLoader = Callable[..., Any]
ChangeListener = Callable[[], Awaitable[None]]

Fingerprint = tuple[tuple[str, int, int, int], ...]  # (file name, size, mtime_ns, inode) of every file


def default_engine_loader(
    version_dir: Path, *, provider: str, intra_op_threads: int, inter_op_threads: int, spinning: bool = False,
    prepack: str = "main", **device: Any,
) -> Any:
    """``Engine.load``; ``device``: its device_id, gpu_mem_limit, cuda_tf32, device_search, cuda_graphs and
    graph_pool_mib (when set)."""
    from server.engine.engine import Engine  # onnxruntime is imported only when models are loaded

    return Engine.load(version_dir, provider=provider, intra_op_threads=intra_op_threads,
                       inter_op_threads=inter_op_threads, spinning=spinning, prepack=prepack, **device)


class VersionRefused(NmtError):
    """A model version that failed to load, verify or translate its smoke sentence; ``reason`` says why."""

    def __init__(self, name: str, version: str, path: Path, reason: str) -> None:
        super().__init__(f"model {name} version {version} from {path} refused: {reason}")
        self.name, self.version, self.path, self.reason = name, version, path, reason


@dataclass(frozen=True)
class LoadSettings:
    """How every version is loaded: engine loader and its ONNX Runtime settings, batching policy, metrics."""

    provider: str = "auto"
    intra_op_threads: int = 0
    inter_op_threads: int = 1
    spinning: bool = False
    prepack: str = "main"  # server.config.PREPACK
    device: dict[str, Any] = field(default_factory=dict)  # device_id, gpu_mem_limit, cuda_tf32, device_search, ...
    engine_loader: EngineLoader | None = None
    policy: BatchPolicy | None = None
    metrics: ServerMetrics | None = None


@dataclass(eq=False)
class ModelVersion(ManifestFields, Held):
    """One loaded version of a model: its engine and the scheduler that batches requests into it."""

    name: str
    version: str
    path: Path
    engine: Any  # server.engine.engine.Engine (or anything with the same API)
    scheduler: ModelScheduler
    is_latest: bool = False
    fingerprint: Fingerprint = ()  # of the directory's files when it was loaded
    healthy: bool = True  # False once reported failing (reload_version), until a fresh copy replaces it
    users: int = 0  # requests holding it (ModelRepository.acquire)
    _unused: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self._unused.set()

    @property
    def manifest(self) -> Any:
        return self.engine.manifest

    @property
    def codec(self) -> TextCodec:
        """The text side (tokenizer and manifest) of the engine."""
        return self.engine.text

    async def submit(self, sentences: Sequence[SentenceRequest], work: Sequence[int],
                     request: RequestHandle) -> list[SearchResult]:
        """:meth:`server.core.scheduler.ModelScheduler.submit` of this version's scheduler."""
        return await self.scheduler.submit(sentences, work, request)

    @property
    def provider(self) -> str:
        """The execution provider the sessions run on."""
        return str(getattr(self.engine, "provider", ""))

    @property
    def device(self) -> str:
        return str(getattr(self.engine, "device", ""))

    @property
    def runtime_build(self) -> str:
        return str(getattr(self.engine, "runtime_build", ""))


@dataclass
class ScanResult:
    """What one :meth:`ModelRepository.scan` changed: ``(name, version)`` pairs, and the refusals' reasons."""

    loaded: list[tuple[str, str]] = field(default_factory=list)
    replaced: list[tuple[str, str]] = field(default_factory=list)
    removed: list[tuple[str, str]] = field(default_factory=list)
    refused: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.loaded or self.replaced or self.removed)


class ModelRepository(VersionIndex[ModelVersion]):
    """Loaded model versions, looked up by (name, version) with defaults, kept in step with ``root``.

    Build it with :meth:`open` (first scan included); :meth:`scan` looks again (the poller and SIGHUP
    call it); :meth:`reload_version` swaps a failing version for a fresh copy. Every change runs
    under one lock, so two scans never interleave. All methods run on the server's event loop;
    loading and hashing run on worker threads.
    """

    def __init__(self, root: str | Path, *, settings: LoadSettings | None = None, default_model: str = "",
                 grace_seconds: float = 10.0) -> None:
        self.root = Path(root)
        self.settings = settings or LoadSettings()
        self.grace_seconds = grace_seconds
        super().__init__(default_model)
        self._default_configured = bool(default_model)
        self._refused: dict[tuple[str, str], Fingerprint] = {}  # not retried until the fingerprint changes
        self._lock = asyncio.Lock()
        self._listeners: list[ChangeListener] = []
        self._drains: dict[asyncio.Task, ModelVersion] = {}  # removed or replaced versions being drained
        self._repairs: set[asyncio.Task] = set()  # reloads of broken versions (a reference keeps each alive)
        self._scans: set[asyncio.Task] = set()  # the poller and SIGHUP scans (watch, scan_soon)
        self._started = False
        self._closed = False

    @classmethod
    async def open(cls, root: str | Path, *, settings: LoadSettings | None = None, default_model: str = "",
                   grace_seconds: float = 10.0) -> ModelRepository:
        """The repository after its first :meth:`scan`; raises :class:`NmtError` when no version loads or the
        configured default model has none (broken versions beside working ones are refused and logged)."""
        repository = cls(root, settings=settings, default_model=default_model, grace_seconds=grace_seconds)
        result = await repository.scan()
        if not repository._models:
            reasons = "".join(f"; {name}/{version}: {why}" for (name, version), why in result.refused.items())
            raise NmtError(f"the model repository {root} holds no model that loads (expected "
                           f"<repo>/<name>/<version>/manifest.json){reasons}")
        if default_model and default_model not in repository._models:
            raise NmtError(f"default model {default_model!r} is not in the repository "
                           f"(models: {repository.names})")
        return repository

    def add_listener(self, listener: ChangeListener) -> None:
        """``await listener()`` after every change of the served versions (the server syncs health with it)."""
        self._listeners.append(listener)

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every version's scheduler (on the running event loop); later versions start when registered."""
        self._started = True
        for mv in self:
            mv.scheduler.start()

    async def close(self, timeout: float | None = None) -> None:
        """Close every version's scheduler: queued and running sentences get ``timeout`` seconds to finish.
        Scans after this change nothing."""
        await self.stop_scans()
        self._closed = True
        retiring = list(self._drains.items())
        for task, _ in retiring:
            task.cancel()
        await asyncio.gather(*(task for task, _ in retiring), return_exceptions=True)
        versions = [*self, *(mv for _, mv in retiring)]
        await asyncio.gather(*(mv.scheduler.close(timeout=timeout) for mv in versions))

    # ---- watching the directory ------------------------------------------------------------------------

    def watch(self, interval: float) -> None:
        """Scan every ``interval`` seconds (0: never) until :meth:`stop_scans`; failures are logged."""
        if interval > 0:
            self._keep(asyncio.get_running_loop().create_task(self._poll(interval), name="repository-poller"))

    def scan_soon(self) -> None:
        """Scan now, in the background (what SIGHUP does); a failure is logged."""
        self._keep(asyncio.get_running_loop().create_task(self.rescan(), name="repository-scan"))

    async def stop_scans(self) -> None:
        """Cancel the poller and the scans in progress (shutdown)."""
        scans = list(self._scans)
        for task in scans:
            task.cancel()
        await asyncio.gather(*scans, return_exceptions=True)

    async def rescan(self) -> None:
        """:meth:`scan`, logging a failure instead of raising: a failed scan (e.g. the repository unmounted)
        changes nothing."""
        try:
            await self.scan()
        except Exception:  # noqa: BLE001
            log.exception("model repository scan failed", extra={"fields": {"model_repository": str(self.root)}})

    async def _poll(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.rescan()

    def _keep(self, task: asyncio.Task) -> None:
        self._scans.add(task)  # a reference keeps it alive
        task.add_done_callback(self._scans.discard)

    # ---- loading: the one path in ----------------------------------------------------------------------

    def load_version(self, name: str, version: str, path: Path) -> ModelVersion:
        """Load, verify and smoke-test one version directory (blocking: call it on a worker thread).

        Raises :class:`VersionRefused` with the reason. The scheduler is created, not started."""
        s = self.settings
        loader = s.engine_loader or default_engine_loader
        fingerprint = directory_fingerprint(path)
        try:
            engine = loader(path, provider=s.provider, intra_op_threads=s.intra_op_threads,
                            inter_op_threads=s.inter_op_threads, spinning=s.spinning, prepack=s.prepack,
                            **s.device)
        except Exception as error:  # noqa: BLE001 - whatever breaks a version refuses it, with the reason
            raise VersionRefused(name, version, path, f"cannot load: {error}") from error
        try:
            smoke_test(engine)
        except Exception as error:  # noqa: BLE001
            raise VersionRefused(name, version, path, f"smoke translation failed: {error}") from error
        scheduler = ModelScheduler(engine, policy=s.policy, metrics=s.metrics, model=name, version=version,
                                   on_broken=partial(self._on_broken, name, version))
        return ModelVersion(name, version, path, engine, scheduler, fingerprint=fingerprint)

    async def scan(self) -> ScanResult:
        """Bring the served versions in step with the directory: load new (and changed) versions, remove the
        vanished ones. Serialized: a second call waits for the first one, then scans again. Removed versions
        drain in the background (:meth:`drained` waits for them)."""
        result = ScanResult()
        async with self._lock:
            if self._closed:
                return result
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(None, _discover_with_fingerprints, self.root)
            self._refused = {key: fp for key, fp in self._refused.items() if key in found}  # vanished: forget
            for (name, version), (path, fingerprint) in found.items():
                current = self._find(name, version)
                if current is not None and current.fingerprint == fingerprint:
                    continue
                if self._refused.get((name, version)) == fingerprint:
                    continue  # refused before, and its files have not changed since
                try:
                    mv = await loop.run_in_executor(None, self.load_version, name, version, path)
                except VersionRefused as refusal:
                    self._refuse(refusal, fingerprint)
                    result.refused[(name, version)] = refusal.reason
                    continue
                if self._closed:
                    break
                if current is None:
                    self._register(mv)
                    result.loaded.append((name, version))
                else:
                    self._swap(current, mv)
                    result.replaced.append((name, version))
                self._count_load(name, "loaded")
                log.info("model loaded", extra={"fields": {
                    "model": name, "version": version, "provider": getattr(mv.engine, "provider", ""),
                    "replaced": current is not None}})
                await self._notify()
            for mv in list(self):
                if (mv.name, mv.version) not in found and not self._closed:
                    self._unregister(mv)
                    result.removed.append((mv.name, mv.version))
                    log.info("model version removed; draining", extra={"fields": {
                        "model": mv.name, "version": mv.version, "users": mv.users}})
                    await self._notify()
        return result

    async def reload_version(self, name: str, version: str) -> ModelVersion:
        """Replace a loaded version by a fresh copy from its directory (new engine and scheduler), e.g. when
        its ONNX Runtime sessions keep failing.

        Contract: the version is marked unhealthy at once, so while it is the model's newest version the
        model's health is NOT_SERVING (listeners run). The fresh copy goes through the same load, hash check
        and smoke translation as any version. On success it is swapped in (new requests go to it, health
        SERVING again), and the old copy drains (the requests holding it finish there, at most
        ``grace_seconds``) and is closed; the fresh :class:`ModelVersion` is returned. On failure
        :class:`VersionRefused` is raised, logged and counted, the old copy stays registered and unhealthy
        (health stays NOT_SERVING), and a later call may try again. :class:`NotFound` when the version is
        not loaded. Serialized with :meth:`scan`."""
        async with self._lock:
            current = self._find(name, version)
            if current is None or self._closed:
                raise NotFound(f"model {name!r} has no loaded version {version!r}")
            current.healthy = False
            await self._notify()
            fingerprint = await asyncio.to_thread(directory_fingerprint, current.path)
            try:
                mv = await asyncio.get_running_loop().run_in_executor(None, self.load_version, name, version,
                                                                      current.path)
            except VersionRefused as refusal:
                self._refuse(refusal, fingerprint)
                raise
            self._swap(current, mv)
            self._count_load(name, "loaded")
            log.info("model version reloaded", extra={"fields": {"model": name, "version": version}})
            await self._notify()
            return mv

    def _on_broken(self, name: str, version: str) -> None:
        """A version's engine fails even a known-good sentence (its scheduler says so): reload it."""
        task = asyncio.get_running_loop().create_task(self._reload_broken(name, version))
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _reload_broken(self, name: str, version: str) -> None:
        try:
            await self.reload_version(name, version)
        except Exception as error:  # noqa: BLE001 - logged; the version stays NOT_SERVING, the next failure retries
            log.error("reload of a broken model version failed", extra={"fields": {
                "model": name, "version": version, "error": f"{type(error).__name__}: {error}"}})

    async def drained(self) -> None:
        """Wait until the versions removed or replaced so far are closed."""
        while self._drains:
            await asyncio.gather(*list(self._drains), return_exceptions=True)

    # ---- registry changes (event loop only, under the lock) --------------------------------------------

    def _find(self, name: str, version: str) -> ModelVersion | None:
        return next((mv for mv in self._models.get(name, []) if mv.version == version), None)

    def _register(self, mv: ModelVersion) -> None:
        versions = sorted([*self._models.get(mv.name, []), mv], key=lambda v: version_key(v.version))
        self._set_versions(mv.name, versions)
        if not self._default_model:
            self._default_model = mv.name
        if self._started:
            mv.scheduler.start()
        self._publish(mv)

    def _swap(self, old: ModelVersion, new: ModelVersion) -> None:
        """``new`` takes ``old``'s place (same name and version); ``old`` drains in the background."""
        self._set_versions(new.name, [new if mv is old else mv for mv in self._models[old.name]])
        if self._started:
            new.scheduler.start()
        m = self.settings.metrics
        if m is not None and _info_labels(old) != _info_labels(new):
            m.retire_info(*_info_labels(old))
        self._publish(new)
        self._drain(old, unpublish=False)

    def _unregister(self, mv: ModelVersion) -> None:
        remaining = [v for v in self._models[mv.name] if v is not mv]
        if remaining:
            self._set_versions(mv.name, remaining)
        else:
            del self._models[mv.name]
            if mv.name == self._default_model and not self._default_configured:
                self._default_model = self.names[0] if self._models else ""
        self._drain(mv, unpublish=True)

    def _set_versions(self, name: str, versions: list[ModelVersion]) -> None:
        for v in versions:
            v.is_latest = v is versions[-1]
        self._models[name] = versions  # one assignment: a lookup sees the old list or the new one

    def _drain(self, mv: ModelVersion, *, unpublish: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._close_version(mv, unpublish=unpublish))
        self._drains[task] = mv
        task.add_done_callback(lambda done: self._drains.pop(done, None))

    async def _close_version(self, mv: ModelVersion, *, unpublish: bool) -> None:
        started = time.monotonic()
        try:
            if not await mv.wait_unused(self.grace_seconds):
                log.warning("grace period over with requests on a removed model version; closing it",
                            extra={"fields": {"model": mv.name, "version": mv.version, "users": mv.users}})
            await mv.scheduler.close(timeout=max(0.0, self.grace_seconds - (time.monotonic() - started)))
        finally:
            if unpublish:
                self._unpublish(mv)
            log.info("model version closed", extra={"fields": {
                "model": mv.name, "version": mv.version, "drain_seconds": round(time.monotonic() - started, 3)}})

    def _refuse(self, refusal: VersionRefused, fingerprint: Fingerprint) -> None:
        self._refused[(refusal.name, refusal.version)] = fingerprint
        self._count_load(refusal.name, "refused")
        log.warning("model version refused", extra={"fields": {
            "model": refusal.name, "version": refusal.version, "path": str(refusal.path), "reason": refusal.reason}})

    async def _notify(self) -> None:
        for listener in self._listeners:
            await listener()

    # ---- metric series ---------------------------------------------------------------------------------

    def _count_load(self, name: str, result: str) -> None:
        m = self.settings.metrics
        if m is not None:
            for outcome in LOAD_RESULTS:
                m.model_loads.labels(name, outcome)  # both series exist from the model's first load
            m.model_loads.labels(name, result).inc()

    def _publish(self, mv: ModelVersion) -> None:
        """``nmt_model_info`` and the version's zero-valued series (so ``rate()`` works from its first use)."""
        m = self.settings.metrics
        if m is None:
            return
        m.model_info.labels(*_info_labels(mv)).set(1)
        m.init_model(mv.name, mv.version)
        m.queue_capacity.labels(mv.name, mv.version).set(mv.scheduler.policy.queue_size)

    def _unpublish(self, mv: ModelVersion) -> None:
        """Remove every series of a removed version (unless a new copy of it was registered meanwhile)."""
        m = self.settings.metrics
        if m is None or self._find(mv.name, mv.version) is not None:
            return
        m.retire_info(*_info_labels(mv))
        m.remove_model(mv.name, mv.version)


LOAD_RESULTS = ("loaded", "refused")


def _info_labels(mv: ModelVersion) -> tuple[str, str, str, str]:
    return (mv.name, mv.version, str(mv.manifest_value("architecture")), str(getattr(mv.engine, "provider", "")))


def directory_fingerprint(path: Path) -> Fingerprint:
    """Size, mtime and inode of every file in a version directory: a changed file changes it."""
    entries = []
    try:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                entries.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    except OSError:
        return ()
    return tuple(entries)


def _discover_with_fingerprints(root: Path) -> dict[tuple[str, str], tuple[Path, Fingerprint]]:
    return {(name, version): (path, directory_fingerprint(path))
            for name, versions in discover_versions(root).items() for version, path in versions}
