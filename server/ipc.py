"""The engine core and its front-ends talk over ZeroMQ: token ids in, search results out.

``nmt serve --frontends N`` (:mod:`server.supervisor`) runs the model repository, the schedulers and the
engines in one *engine core* process and everything else a request needs in N *front-end* processes
(gRPC, HTTP, TLS, tokens, validation, tokenizing, detokenizing, alignments, responses, logs). Between
them, one ``ipc://`` socket in a directory only the server's user can enter:

* front-end -> core (a DEALER per front-end, the core's ROUTER): :class:`Hello` asks for the catalog;
  :class:`Submit` decodes one request's sentences (token ids, options, target prefixes; the deadline on
  the host's monotonic clock, which every process shares); :class:`Cancel` withdraws a call whose client
  went away (its queued sentences leave the queue, its running ones the decode at the next step).
* core -> front-end: :class:`Catalog` after a hello and after every change of the repository (hot
  reload, a version failing or recovering); :class:`Done` with a call's search results; :class:`Failed`
  with a :class:`server.errors.ServingError`'s kind and message.

Each message is two frames, its kind and its body in MessagePack, encoded and decoded by msgspec into the
very dataclasses both sides use (:class:`server.types.DecodingOptions`, :class:`server.types.SearchResult`,
...): typed decoding checks every field, nothing is unpickled (no code runs on receipt), and NumPy
arrays (attention) travel as raw bytes with their dtype and shape. Each socket is read from its file
descriptor on the event loop, every wake-up draining all waiting messages (:class:`Pump`): measured side
by side, that took the split's CPU per request from 0.95-1.27 ms to 0.83-0.87 against zmq.asyncio's
future per message (benchmarks/README.md).

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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from server.errors import Internal, ServingError, Unavailable
from server.policy import RequestHandle
from server.types import DecodingOptions, SearchResult, SentenceRequest, TargetPrefix

log = logging.getLogger("nmt.server")

ORPHAN_CHECK_SECONDS = 0.5
ARRAY_EXT = 1  # MessagePack extension type of a NumPy array
CORE_DOWN = "the engine core is not running (it is being restarted); retry shortly"


@dataclass(frozen=True)
class VersionInfo:
    """What a front-end needs to know of one loaded version (its codec it loads from ``path`` itself)."""

    name: str
    version: str
    path: str
    fingerprint: tuple[tuple[str, int, int, int], ...] = ()  # of its files when loaded: changed, loaded anew
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
    """The catalog of a :class:`server.core.repository.ModelRepository`."""
    versions = tuple(VersionInfo(mv.name, mv.version, str(mv.path), tuple(mv.fingerprint), mv.is_latest, mv.healthy,
                                 mv.provider, mv.device, mv.runtime_build, mv.has_logits) for mv in repository)
    return Catalog(versions, repository.default_model, {name: repository.serving(name) for name in repository.names})


@dataclass
class WireSentence:
    """What the core needs of a sentence: token ids, options and target prefix (no text, no callback)."""

    source_ids: list[int]
    options: DecodingOptions
    target_prefix: TargetPrefix

    def request(self, is_cancelled: Callable[[], bool] | None = None) -> SentenceRequest:
        return SentenceRequest(self.source_ids, self.options, is_cancelled, target_prefix=self.target_prefix)


@dataclass
class Hello:
    pid: int  # the front-end's process: the core cancels its calls once it is gone


@dataclass
class Submit:
    call: int
    name: str
    version: str
    request_id: str
    deadline: float | None  # time.monotonic() seconds, shared by every process of the host
    sentences: list[WireSentence]
    work: list[int]


@dataclass
class Cancel:
    call: int


@dataclass
class Done:
    call: int
    results: list[SearchResult]


@dataclass
class Failed:
    call: int
    kind: str  # the ServingError's class name
    message: str

    def error(self) -> ServingError:
        return _ERRORS.get(self.kind, Internal)(self.message)


def _subclasses(cls: type) -> list[type]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


_ERRORS = {cls.__name__: cls for cls in _subclasses(ServingError)}
MESSAGES: dict[bytes, type] = {cls.__name__.encode(): cls for cls in (Hello, Submit, Cancel, Catalog, Done, Failed)}


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        shape = ",".join(map(str, array.shape))
        return msgspec.msgpack.Ext(ARRAY_EXT, f"{array.dtype.str}|{shape}|".encode() + array.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot send {type(obj).__name__} to another process")


def _decode_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, msgspec.msgpack.Ext) and obj.code == ARRAY_EXT:
        dtype, shape, data = bytes(obj.data).split(b"|", 2)
        return np.frombuffer(data, dtype=np.dtype(dtype.decode())).reshape(
            tuple(int(n) for n in shape.split(b",") if n))
    raise NotImplementedError(f"cannot receive {kind.__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
_DECODERS = {kind: msgspec.msgpack.Decoder(cls, dec_hook=_decode_hook) for kind, cls in MESSAGES.items()}


def encode(message: Any) -> list[bytes]:
    """The two frames of ``message`` (one of :data:`MESSAGES`): its kind and its MessagePack body."""
    return [type(message).__name__.encode(), _ENCODER.encode(message)]


def decode(kind: bytes, body: bytes) -> Any:
    """The message of ``kind`` in ``body``; raises ``msgspec.ValidationError``/``DecodeError`` on anything else."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise msgspec.DecodeError(f"unknown message kind {kind!r}")
    return decoder.decode(body)


