"""The engine core: the model repository, its schedulers and engines, in a process of its own.

In one process (``nmt serve``, the default) :class:`server.frontend.app.TranslationServer` opens the repository
with :func:`open_repository` beside its gRPC and HTTP faces. With ``--frontends N`` the supervisor
(:mod:`server.supervisor`) starts this module as the one process that owns the device: it opens the
repository the same way, answers the front-ends over :mod:`server.ipc`, scans the repository every
``reload_interval`` seconds and on SIGHUP, and on SIGTERM closes the schedulers (the supervisor sends
it only once every front-end has drained).

Run by the supervisor as ``python -m server.core.process`` with ``NMT_WORKER_CONFIG`` (the server configuration
as JSON), ``NMT_CORE_ADDRESS`` (the socket to bind) and ``NMT_READY_FILE`` (written once it serves).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from server import collector
from server.config import ServerConfig
from server.core.repository import EngineLoader, LoadSettings, ModelRepository
from server.ipc import CoreEndpoint
from server.logs import configure_logging
from server.metrics import ServerMetrics
from server.policy import BatchPolicy
from server.supervisor import announce_ready

log = logging.getLogger("nmt.server")


async def open_repository(config: ServerConfig, metrics: ServerMetrics,
                          engine_loader: EngineLoader | None = None) -> ModelRepository:
    """The model repository of ``config`` after its first scan: every version loaded, verified and
    smoke-tested with its scheduler (not started). Without an ``engine_loader`` (tests pass one) the
    runtime is logged, the allocator tuned and the provider probed first; ``config.engine == "null"``
    loads :class:`server.core.null_engine.NullEngine` s instead (no model, no device)."""
    if engine_loader is None and config.engine == "null":
        from server.core.null_engine import NullEngine

        engine_loader = NullEngine.load
    elif engine_loader is None:
        from server.core.allocator import retain_freed_memory
        from server.engine.device import DeviceSettings, log_runtime, probe_provider  # imports onnxruntime

        log_runtime()
        if retain_freed_memory(config.malloc_retain_mb << 20):
            log.info("malloc keeps up to %d MiB of freed memory for the next batch", config.malloc_retain_mb)
        probe_provider(DeviceSettings(config.provider, config.device_id, config.gpu_mem_limit, config.cuda_tf32))
    settings = LoadSettings(provider=config.provider, intra_op_threads=config.intra_op_threads,
                            inter_op_threads=config.inter_op_threads, spinning=config.ort_spinning,
                            prepack=config.ort_prepack,
                            device={"device_id": config.device_id, "gpu_mem_limit": config.gpu_mem_limit,
                                    "cuda_tf32": config.cuda_tf32, "device_search": config.cuda_graphs,
                                    "cuda_graphs": config.cuda_graphs, "graph_pool_mib": config.cuda_graph_pool_mib},
                            engine_loader=engine_loader, policy=BatchPolicy.from_config(config), metrics=metrics)
    return await ModelRepository.open(config.model_repository, settings=settings, default_model=config.default_model,
                                      grace_seconds=config.grace_seconds)


async def run_core(config: ServerConfig, address: str, ready_file: Path) -> None:
    """Serve the front-ends on ``address`` until SIGTERM or SIGINT."""
    metrics = ServerMetrics()
    repository = await open_repository(config, metrics)
    repository.start()
    endpoint = CoreEndpoint(repository, address)
    await endpoint.start()
    pauses = collector.watch(repository, metrics.gc_pause)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, repository.scan_soon)
    repository.watch(config.reload_interval)
    announce_ready(ready_file, {"models": repository.names, "default_model": repository.default_model})
    log.info("engine core serving", extra={"fields": {
        "address": address, "models": [f"{mv.name}/{mv.version}" for mv in repository]}})
    await stop.wait()
    log.info("engine core stopping")
    await repository.close(timeout=config.grace_seconds)  # the scans stop first
    await endpoint.close()
    pauses.cancel()
    log.info("engine core stopped")


def main() -> int:
    config = ServerConfig.from_json(os.environ["NMT_WORKER_CONFIG"])
    configure_logging(config.log_level)
    try:
        asyncio.run(run_core(config, os.environ["NMT_CORE_ADDRESS"], Path(os.environ["NMT_READY_FILE"])))
    except Exception as error:  # noqa: BLE001 - the supervisor reads the exit status and the log
        log.error("engine core failed", extra={"fields": {"error": f"{type(error).__name__}: {error}"}})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
