"""Looking up served model versions by name and version: what the model repository (which loads them,
:mod:`server.core.repository`) and a front-end's view of the engine core's repository (:mod:`server.frontend.remote`)
share. No engine here: front-ends import this and never ONNX Runtime."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from server.errors import NotFound


class ManifestFields:
    """Properties of a served version read from its ``manifest``."""

    manifest: Any

    def manifest_value(self, attribute: str, default: Any = "") -> Any:
        value = getattr(self.manifest, attribute, None)
        return default if value is None else value

    @property
    def max_positions(self) -> int:
        """Target positions of the model's position table (0: none, as in an RNN)."""
        return int((self.manifest_value("dimensions", {}) or {}).get("max_positions") or 0)

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.manifest_value("defaults", {}) or {})

    @property
    def training(self) -> dict[str, Any]:
        return dict(self.manifest_value("training", {}) or {})


class Held:
    """A version that requests hold while they use it (:meth:`VersionIndex.acquire`)."""

    users: int
    _unused: asyncio.Event

    def hold(self) -> None:
        """One more request uses this version (until its :meth:`release`)."""
        self.users += 1
        self._unused.clear()

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self._unused.set()

    async def wait_unused(self, timeout: float | None) -> bool:
        """Wait until no request holds this version (at most ``timeout`` seconds); whether it is unused."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._unused.wait(), timeout)
        return self.users == 0


V = TypeVar("V", bound=Held)


class VersionIndex(Generic[V]):
    """Served versions by model name, newest last; the default model; lookups with defaults."""

    def __init__(self, default_model: str = "") -> None:
        self._default_model = default_model
        self._models: dict[str, list[V]] = {}

    def __iter__(self) -> Iterator[V]:
        for name in sorted(self._models):
            yield from list(self._models.get(name, ()))  # a name may go while the caller awaits

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    @property
    def default_model(self) -> str:
        """The configured default model, else the first name at start-up: a model added later does not take
        over the requests that name none; if this one is removed, the first name left becomes the default."""
        return self._default_model

    @property
    def available(self) -> bool:
        """Whether whatever decodes is there: always in one process; a front-end's core may be away."""
        return True

    def serving(self, name: str) -> bool:
        """Whether requests for ``name`` that name no version can be served: its newest version is healthy."""
        versions = self._models.get(name)
        return bool(versions) and versions[-1].healthy

    def resolve(self, name: str = "", version: str = "") -> V:
        """The requested version (default: newest) of the requested model (default: the default model)."""
        name = name or self.default_model
        versions = self._models.get(name)
        if not versions:
            raise NotFound(f"unknown model {name!r}; available: {', '.join(self.names)}")
        if not version:
            return versions[-1]
        for mv in versions:
            if mv.version == version:
                return mv
        raise NotFound(f"model {name!r} has no version {version!r}; available: "
                       f"{', '.join(mv.version for mv in versions)}")

    @contextlib.contextmanager
    def acquire(self, name: str = "", version: str = "") -> Iterator[V]:
        """:meth:`resolve`, holding the version until the block ends: a removed or replaced version is
        closed only after its holders are done (or its grace period is over)."""
        mv = self.resolve(name, version)
        mv.hold()
        try:
            yield mv
        finally:
            mv.release()