# ---- both ends ------------------------------------------------------------------------------------------


class Pump:
    """A ZeroMQ socket on the event loop without a future per message: its file descriptor signals (edge-
    triggered) that messages may be waiting, and every signal drains all of them into ``handle``. Sends
    never wait: the socket's queue is unbounded (what is in flight is bounded by the schedulers' queues)."""

    def __init__(self, socket: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
        self.socket = socket
        self.handle = handle
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(socket.FD, self.drain)
        self._loop.call_soon(self.drain)

    def drain(self) -> None:
        socket = self.socket
        while not socket.closed and socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = socket.recv_multipart(zmq.NOBLOCK)
            try:
                self.handle(frames)
            except Exception:  # noqa: BLE001 - one bad message must not stop the draining (nor the process)
                log.exception("cannot handle a message from the other end")

    def send(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames, zmq.NOBLOCK)
        self._loop.call_soon(self.drain)  # a send may leave input waiting that the edge-triggered FD won't repeat

    def close(self) -> None:
        self._loop.remove_reader(self.socket.FD)
        self.socket.close(0)


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)  # unbounded: a send never blocks nor drops a reply
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


# ---- the engine core's end ------------------------------------------------------------------------------


class CoreEndpoint:
    """The core's ROUTER socket: serves submits and cancels against ``repository``, publishes its catalog."""

    def __init__(self, repository: Any, address: str) -> None:
        self.repository = repository
        self.context = zmq.Context()
        self.socket = _socket(self.context, zmq.ROUTER)
        self.socket.bind(address)
        self.peers: dict[bytes, int] = {}  # front-end identity -> its pid
        self.calls: dict[tuple[bytes, int], tuple[asyncio.Task, RequestHandle]] = {}
        self._pump: Pump | None = None
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._pump = Pump(self.socket, self._receive)
        self._reaper = asyncio.get_running_loop().create_task(self._reap_orphans(), name="core-orphans")
        self.repository.add_listener(self.publish)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for task, handle in list(self.calls.values()):
            handle.cancel()
            task.cancel()
        if self._pump is not None:
            self._pump.close()
        self.context.term()

    async def publish(self) -> None:
        """Send the catalog to every front-end that said hello (after each repository change)."""
        frames = encode(catalog_of(self.repository))
        for peer in list(self.peers):
            self._send(peer, frames)

    def _send(self, peer: bytes, frames: list[bytes]) -> None:
        if self._pump is not None and not self.socket.closed:
            self._pump.send([peer, *frames])  # a ROUTER drops what is addressed to a peer that is gone

    def _receive(self, frames: list[bytes]) -> None:
        peer, *body = frames
        try:
            message = decode(*body)
        except (msgspec.MsgspecError, TypeError, ValueError):  # nothing but our front-ends reach the socket
            log.exception("undecodable message from a front-end")
            return
        if isinstance(message, Hello):
            self.peers[peer] = message.pid
            self._send(peer, encode(catalog_of(self.repository)))
        elif isinstance(message, Submit):
            handle = RequestHandle(message.deadline, message.request_id)
            task = asyncio.get_running_loop().create_task(self._submit(peer, handle, message))
            self.calls[(peer, message.call)] = (task, handle)
        elif isinstance(message, Cancel):
            self._cancel((peer, message.call))

    async def _submit(self, peer: bytes, handle: RequestHandle, submit: Submit) -> None:
        try:
            with self.repository.acquire(submit.name, submit.version) as model:
                sentences = [s.request() for s in submit.sentences]
                reply: Any = Done(submit.call, await model.submit(sentences, submit.work, handle))
        except asyncio.CancelledError:
            return  # the front-end withdrew the call: nobody waits for an answer
        except ServingError as error:
            reply = Failed(submit.call, type(error).__name__, str(error))
        except Exception as error:  # noqa: BLE001 - one call's failure must not end the core
            log.exception("engine core call failed", extra={"fields": {"request_id": handle.request_id}})
            reply = Failed(submit.call, "Internal", f"engine core error ({type(error).__name__})")
        finally:
            self.calls.pop((peer, submit.call), None)
        self._send(peer, encode(reply))

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
        self.context = zmq.Context()
        self.socket = _socket(self.context, zmq.DEALER)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 50)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self.up = False
        self.catalog: Catalog | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._pumps: list[Pump] = []
        self._catalogs: asyncio.Queue[Catalog | None] = asyncio.Queue()  # taken in order by one task
        self._catalog_task: asyncio.Task | None = None
        self._first_catalog = asyncio.Event()

    async def start(self, timeout: float) -> None:
        """Start listening and wait (at most ``timeout`` seconds) for the core's first catalog."""
        self._pumps = [Pump(self.socket, self._receive), Pump(self.monitor, self._watch)]
        self._catalog_task = asyncio.get_running_loop().create_task(self._take_catalogs(), name="core-catalogs")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_catalog.wait(), timeout)

    async def close(self) -> None:
        if self._catalog_task is not None:
            self._catalog_task.cancel()
            await asyncio.gather(self._catalog_task, return_exceptions=True)
        self._fail_all(Unavailable("server is shutting down"))
        self.socket.disable_monitor()
        for pump in reversed(self._pumps):
            pump.close()
        self.context.term()

    async def submit(self, name: str, version: str, sentences: Sequence[SentenceRequest], work: Sequence[int],
                     request: RequestHandle) -> list[SearchResult]:
        """Decode a request's sentences in the core (the contract of :meth:`ModelScheduler.submit`)."""
        if not self.up:
            raise Unavailable(CORE_DOWN)
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        message = Submit(call, name, version, request.request_id, request.deadline,
                         [WireSentence(list(s.source_ids), s.options, s.target_prefix) for s in sentences], list(work))
        try:
            try:
                self._pumps[0].send(encode(message))
            except zmq.ZMQError as error:
                raise Unavailable(CORE_DOWN) from error
            return await future
        except asyncio.CancelledError:
            request.cancel()
            if self.up:
                with contextlib.suppress(zmq.ZMQError):
                    self._pumps[0].send(encode(Cancel(call)))
            raise
        finally:
            self._calls.pop(call, None)

    def _receive(self, frames: list[bytes]) -> None:
        message = decode(*frames)
        if isinstance(message, Catalog):
            self.catalog = message
            self.up = True
            self._catalogs.put_nowait(message)
        elif isinstance(message, Done | Failed):
            future = self._calls.get(message.call)
            if future is None or future.done():
                return
            if isinstance(message, Done):
                future.set_result(message.results)
            else:
                future.set_exception(message.error())

    def _watch(self, frames: list[bytes]) -> None:
        """Hello on every (re)connection; on a disconnection fail every call in flight and go down."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._pumps[0].send(encode(Hello(os.getpid())))
        elif event == zmq.EVENT_DISCONNECTED and self.up:
            self.up = False
            log.error("engine core gone; answering UNAVAILABLE until it is back")
            self._fail_all(Unavailable(CORE_DOWN))
            self._catalogs.put_nowait(None)

    async def _take_catalogs(self) -> None:
        """Hand each catalog (None: the core went away) to ``on_catalog``, one after the other."""
        while True:
            catalog = await self._catalogs.get()
            await self.on_catalog(catalog)
            if catalog is not None:
                self._first_catalog.set()

    def _fail_all(self, error: ServingError) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
