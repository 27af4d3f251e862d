"""The engine core and its front-ends talk over a Unix socket: token ids in, search results out.

``nmt serve --frontends N`` (:mod:`server.supervisor`) runs the model repository, the schedulers and the
engines in one *engine core* process and everything else a request needs in N *front-end* processes
(gRPC, HTTP, TLS, tokens, validation, tokenizing, detokenizing, alignments, responses, logs). Each
front-end holds one connection to the core's Unix socket, in a directory only the server's user can
enter (the socket itself 0600):

* front-end -> core: :class:`Hello` asks for the catalog; :class:`Submit` decodes one request's sentences
  (token ids, options, target prefixes; the deadline on the host's monotonic clock, which every process
  shares); :class:`Cancel` withdraws a call whose client went away (its queued sentences leave the queue,
  its running ones the decode at the next step).
* core -> front-end: :class:`Catalog` after a hello and after every change of the repository (hot
  reload, a version failing or recovering); :class:`Done` with a call's search results; :class:`Failed`
  with a :class:`server.errors.ServingError`'s kind and message; :class:`Progress` with a streaming
  sentence's stable prefix whenever it grew (``TranslateStreaming``).

A message is one length-prefixed frame: a kind byte and a MessagePack body, encoded and decoded by
msgspec into the very dataclasses both sides use (:class:`server.types.DecodingOptions`,
:class:`server.types.SearchResult`, ...): typed decoding checks every field, nothing is unpickled (no code
runs on receipt), and NumPy arrays (attention) travel as raw bytes with their dtype and shape. Each
connection is an asyncio protocol (:class:`Channel`) that parses every frame a chunk completes, with no
task or future per message; the frames a turn of the event loop sends on a connection leave in one write at
the start of its next turn (under load, one system call and one wake-up of the other end for many messages).
That is the third transport measured (benchmarks/README.md, the split's
server CPU per request, `nmt bench server --capacity`, side by side): ZeroMQ through zmq.asyncio (a
future per message) 0.95-1.27 ms, ZeroMQ drained from its file descriptor 0.83-1.15 ms, this
0.75-0.88 ms; ZeroMQ also costs a background I/O thread per process and a socket monitor to notice a
peer's death, where a Unix socket's end is the connection closing.

The connection is the liveness signal both ways: when the core goes away, a front-end fails every call
in flight at once with UNAVAILABLE, refuses new calls with UNAVAILABLE (readiness turns false) and
connects again every ``RECONNECT_SECONDS`` until the restarted core answers; when a front-end goes away
(stopped or killed), the core cancels its calls, so they stop taking rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from server.errors import Internal, ServingError, Unavailable
from server.policy import RequestHandle
from server.types import DecodingOptions, SearchResult, SentenceRequest, StableReport, TargetPrefix

log = logging.getLogger("nmt.server")

RECONNECT_SECONDS = 0.05  # a front-end tries the core this often while it is away
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


@dataclass(frozen=True)
class Catalog:
    """The core's model repository as front-ends see it."""

    versions: tuple[VersionInfo, ...] = ()
    default_model: str = ""
    serving: dict[str, bool] = field(default_factory=dict)  # model name -> its newest version works


def catalog_of(repository: Any) -> Catalog:
    """The catalog of a :class:`server.core.repository.ModelRepository`."""
    versions = tuple(VersionInfo(mv.name, mv.version, str(mv.path), tuple(mv.fingerprint), mv.is_latest, mv.healthy,
                                 mv.provider, mv.device, mv.runtime_build) for mv in repository)
    return Catalog(versions, repository.default_model, {name: repository.serving(name) for name in repository.names})


