"""The engine core and its front-ends talk over ZeroMQ: token ids in, search results out.

``nmt serve --frontends N`` (:mod:`server.supervisor`) runs the model repository, the schedulers and the
engines in one *engine core* process and everything else a request needs in N *front-end* processes
(gRPC, HTTP, TLS, tokens, validation, tokenizing, detokenizing, alignments, responses, logs). Between
them, one ``ipc://`` socket in a directory only the server's user can enter:

* front-end -> core (a DEALER per front-end, the core's ROUTER):
  ``("hello",)`` asks for the catalog; ``("submit", call, name, version, request_id, deadline, sentences,
  work)`` decodes one request's sentences (token ids, options, target prefixes; ``deadline`` on the
  host's monotonic clock, which every process shares); ``("cancel", call)`` withdraws a call whose
  client went away (its queued sentences leave the queue, its running ones the decode at the next step).
* core -> front-end: ``("catalog", Catalog)`` after a hello and after every change of the repository
  (hot reload, a version failing or recovering); ``("done", call, results)`` with the calls' search
  results; ``("failed", call, error)`` with a :class:`server.errors.ServingError`.

Messages are pickled (protocol 5): both ends are this program's own processes, on a socket in a 0700
directory, so nothing else can write to it; pickle carries the dataclasses and NumPy arrays of a search
result without a second schema to keep in step.

A front-end watches its connection (a ZeroMQ socket monitor): when the core goes away every call in
flight fails at once with UNAVAILABLE, new calls are refused with UNAVAILABLE, readiness turns false;
when a core (restarted by the supervisor) connects again the front-end asks for the catalog and serves
again. The core cancels the calls of a front-end whose process is gone (checked every
``ORPHAN_CHECK_SECONDS``), so a killed front-end's calls stop taking rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from server.admission import RequestHandle
from server.errors import Internal, ServingError, Unavailable
from server.search import SearchResult
from server.types import SentenceRequest

log = logging.getLogger("nmt.server")

ORPHAN_CHECK_SECONDS = 0.5
CORE_DOWN = "the engine core is not running (it is being restarted); retry shortly"


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=5)


def loads(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 - our own processes, on a socket in a 0700 directory


@dataclass(frozen=True)
class VersionInfo:
    """What a front-end needs to know of one loaded version (its codec it loads from ``path`` itself)."""

    name: str
    version: str
    path: str
    fingerprint: tuple = ()  # of the directory's files when the core loaded it: a changed one is loaded anew
    is_latest: bool = False
    healthy: bool = True
    provider: str = ""
    device: str = ""
    runtime_build: str = ""
    has_logits: bool = True


@dataclass(frozen=True)
class Catalog:
    """The core's model repository as front-ends see it."""

    versions: tuple[VersionInfo, ...] = ()
    default_model: str = ""
    serving: dict[str, bool] = field(default_factory=dict)  # model name -> its newest version works


def catalog_of(repository: Any) -> Catalog:
    """The catalog of a :class:`server.repository.ModelRepository`."""
    versions = tuple(VersionInfo(mv.name, mv.version, str(mv.path), tuple(mv.fingerprint), mv.is_latest, mv.healthy,
                                 mv.provider, mv.device, mv.runtime_build, mv.has_logits) for mv in repository)
    return Catalog(versions, repository.default_model, {name: repository.serving(name) for name in repository.names})


def _wire_sentence(sentence: SentenceRequest) -> SentenceRequest:
    """What the core needs of a sentence: token ids, options and target prefix (no text, no callback)."""
    return replace(sentence, is_cancelled=None, text="")


# ---- the engine core's end ------------------------------------------------------------------------------


