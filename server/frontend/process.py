"""A front-end process of ``nmt serve --frontends N``: the gRPC and HTTP faces over the engine core.

Everything per request that is not decoding happens here (TLS and tokens, validation, tokenizing,
detokenizing, word alignments, responses, logs, request metrics); the decoding goes to the engine core
(:mod:`server.core.process`) through :mod:`server.ipc`. The N front-ends share the listening ports
(SO_REUSEPORT: the kernel spreads connections over them). This process never imports ONNX Runtime.
On SIGTERM it drains like the one-process server (:meth:`server.frontend.app.TranslationServer.shutdown`).

Run by the supervisor as ``python -m server.frontend.process`` with ``NMT_WORKER_CONFIG`` (the configuration as
JSON, ports resolved, no metrics port: the supervisor serves ``/metrics``), ``NMT_CORE_ADDRESS`` and
``NMT_READY_FILE`` (written once the ports are bound).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from nmt.errors import NmtError
from server import collector
from server.config import ServerConfig
from server.frontend.app import TranslationServer
from server.frontend.remote import RemoteRepository
from server.logs import configure_logging
from server.supervisor import announce_ready

log = logging.getLogger("nmt.server")
CATALOG_TIMEOUT_SECONDS = 30.0  # how long a new front-end waits for the core's catalog


async def run_frontend(config: ServerConfig, address: str, ready_file: Path) -> None:
    """Serve until SIGTERM or SIGINT, then drain and stop."""
    server = TranslationServer(config, reuse_port=True)
    server.repository = await RemoteRepository(address, metrics=server.metrics).open(CATALOG_TIMEOUT_SECONDS)
    server.install_signal_handlers()
    await server.start()
    pauses = collector.watch(server.repository, server.metrics.gc_pause, frozen=config.gc_freeze)
    announce_ready(ready_file, {"pid": os.getpid(), "port": server.port, "http_port": server.http_port})
    await server.wait_for_termination()
    pauses.cancel()


def main() -> int:
    config = ServerConfig.from_json(os.environ["NMT_WORKER_CONFIG"])
    configure_logging(config.log_level)
    try:
        asyncio.run(run_frontend(config, os.environ["NMT_CORE_ADDRESS"], Path(os.environ["NMT_READY_FILE"])))
    except NmtError as error:
        log.error("front-end failed", extra={"fields": {"error": str(error)}})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