@dataclass
class WireSentence:
    """What the core needs of a sentence: token ids, options and target prefix (no text, no callback), and
    whether the front-end wants its stable prefix as the search goes (:class:`Progress`)."""

    source_ids: list[int]
    options: DecodingOptions
    target_prefix: TargetPrefix
    stream: bool = False
    source_end: tuple[int, ...] = ()

    def request(self, on_stable: StableReport | None = None) -> SentenceRequest:
        return SentenceRequest(self.source_ids, self.options, target_prefix=self.target_prefix,
                               on_stable=on_stable if self.stream else None, source_end=self.source_end)


@dataclass
class Hello:
    pid: int  # the front-end's process (for the core's logs)


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
class Progress:
    """A streaming sentence's stable prefix grew (:attr:`server.types.SentenceRequest.on_stable`)."""

    call: int
    sentence: int  # its index in the call's Submit
    tokens: list[int]
    scores: list[float]
    attention: np.ndarray | None = None


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
MESSAGES: tuple[type, ...] = (Hello, Submit, Cancel, Catalog, Done, Failed, Progress)  # a frame's kind byte: the index


def encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        shape = ",".join(map(str, array.shape))
        return msgspec.msgpack.Ext(ARRAY_EXT, f"{array.dtype.str}|{shape}|".encode() + array.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot send {type(obj).__name__} to another process")


def decode_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, msgspec.msgpack.Ext) and obj.code == ARRAY_EXT:
        dtype, shape, data = bytes(obj.data).split(b"|", 2)
        return np.frombuffer(data, dtype=np.dtype(dtype.decode())).reshape(
            tuple(int(n) for n in shape.split(b",") if n))
    raise NotImplementedError(f"cannot receive {kind.__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=encode_hook)


_KIND_OF = {cls: bytes([i]) for i, cls in enumerate(MESSAGES)}
_DECODERS = [msgspec.msgpack.Decoder(cls, dec_hook=decode_hook) for cls in MESSAGES]
_LENGTH = struct.Struct("<I")  # a frame on the stream: its length, then its kind byte and MessagePack body


def encode(message: Any) -> bytes:
    """``message`` (one of :data:`MESSAGES`) as a frame: its kind byte, then its MessagePack body."""
    return _KIND_OF[type(message)] + _ENCODER.encode(message)


def decode(frame: bytes) -> Any:
    """The message in ``frame``; raises ``msgspec.DecodeError``/``ValidationError`` on anything else."""
    if not frame or frame[0] >= len(_DECODERS):
        raise msgspec.DecodeError(f"unknown message kind {frame[:1]!r}")
    return _DECODERS[frame[0]].decode(frame[1:])


# ---- both ends ------------------------------------------------------------------------------------------


class Channel(asyncio.Protocol):
    """One connection between a front-end and the core, on a Unix socket: length-prefixed frames, every
    chunk the kernel hands over parsed for all the frames it completes (no task or future per message)."""

    def __init__(self, on_message: Callable[[Channel, Any], None], on_lost: Callable[[Channel], None]) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._outgoing: list[bytes] = []  # frames sent since the loop last ran this channel's flush

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if len(buffer) < end:
                break
            frame = bytes(buffer[start + _LENGTH.size:end])
            start = end
            try:
                message = decode(frame)
            except (msgspec.MsgspecError, TypeError, ValueError):  # nothing but our own processes reach the socket
                log.exception("undecodable message from the other end")
                continue
            self.on_message(self, message)
        del buffer[:start]

    def send(self, message: Any) -> None:
        """Queue ``message``; the frames one turn of the event loop sends leave together in one write at the
        start of its next turn (one system call, and one wake-up of the other end, for many messages)."""
        frame = encode(message)
        if self.transport is None or self.transport.is_closing():
            return
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outgoing += (_LENGTH.pack(len(frame)), frame)

    def flush(self) -> None:
        """Write the frames queued so far."""
        frames, self._outgoing = self._outgoing, []
        if frames and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(frames))

    def close(self) -> None:
        if self.transport is not None:
            self.flush()
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost(self)


# ---- the engine core's end ------------------------------------------------------------------------------


