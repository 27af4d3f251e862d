"""A front-end process of ``nmt serve --frontends N``: the gRPC and HTTP faces over the engine core.

Everything per request that is not decoding happens here (TLS and tokens, validation, tokenizing,
detokenizing, word alignments, responses, logs, request metrics); the decoding goes to the engine core
(:mod:`server.core.process`) through :mod:`server.ipc`. The N front-ends share the listening ports
(SO_REUSEPORT: the kernel spreads connections over them). This process never imports ONNX Runtime.
On SIGTERM it drains like the one-process server (:meth:`server.frontend.app.TranslationServer.shutdown`).

Run by the supervisor as ``python -m server.frontend.process`` with ``NMT_WORKER_CONFIG`` (the configuration as
JSON, ports resolved, no metrics port: the supervisor serves ``/metrics``), ``NMT_CORE_ADDRESS`` and
``NMT_READY_FILE`` (written once the ports are bound). On SIGTERM, once its own calls are done, it writes
``NMT_DRAINED_FILE`` and keeps its health watches open until the supervisor writes ``NMT_ALL_DRAINED_FILE`` (every
front-end drained), so that a watch never ends while another front-end of the server still answers calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from common.errors import NmtError
from server import collector
from server.config import ServerConfig
from server.frontend.app import TranslationServer
from server.frontend.remote import RemoteRepository
from server.logs import configure_logging
from server.supervisor import announce_ready

log = logging.getLogger("nmt.server")
CATALOG_TIMEOUT_SECONDS = 30.0  # how long a new front-end waits for the core's catalog


PEERS_POLL_SECONDS = 0.02


def wait_for_peers(drained_file: Path, all_drained_file: Path) -> Callable[[float], Awaitable[None]]:
    """What a front-end does after its drain: say so, then wait for the supervisor's word that all are done."""
    async def wait(deadline: float) -> None:
        announce_ready(drained_file, {"pid": os.getpid()})
        while not all_drained_file.exists() and time.monotonic() < deadline:
            await asyncio.sleep(PEERS_POLL_SECONDS)
    return wait


async def run_frontend(config: ServerConfig, address: str, ready_file: Path,
                       after_drain: Callable[[float], Awaitable[None]] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain and stop."""
    server = TranslationServer(config, reuse_port=True)
    server.after_drain = after_drain
    server.repository = await RemoteRepository(address, metrics=server.metrics).open(CATALOG_TIMEOUT_SECONDS)
    server.install_signal_handlers()
    await server.start()
    pauses = collector.watch(server.repository, server.metrics.gc_pause)
    announce_ready(ready_file, {"pid": os.getpid(), "port": server.port, "http_port": server.http_port})
    await server.wait_for_termination()
    pauses.cancel()


def main() -> int:
    config = ServerConfig.from_json(os.environ["NMT_WORKER_CONFIG"])
    configure_logging(config.log_level)
    try:
        peers = wait_for_peers(Path(os.environ["NMT_DRAINED_FILE"]), Path(os.environ["NMT_ALL_DRAINED_FILE"]))
        asyncio.run(run_frontend(config, os.environ["NMT_CORE_ADDRESS"], Path(os.environ["NMT_READY_FILE"]), peers))
    except NmtError as error:
        log.error("front-end failed", extra={"fields": {"error": str(error)}})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
