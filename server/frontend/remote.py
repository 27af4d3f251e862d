"""A front-end's view of the engine core's model repository (``nmt serve --frontends N``, :mod:`server.ipc`).

The core loads, verifies, smoke-tests, hot-reloads and decodes; a front-end keeps the catalog the core
publishes and, for each version in it, the text side it needs to answer requests
(:class:`server.text.TextCodec`, loaded from the version's directory). A :class:`RemoteVersion` offers
the servicer what a loaded :class:`server.core.repository.ModelVersion` does, with ``submit`` going to the
core; while the core is away every model reads as not serving (health NOT_SERVING, ``/readyz`` 503) and
calls get UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.errors import NmtError
from server.ipc import Catalog, CoreClient, VersionInfo
from server.policy import RequestHandle
from server.text import TextCodec
from server.types import SearchResult, SentenceRequest
from server.versions import Held, ManifestFields, VersionIndex

log = logging.getLogger("nmt.server")


@dataclass(eq=False)
class RemoteVersion(ManifestFields, Held):
    """One version the core serves, as a front-end holds it."""

    info: VersionInfo
    codec: TextCodec
    client: CoreClient
    users: int = 0
    _unused: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self._unused.set()

    name = property(lambda self: self.info.name)
    version = property(lambda self: self.info.version)
    is_latest = property(lambda self: self.info.is_latest)
    healthy = property(lambda self: self.info.healthy and self.client.up)
    provider = property(lambda self: self.info.provider)
    device = property(lambda self: self.info.device)
    runtime_build = property(lambda self: self.info.runtime_build)

    @property
    def manifest(self) -> Any:
        return self.codec.manifest

    async def submit(self, sentences: Sequence[SentenceRequest], work: Sequence[int],
                     request: RequestHandle) -> list[SearchResult]:
        """Decode in the core (:meth:`server.ipc.CoreClient.submit`)."""
        return await self.client.submit(self.name, self.version, sentences, work, request)


class RemoteRepository(VersionIndex[RemoteVersion]):
    """The core's catalog with each version's codec; ``listeners`` run after every change (health)."""

    def __init__(self, address: str, *, metrics: Any = None) -> None:
        super().__init__()
        self.metrics = metrics
        self.client = CoreClient(address, self._on_catalog)
        self._serving: dict[str, bool] = {}
        self._listeners: list[Callable[[], Awaitable[None]]] = []

    async def open(self, timeout: float) -> RemoteRepository:
        """Connect and wait for the core's first catalog (at most ``timeout`` seconds); raises when none came."""
        await self.client.start(timeout)
        if self.client.catalog is None:
            raise NmtError(f"no engine core answered on {self.client.address} within {timeout:.0f} s")
        return self

    def add_listener(self, listener: Callable[[], Awaitable[None]]) -> None:
        self._listeners.append(listener)

    def start(self) -> None:
        """Nothing to start here: the core runs the schedulers."""

    async def close(self, timeout: float | None = None) -> None:
        await self.client.close()

    def watch(self, interval: float) -> None:
        """Nothing to watch here: the core scans the model repository."""

    def scan_soon(self) -> None:
        log.warning("the engine core scans the model repository: send SIGHUP to the nmt serve process")

    async def stop_scans(self) -> None:
        """No scans here (the core's)."""

    async def scan(self) -> Any:
        raise NmtError("the engine core scans the model repository: send SIGHUP to the nmt serve process")

    async def reload_version(self, name: str, version: str) -> Any:
        raise NmtError("the engine core reloads model versions: send SIGHUP to the nmt serve process")

    @property
    def available(self) -> bool:
        return self.client.up

    def serving(self, name: str) -> bool:
        return self.client.up and self._serving.get(name, False)

    async def _on_catalog(self, catalog: Catalog | None) -> None:
        """Take the core's new catalog (None: the core went away), load the codecs of new versions."""
        if catalog is not None:
            held = {(mv.name, mv.version, mv.info.fingerprint): mv.codec for mv in self}
            models: dict[str, list[RemoteVersion]] = {}
            for info in catalog.versions:
                codec = held.get((info.name, info.version, info.fingerprint))
                if codec is None:
                    codec = await asyncio.to_thread(TextCodec.load, info.path, verify=False)  # the core verified
                models.setdefault(info.name, []).append(RemoteVersion(info, codec, self.client))
            for name in set(models) - set(self._models):
                if self.metrics is not None:
                    self.metrics.init_requests(name)
            self._models, self._default_model, self._serving = models, catalog.default_model, dict(catalog.serving)
        for listener in self._listeners:
            await listener()