class CoreEndpoint:
    """The core's Unix socket: serves submits and cancels against ``repository``, publishes its catalog to
    every connected front-end; a front-end that goes away (its connection closes) has its calls cancelled."""

    def __init__(self, repository: Any, path: str) -> None:
        self.repository = repository
        self.path = path
        self.peers: dict[Channel, int] = {}  # front-ends that asked for the catalog -> their pid
        # calls in the schedulers: the version held, the request, the scheduler's call (server.core.admission.Call)
        self.calls: dict[tuple[Channel, int], tuple[Any, RequestHandle, Any]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: Channel(self._receive, self._lost), self.path)
        os.chmod(self.path, 0o600)
        self.repository.add_listener(self.publish)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for key in list(self.calls):
            self._cancel(key)
        for peer in list(self.peers):
            peer.close()

    async def publish(self) -> None:
        """Send the catalog to every front-end that said hello (after each repository change)."""
        catalog = catalog_of(self.repository)
        for peer in list(self.peers):
            peer.send(catalog)

    def _receive(self, peer: Channel, message: Any) -> None:
        if isinstance(message, Hello):
            self.peers[peer] = message.pid
            peer.send(catalog_of(self.repository))
        elif isinstance(message, Submit):
            self._submit(peer, message)
        elif isinstance(message, Cancel):
            self._cancel((peer, message.call))

    def _lost(self, peer: Channel) -> None:
        """A front-end went away (it stopped, or was killed): cancel its calls, they have nobody to answer."""
        pid = self.peers.pop(peer, None)
        orphans = [key for key in self.calls if key[0] is peer]
        for key in orphans:
            self._cancel(key)
        if orphans:
            log.warning("front-end gone; its calls cancelled", extra={"fields": {"pid": pid, "calls": len(orphans)}})

    def _submit(self, peer: Channel, submit: Submit) -> None:
        """Queue a call in its version's scheduler, holding the version until the call is answered; the
        answer (:class:`Done` or :class:`Failed`) goes back from the scheduler's callback, with no task per
        call."""
        loop = asyncio.get_running_loop()
        handle = RequestHandle(submit.deadline, submit.request_id)
        key = (peer, submit.call)

        def progress(sentence: int) -> StableReport:  # called on the engine's thread
            return lambda tokens, scores, attention: loop.call_soon_threadsafe(
                peer.send, Progress(submit.call, sentence, tokens, scores, attention))

        def answer(results: list[SearchResult] | None, error: BaseException | None) -> None:
            if self.calls.pop(key, None) is not None:
                model.release()
                peer.send(Done(submit.call, results) if error is None else self._failed(submit.call, handle, error))

        try:
            model = self.repository.resolve(submit.name, submit.version)
            sentences = [s.request(progress(i)) for i, s in enumerate(submit.sentences)]
            call = model.scheduler.enqueue(sentences, submit.work, handle, answer)  # answers later, on this loop
        except Exception as error:  # noqa: BLE001 - refused (or a bug): one call's failure must not end the core
            peer.send(self._failed(submit.call, handle, error))
            return
        model.hold()
        self.calls[key] = (model, handle, call)

    @staticmethod
    def _failed(call: int, handle: RequestHandle, error: BaseException) -> Failed:
        if not isinstance(error, ServingError):
            log.error("engine core call failed", exc_info=error, extra={"fields": {"request_id": handle.request_id}})
            return Failed(call, "Internal", f"engine core error ({type(error).__name__})")
        return Failed(call, type(error).__name__, str(error))

    def _cancel(self, key: tuple[Channel, int]) -> None:
        """The front-end withdrew the call: nobody waits for an answer."""
        entry = self.calls.pop(key, None)
        if entry is not None:
            model, handle, call = entry
            model.release()
            model.scheduler.withdraw(handle, call)


# ---- a front-end's end ----------------------------------------------------------------------------------


