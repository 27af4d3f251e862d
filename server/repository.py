"""The model repository: every ``<root>/<name>/<version>/manifest.json`` loaded as an engine with its scheduler.

Like Triton's layout: the directory names are the model name and version (the manifest's own
``name``/``version`` are informational). Versions sort numerically when they are integers (``2`` <
``10``), other versions sort after them by name; the last one is the newest and serves requests that
name no version. The default model is the configured one, else the first name in sorted order.

The repository is the one registry of the served models: each :class:`ModelVersion` owns its engine
and the :class:`server.scheduler.ModelScheduler` that is the one way into it; the repository starts
and closes the schedulers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt.errors import NmtError
from nmt.model_format.layout import discover_versions
from server.errors import NotFound
from server.metrics import ServerMetrics
from server.scheduler import BatchPolicy, ModelScheduler

log = logging.getLogger("nmt.server")

# (version_dir, provider, intra_op_threads, inter_op_threads, spinning) -> an Engine
EngineLoader = Callable[..., Any]


def default_engine_loader(
    version_dir: Path, *, provider: str, intra_op_threads: int, inter_op_threads: int, spinning: bool = False
) -> Any:
    from server.engine import Engine  # onnxruntime is imported only when models are loaded

    return Engine.load(version_dir, provider=provider, intra_op_threads=intra_op_threads,
                       inter_op_threads=inter_op_threads, spinning=spinning)


@dataclass
class ModelVersion:
    """One loaded version of a model: its engine and the scheduler that batches requests into it."""

    name: str
    version: str
    path: Path
    engine: Any  # server.engine.Engine (or anything with the same API)
    scheduler: ModelScheduler
    is_latest: bool = False

    @property
    def manifest(self) -> Any:
        return self.engine.manifest

    def manifest_value(self, attribute: str, default: Any = "") -> Any:
        value = getattr(self.manifest, attribute, None)
        return default if value is None else value

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.manifest_value("defaults", {}) or {})

    @property
    def training(self) -> dict[str, Any]:
        return dict(self.manifest_value("training", {}) or {})


class ModelRepository:
    """Loaded model versions, looked up by (name, version) with defaults."""

    def __init__(self, models: dict[str, list[ModelVersion]], default_model: str = "") -> None:
        if not models:
            raise NmtError("the model repository holds no model (expected <repo>/<name>/<version>/manifest.json)")
        if default_model and default_model not in models:
            raise NmtError(f"default model {default_model!r} is not in the repository (models: {sorted(models)})")
        self._models = models
        self.default_model = default_model or sorted(models)[0]
        for versions in models.values():
            for mv in versions:
                mv.is_latest = mv is versions[-1]

    @classmethod
    def load(
        cls,
        root: str | Path,
        *,
        default_model: str = "",
        provider: str = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        spinning: bool = False,
        engine_loader: EngineLoader | None = None,
        policy: BatchPolicy | None = None,
        metrics: ServerMetrics | None = None,
    ) -> ModelRepository:
        """Load every version found under ``root``, each with a scheduler of ``policy`` reporting to
        ``metrics`` (slow: call it off the event loop)."""
        loader = engine_loader or default_engine_loader
        models: dict[str, list[ModelVersion]] = {}
        for name, versions in discover_versions(root).items():
            for version, path in versions:
                try:
                    engine = loader(path, provider=provider, intra_op_threads=intra_op_threads,
                                    inter_op_threads=inter_op_threads, spinning=spinning)
                except Exception as error:
                    raise NmtError(f"cannot load model {name} version {version} from {path}: {error}") from error
                log.info("model loaded", extra={"fields": {
                    "model": name, "version": version, "provider": getattr(engine, "provider", "")}})
                scheduler = ModelScheduler(engine, policy=policy, metrics=metrics, model=name, version=version)
                models.setdefault(name, []).append(ModelVersion(name, version, path, engine, scheduler))
        return cls(models, default_model)

    def start(self) -> None:
        """Start every version's scheduler (on the running event loop)."""
        for mv in self:
            mv.scheduler.start()

    async def close(self, timeout: float | None = None) -> None:
        """Close every version's scheduler: queued and running sentences get ``timeout`` seconds to finish."""
        await asyncio.gather(*(mv.scheduler.close(timeout=timeout) for mv in self))

    def __iter__(self) -> Iterator[ModelVersion]:
        for name in sorted(self._models):
            yield from self._models[name]

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    def resolve(self, name: str = "", version: str = "") -> ModelVersion:
        """The requested version (default: newest) of the requested model (default: the default model)."""
        name = name or self.default_model
        versions = self._models.get(name)
        if versions is None:
            raise NotFound(f"unknown model {name!r}; available: {', '.join(self.names)}")
        if not version:
            return versions[-1]
        for mv in versions:
            if mv.version == version:
                return mv
        raise NotFound(f"model {name!r} has no version {version!r}; available: "
                       f"{', '.join(mv.version for mv in versions)}")