class CoreEndpoint:
    """The core's ROUTER socket: serves submits and cancels against ``repository``, publishes its catalog."""

    def __init__(self, repository: Any, address: str) -> None:
        self.repository = repository
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.peers: dict[bytes, int] = {}  # front-end identity -> its pid
        self.calls: dict[tuple[bytes, int], tuple[asyncio.Task, RequestHandle]] = {}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive(), name="core-receive"),
                       loop.create_task(self._reap_orphans(), name="core-orphans")]
        self.repository.add_listener(self.publish)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task, handle in list(self.calls.values()):
            handle.cancel()
            task.cancel()
        self.socket.close(0)
        self.context.term()

    async def publish(self) -> None:
        """Send the catalog to every front-end that said hello (after each repository change)."""
        data = dumps(("catalog", catalog_of(self.repository)))
        for peer in list(self.peers):
            await self._send(peer, data)

    async def _send(self, peer: bytes, data: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the front-end is gone: its calls are reaped
            await self.socket.send_multipart([peer, data])

    async def _receive(self) -> None:
        while True:
            peer, data = await self.socket.recv_multipart()
            try:
                message = loads(data)
            except Exception:  # noqa: BLE001 - nothing but our front-ends can reach the socket
                log.exception("undecodable message from a front-end")
                continue
            kind = message[0]
            if kind == "hello":
                self.peers[peer] = int(message[1])
                await self._send(peer, dumps(("catalog", catalog_of(self.repository))))
            elif kind == "submit":
                _, call, name, version, request_id, deadline, sentences, work = message
                handle = RequestHandle(deadline, request_id)
                task = asyncio.get_running_loop().create_task(
                    self._submit(peer, handle, call, name, version, sentences, work))
                self.calls[(peer, call)] = (task, handle)
            elif kind == "cancel":
                self._cancel((peer, message[1]))

    async def _submit(self, peer: bytes, handle: RequestHandle, call: int, name: str, version: str,
                      sentences: Sequence[SentenceRequest], work: Sequence[int]) -> None:
        try:
            with self.repository.acquire(name, version) as model:
                results = await model.submit(sentences, work, handle)
            reply = ("done", call, results)
        except asyncio.CancelledError:
            return  # the front-end withdrew the call: nobody waits for an answer
        except ServingError as error:
            reply = ("failed", call, error)
        except Exception as error:  # noqa: BLE001 - one call's failure must not end the core
            log.exception("engine core call failed", extra={"fields": {"request_id": handle.request_id}})
            reply = ("failed", call, Internal(f"engine core error ({type(error).__name__})"))
        finally:
            self.calls.pop((peer, call), None)
        await self._send(peer, dumps(reply))

    def _cancel(self, key: tuple[bytes, int]) -> None:
        entry = self.calls.pop(key, None)
        if entry is not None:
            task, handle = entry
            handle.cancel()
            task.cancel()

    async def _reap_orphans(self) -> None:
        """Cancel the calls of front-ends whose process is gone (killed: it could not withdraw them)."""
        while True:
            await asyncio.sleep(ORPHAN_CHECK_SECONDS)
            for peer, pid in list(self.peers.items()):
                if not _alive(pid):
                    del self.peers[peer]
                    orphans = [key for key in self.calls if key[0] == peer]
                    for key in orphans:
                        self._cancel(key)
                    log.warning("front-end gone; its calls cancelled", extra={"fields": {
                        "pid": pid, "calls": len(orphans)}})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- a front-end's end ----------------------------------------------------------------------------------


class CoreClient:
    """A front-end's connection to the engine core: submits calls, keeps the latest catalog, knows whether
    the core is there (``up``) and calls ``on_catalog`` when the catalog (or the core's presence) changes."""

    def __init__(self, address: str, on_catalog: Callable[[Catalog | None], Awaitable[None]]) -> None:
        self.address = address
        self.on_catalog = on_catalog  # None: the core went away
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 50)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self.up = False
        self.catalog: Catalog | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._first_catalog = asyncio.Event()

    async def start(self, timeout: float) -> None:
        """Start listening and wait (at most ``timeout`` seconds) for the core's first catalog."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive(), name="core-client-receive"),
                       loop.create_task(self._watch(), name="core-client-watch")]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_catalog.wait(), timeout)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(Unavailable("server is shutting down"))
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)
        self.context.term()

    async def submit(self, name: str, version: str, sentences: Sequence[SentenceRequest], work: Sequence[int],
                     request: RequestHandle) -> list[SearchResult]:
        """Decode a request's sentences in the core (the contract of :meth:`ModelScheduler.submit`)."""
        if not self.up:
            raise Unavailable(CORE_DOWN)
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        message = ("submit", call, name, version, request.request_id, request.deadline,
                   [_wire_sentence(s) for s in sentences], list(work))
        try:
            await self.socket.send(dumps(message))
            return await future
        except asyncio.CancelledError:
            request.cancel()
            if self.up:
                with contextlib.suppress(zmq.ZMQError):
                    await self.socket.send(dumps(("cancel", call)))
            raise
        finally:
            self._calls.pop(call, None)

    async def _receive(self) -> None:
        while True:
            message = loads(await self.socket.recv())
            kind = message[0]
            if kind == "catalog":
                self.catalog = message[1]
                self.up = True
                await self.on_catalog(self.catalog)
                self._first_catalog.set()
            elif kind in ("done", "failed"):
                future = self._calls.get(message[1])
                if future is None or future.done():
                    continue
                if kind == "done":
                    future.set_result(message[2])
                else:
                    future.set_exception(message[2])

    async def _watch(self) -> None:
        """Hello on every (re)connection; on a disconnection fail every call in flight and go down."""
        while True:
            event = await recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                await self.socket.send(dumps(("hello", os.getpid())))
            elif event["event"] == zmq.EVENT_DISCONNECTED and self.up:
                self.up = False
                log.error("engine core gone; answering UNAVAILABLE until it is back")
                self._fail_all(Unavailable(CORE_DOWN))
                await self.on_catalog(None)

    def _fail_all(self, error: ServingError) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