class CoreClient:
    """A front-end's connection to the engine core: submits calls, keeps the latest catalog, knows whether
    the core is there (``up``) and calls ``on_catalog`` when the catalog (or the core's presence) changes.
    It connects again, every ``RECONNECT_SECONDS``, whenever the connection is lost."""

    def __init__(self, path: str, on_catalog: Callable[[Catalog | None], Awaitable[None]]) -> None:
        self.address = path
        self.on_catalog = on_catalog  # None: the core went away
        self.up = False
        self.catalog: Catalog | None = None
        self._channel: Channel | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._progress: dict[int, list[StableReport | None]] = {}  # streaming calls
        self._ids = itertools.count()
        self._catalogs: asyncio.Queue[Catalog | None] = asyncio.Queue()  # taken in order by one task
        self._tasks: list[asyncio.Task] = []
        self._lost = asyncio.Event()
        self._first_catalog = asyncio.Event()
        self._closing = False

    async def start(self, timeout: float) -> None:
        """Connect (and keep connecting) and wait (at most ``timeout`` seconds) for the core's first catalog."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._connect(), name="core-connect"),
                       loop.create_task(self._take_catalogs(), name="core-catalogs")]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_catalog.wait(), timeout)

    async def close(self) -> None:
        self._closing = True  # the connection this closes is not the core going away
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(Unavailable("server is shutting down"))
        if self._channel is not None:
            self._channel.close()

    async def submit(self, name: str, version: str, sentences: Sequence[SentenceRequest], work: Sequence[int],
                     request: RequestHandle) -> list[SearchResult]:
        """Decode a request's sentences in the core (the contract of :meth:`ModelScheduler.submit`)."""
        channel = self._channel
        if not self.up or channel is None:
            raise Unavailable(CORE_DOWN)
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        if any(s.on_stable is not None for s in sentences):
            self._progress[call] = [s.on_stable for s in sentences]
        try:
            channel.send(Submit(call, name, version, request.request_id, request.deadline,
                                [WireSentence(list(s.source_ids), s.options, s.target_prefix, s.on_stable is not None,
                                              s.source_end)
                                 for s in sentences], list(work)))
            return await future
        except asyncio.CancelledError:
            request.cancel()
            if self.up:
                channel.send(Cancel(call))
            raise
        finally:
            self._calls.pop(call, None)
            self._progress.pop(call, None)

    async def _connect(self) -> None:
        """Connect, say hello, wait for the connection to end; again, for as long as the front-end runs."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, channel = await loop.create_unix_connection(lambda: Channel(self._receive, self._on_lost),
                                                               self.address)
            except OSError:  # the core is not (yet, or any more) listening
                await asyncio.sleep(RECONNECT_SECONDS)
                continue
            self._lost.clear()
            self._channel = channel
            channel.send(Hello(os.getpid()))
            await self._lost.wait()
            await asyncio.sleep(RECONNECT_SECONDS)

    def _receive(self, channel: Channel, message: Any) -> None:
        if isinstance(message, Catalog):
            self.catalog = message
            self.up = True
            self._catalogs.put_nowait(message)
        elif isinstance(message, Progress):
            reports = self._progress.get(message.call)  # None: the call ended meanwhile
            if reports is not None and (report := reports[message.sentence]) is not None:
                report(message.tokens, message.scores, message.attention)
        elif isinstance(message, Done | Failed):
            future = self._calls.get(message.call)
            if future is None or future.done():
                return
            if isinstance(message, Done):
                future.set_result(message.results)
            else:
                future.set_exception(message.error())

    def _on_lost(self, channel: Channel) -> None:
        """The core went away: fail every call in flight at once and refuse new ones until it is back."""
        self._channel = None
        self._lost.set()
        if self.up:
            self.up = False
            if not self._closing:
                log.error("engine core gone; answering UNAVAILABLE until it is back")
            self._catalogs.put_nowait(None)
        self._fail_all(Unavailable(CORE_DOWN))

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
