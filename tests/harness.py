"""``ServerHarness``: the real server in-process, for synchronous tests (server and client tests share it).

A :class:`TranslationServer` runs on its own event loop in a background thread, bound to 127.0.0.1
port 0, with a fresh metrics registry; the tests talk to it through a blocking gRPC channel.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import CollectorRegistry

from server.config import ServerConfig
from server.core.process import open_repository
from server.core.repository import ModelVersion
from server.core.scheduler import ModelScheduler
from server.frontend.app import TranslationServer
from server.protos import pb2_grpc


def count_calls(monkeypatch: Any, methods: dict[str, tuple[type, str]]) -> dict[str, int]:
    """Count the calls of each method ``(class, name)`` under its key, patched for the test's duration."""
    counts = dict.fromkeys(methods, 0)

    def counting(key: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return method(*args, **kwargs)
        return wrapper

    for key, (owner, name) in methods.items():
        monkeypatch.setattr(owner, name, counting(key, getattr(owner, name)))
    return counts


def live_ortvalues() -> int:
    """The ``OrtValue`` s alive in this process, after a garbage collection (a decode's buffers freed or not)."""
    import onnxruntime as ort

    gc.collect()
    return sum(type(o) is ort.OrtValue for o in gc.get_objects())


def refuse_fixed_ports(config: ServerConfig) -> None:
    """A test server takes free ports (port 0) or none: a fixed one (a default such as 8080 included)
    collides with a server a developer runs beside the suite, and with parallel test runs."""
    for name in ("listen", "metrics_listen", "http_listen"):
        address = getattr(config, name)
        if address and not address.endswith(":0"):
            raise ValueError(f"a test server's {name} is {address!r}: give it port 0 (a free port) or '' (off)")


class ServerHarness:
    """A :class:`TranslationServer` on a background event loop, with blocking client stubs."""

    def __init__(self, config: ServerConfig, engine_loader: Callable[..., Any] | None = None) -> None:
        refuse_fixed_ports(config)
        self.registry = CollectorRegistry()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()

        async def make() -> TranslationServer:
            return TranslationServer(config, registry=self.registry,
                                     opener=partial(open_repository, engine_loader=engine_loader))

        self.server = self.run(make())
        self.port = self.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb2_grpc.TranslatorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def run(self, coroutine: Any, timeout: float = 60) -> Any:
        """Run ``coroutine`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start_shutdown(self, grace: float) -> Any:
        """What SIGTERM does; returns a concurrent future that completes when the server has stopped."""
        return asyncio.run_coroutine_threadsafe(self.server.shutdown(grace), self.loop)

    def model_version(self, model: str = "", version: str = "") -> ModelVersion:
        """A served model version (default: the newest version of the default model)."""
        return self.server.repository.resolve(model, version)

    def scheduler(self, model: str = "", version: str = "") -> ModelScheduler:
        return self.model_version(model, version).scheduler

    def engine(self, model: str = "", version: str = "") -> Any:
        return self.model_version(model, version).engine

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's value in the server's registry (0 when absent)."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def close(self) -> None:
        """Close the channel, stop the server at once and the loop with it."""
        self.channel.close()
        try:
            self.run(self.server.shutdown(grace=0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
