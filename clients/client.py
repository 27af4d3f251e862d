"""Python client library of the ``translation.v1.Translator`` service.

::

    from clients import TranslatorClient, TranslationError

    with TranslatorClient("127.0.0.1:50051") as client:
        [result] = client.translate("one two", beam_size=4, num_hypotheses=2, scores=True, attention=True)
        best = result.hypotheses[0]
        print(best.text, best.score, best.attention.pharaoh)
        for model in client.list_models():
            print(model.name, model.version, model.architecture)

:class:`AsyncTranslatorClient` is the ``grpc.aio`` twin (``async with`` / ``await client.translate(...)``).

Protobufs stop here: results are the plain dataclasses of :mod:`clients.messages` (:class:`Translation`,
:class:`Hypothesis`, :class:`Attention`, :class:`ModelInfo`), and every failed call raises
:class:`TranslationError` with the gRPC status code and the server's message.

**Deadlines.** Every call has one: the client's ``timeout`` (default 30 s) unless the call passes its
own. The deadline covers the whole call, retries and back-off included.

**Retries** (:class:`RetryPolicy`) are done by a small explicit loop in this module rather than by a
``retryPolicy`` in the channel's service config. Both would be correct here, because only idempotent
reads are retried (``Translate`` and ``ListModels`` change nothing on the server); the loop was chosen
because

* the same policy object and the same code path serve the sync and the asyncio client, and tests can
  check exactly what was retried and how often (:attr:`TranslationError.attempts`);
* it is not capped at 5 attempts as gRPC's service-config retries are, it does not depend on the
  ``grpc.enable_retries`` channel argument or on a resolver-provided service config replacing ours, and
  every attempt carries the same ``x-request-id``, so the server's logs tie the attempts together;
* the last attempt's status and message reach the caller unchanged, together with the attempt count.

Retried: UNAVAILABLE (server draining on shutdown, connection refused or reset), RESOURCE_EXHAUSTED
(queue full) and the one CANCELLED a server sends on its own: a call that reached a stopping server
before any handler took it ends CANCELLED with gRPC core's message ``"CANCELLED"`` (grpc/grpc#41785);
it was never processed, so it is as safe to repeat as a refused call. At most ``max_attempts`` attempts
in all, sleeping ``uniform(0, min(max_backoff, initial_backoff * multiplier ** (attempt - 1)))`` between
attempts (exponential back-off with "full jitter", the formula of gRPC's retry design A6), and never past
the call's deadline. Never retried:
INVALID_ARGUMENT, NOT_FOUND, DEADLINE_EXCEEDED, any other CANCELLED and every other code: repeating them
cannot succeed, or would spend a deadline that has already passed. ``health`` is never retried (a probe must
report the present state), and gRPC's own transparent retries (of calls that never left the client)
stay on.

**Several replicas**: ``address`` may name several servers or a ``dns:///`` name; calls are balanced
over them with gRPC's ``round_robin`` policy and client-side health checking (:mod:`clients.channel`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.channel import DEFAULT_KEEPALIVE, channel_options, channel_target, credentials_for, split_addresses
from clients.messages import (
    Glossary,
    GlossaryInfo,
    ModelInfo,
    StreamDelta,
    Translation,
    TranslationError,
    build_request,
    build_score_request,
    delta_from_pb,
    error_from_rpc,
    glossary_entries_pb,
    glossary_from_pb,
    model_info_from_pb,
    translations_from_pb,
)
from server.protos import pb2, pb2_grpc

log = logging.getLogger("nmt.client")

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 30.0  # seconds, per call, retries included
REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"


# ---- retry policy ---------------------------------------------------------------------------------------------

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
NEVER_RETRIED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# gRPC core's message for a call that a stopping server dropped before any handler took it (grpc/grpc#41785);
# a caller's own cancellation reads "Locally cancelled by application!", the server's handlers write their own.
DROPPED_AT_SHUTDOWN = "CANCELLED"


@dataclass(frozen=True)
class RetryPolicy:
    """When and how idempotent calls (``Translate``, ``ListModels``) are retried; see the module docstring.

    ``max_attempts=1`` turns retries off.
    """

    max_attempts: int = 3  # attempts in all, the first one included
    initial_backoff: float = 0.1  # seconds: the upper bound of the first sleep
    max_backoff: float = 2.0  # seconds: the largest upper bound of a sleep
    backoff_multiplier: float = 2.0
    retryable_codes: frozenset[grpc.StatusCode] = field(default=RETRYABLE_CODES)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.backoff_multiplier < 1:
            raise ValueError("backoffs must not be negative and backoff_multiplier must be at least 1")
        unsafe = set(self.retryable_codes) & NEVER_RETRIED
        if unsafe:
            raise ValueError(f"never retried: {', '.join(sorted(c.name for c in unsafe))}")
        object.__setattr__(self, "retryable_codes", frozenset(self.retryable_codes))

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based): full jitter."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.backoff_multiplier ** (attempt - 1))
        return (rng or random).uniform(0.0, ceiling)

    def should_retry(self, code: grpc.StatusCode | None, attempt: int, message: str = "") -> bool:
        """Whether failed attempt number ``attempt`` (1-based), ended with ``code`` and ``message``, is repeated."""
        if code == grpc.StatusCode.CANCELLED and message == DROPPED_AT_SHUTDOWN:
            code = grpc.StatusCode.UNAVAILABLE  # never processed: the server refused it by stopping
        return code in self.retryable_codes and attempt < self.max_attempts


class _ClientBase:
    """What the sync and the asyncio client share: configuration, requests and the retry decision.

    ``address`` is ``host:port``, any gRPC target such as ``dns:///host:port``, or several ``host:port``
    (a list or a comma-separated string): see "Several replicas" in the module docstring. Keyword arguments:
    ``timeout`` (seconds per call, retries included; ``None``: no deadline), ``retry`` (a
    :class:`RetryPolicy`) or just ``max_attempts``, ``tls=True`` for a TLS channel with the system's root
    certificates, or ``root_certificates`` (PEM bytes or a file path; implies TLS), ``client_cert`` and
    ``client_key`` (PEM bytes or file paths: the client's certificate chain and key, for a server that
    requires mutual TLS; imply TLS), ``credentials`` (any ``grpc.ChannelCredentials``, instead of the
    above), ``token`` (a bearer token, sent as ``authorization: Bearer <token>`` metadata with every call;
    send it over TLS, or only on loopback), ``options`` (extra gRPC channel arguments), ``interceptors``
    (gRPC client interceptors of the channel: ``grpc.*ClientInterceptor`` for the blocking client,
    ``grpc.aio.*ClientInterceptor`` for the asyncio one; the load tests count calls with one),
    ``keepalive`` (seconds between HTTP/2 keepalive pings; ``None``: none), ``health_check`` (route only to
    replicas whose Translator health is SERVING; default: on when ``address`` names several servers or is
    a ``dns:`` name, off for one server, whose health a probe must still be able to ask).
    """

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, *, timeout: float | None = DEFAULT_TIMEOUT,
                 retry: RetryPolicy | None = None, max_attempts: int | None = None, tls: bool = False,
                 root_certificates: bytes | str | os.PathLike | None = None,
                 client_cert: bytes | str | os.PathLike | None = None,
                 client_key: bytes | str | os.PathLike | None = None,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
                 options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] = (),
                 keepalive: float | None = DEFAULT_KEEPALIVE, health_check: bool | None = None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if keepalive is not None and not keepalive > 0:
            raise ValueError(f"keepalive must be a positive number of seconds or None, got {keepalive!r}")
        self.address = address if isinstance(address, str) else ",".join(address)
        self.target = channel_target(address)
        if health_check is None:
            health_check = self.target.startswith("dns:") or len(split_addresses(address)) > 1
        self.timeout = timeout
        policy = retry or RetryPolicy()
        self.retry = replace(policy, max_attempts=max_attempts) if max_attempts is not None else policy
        self._credentials = credentials_for(tls, root_certificates, credentials, client_cert, client_key)
        self._auth = ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()
        self._options = channel_options(options, health_check=health_check, keepalive=keepalive)
        self._interceptors = tuple(interceptors)
        self._setup()

    def _setup(self) -> None:
        """Open the channel (sync) or prepare to (asyncio)."""

    def _deadline(self, timeout: float | None) -> float | None:
        timeout = self.timeout if timeout is None else timeout
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None, request_id: str, attempts: int) -> float | None:
        if deadline is None:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TranslationError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the call was sent",
                                   request_id, attempts=attempts)
        return remaining

    def _next_sleep(self, error: grpc.RpcError, attempt: int, deadline: float | None, request_id: str) -> float:
        """Seconds to wait before retrying, or raise the :class:`TranslationError` of ``error``."""
        failure = error_from_rpc(error, request_id, attempt)
        if not self.retry.should_retry(failure.code, attempt, failure.message):
            raise failure from None
        delay = self.retry.backoff(attempt)
        if deadline is not None and time.monotonic() + delay >= deadline:
            raise failure from None  # no time left for another attempt: the last status is the best answer
        log.debug("retrying", extra={"fields": {"request_id": request_id, "attempt": attempt,
                                                "code": failure.code.name, "backoff_seconds": round(delay, 3)}})
        return delay

    def _metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        """The call's metadata: its request id (when it has one) and the bearer token (when the client has one)."""
        return (((REQUEST_ID_KEY, request_id),) if request_id else ()) + self._auth

    def __repr__(self) -> str:  # never shows the token
        return f"{type(self).__name__}({self.address!r}, tls={self._credentials is not None}, token={bool(self._auth)})"

    @staticmethod
    def _request_id(request_id: str | None) -> str:
        """The caller's id, else a fresh one: every attempt of a call carries the same id."""
        return request_id or uuid.uuid4().hex


# ---- the synchronous client -------------------------------------------------------------------------------------


class TranslatorClient(_ClientBase):
    """Blocking client; the arguments are :class:`_ClientBase`'s::

        TranslatorClient("127.0.0.1:50051", timeout=10, max_attempts=5)
        TranslatorClient("translate.example.com:443", root_certificates="ca.pem")
        TranslatorClient("translate.example.com:443", root_certificates="ca.pem", client_cert="client.pem",
                         client_key="client.key", token=os.environ["NMT_TOKEN"])

    Thread-safe; use as a context manager or call :meth:`close`.
    """

    def _setup(self) -> None:
        if self._credentials is None:
            self.channel = grpc.insecure_channel(self.target, options=self._options)
        else:
            self.channel = grpc.secure_channel(self.target, self._credentials, options=self._options)
        if self._interceptors:
            self.channel = grpc.intercept_channel(self.channel, *self._interceptors)
        self.stub = pb2_grpc.TranslatorStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def translate(self, texts: str | list[str], *, model: str = "", version: str = "", beam_size: int = 0,
                  num_hypotheses: int = 0, max_length: int = 0, length_penalty: float = 0.0,
                  attention: bool = False, scores: bool = False, target_language: str = "",
                  target_prefixes: Sequence[str] = (), alternatives: bool = False, text_format: str = "",
                  splitting: str = "", source_language: str = "", glossary: Glossary = (), glossary_id: str = "",
                  do_not_translate: Sequence[str] = (), timeout: float | None = None,
                  request_id: str | None = None) -> list[Translation]:
        """Translate ``texts`` (one string or a list) in one request; one :class:`Translation` per text, in order.

        Zero options mean the model's defaults; ``model``/``version`` empty: the server's default model, its
        newest version. ``attention`` and ``scores`` fill :attr:`Hypothesis.attention` and the scores.
        ``target_prefixes`` (none, or one per text, "" for none) force the start of each translation (a prefix
        ending inside a word is completed); ``alternatives``: the hypotheses are up to ``num_hypotheses`` most
        likely next words after the prefix, each continued (an editor's next-word suggestions; ``score`` is the
        word's log-probability). ``text_format`` ("text", "html", "xml") and ``splitting`` ("sentences",
        "no_newlines", "off") say how each text is read (:attr:`Translation.segments`: its sentences).
        ``source_language`` (a code, or "auto" to detect it) and ``target_language`` choose the model by language
        pair when ``model`` is empty (:meth:`list_languages`). ``glossary`` ({source: target}, or
        ``(source, target[, case_insensitive])`` tuples), ``glossary_id`` (:meth:`create_glossary`) and
        ``do_not_translate`` are terms every hypothesis holds (:attr:`Translation.terms`: those found).
        ``timeout``: this call's deadline in seconds (default: the client's). ``request_id`` is sent as
        ``x-request-id`` metadata (a fresh id when ``None``), the same for every attempt.
        """
        request = build_request(texts, model=model, version=version, beam_size=beam_size,
                                num_hypotheses=num_hypotheses, max_length=max_length,
                                length_penalty=length_penalty, attention=attention, scores=scores,
                                target_language=target_language, target_prefixes=target_prefixes,
                                alternatives=alternatives, text_format=text_format, splitting=splitting,
                                source_language=source_language, glossary=glossary, glossary_id=glossary_id,
                                do_not_translate=do_not_translate)
        response = self._call(self.stub.Translate, request, timeout, request_id)
        return translations_from_pb(response, scores=scores)

    def translate_stream(self, text: str, *, model: str = "", version: str = "", beam_size: int = 0,
                         num_hypotheses: int = 0, max_length: int = 0, length_penalty: float = 0.0,
                         attention: bool = False, scores: bool = False, target_language: str = "",
                         target_prefix: str = "", source_language: str = "", glossary: Glossary = (),
                         glossary_id: str = "", do_not_translate: Sequence[str] = (), timeout: float | None = None,
                         request_id: str | None = None) -> Iterator[StreamDelta]:
        """Translate one ``text`` as the server decides it: :class:`StreamDelta` messages whose texts join to
        the translation, the last one carrying the whole :class:`Translation` (options as :meth:`translate`).
        Not retried once a message has arrived (the words shown cannot be taken back); closing the iterator
        early cancels the call on the server."""
        request = build_request(text, model=model, version=version, beam_size=beam_size,
                                num_hypotheses=num_hypotheses, max_length=max_length, length_penalty=length_penalty,
                                attention=attention, scores=scores, target_language=target_language,
                                target_prefixes=[target_prefix] if target_prefix else (),
                                source_language=source_language, glossary=glossary, glossary_id=glossary_id,
                                do_not_translate=do_not_translate)
        if len(request.texts) != 1:
            raise ValueError("translate_stream translates one text")
        request_id = self._request_id(request_id)
        call = self.stub.TranslateStreaming(request, timeout=self._remaining(self._deadline(timeout), request_id, 0),
                                            metadata=self._metadata(request_id))
        try:
            for message in call:
                yield delta_from_pb(message, scores=scores)
        except grpc.RpcError as error:
            raise error_from_rpc(error, request_id) from None
        finally:
            call.cancel()

    def score(self, texts: str | list[str], targets: str | list[str], *, model: str = "", version: str = "",
              attention: bool = False, length_penalty: float = 0.0, target_language: str = "",
              timeout: float | None = None, request_id: str | None = None) -> list[Translation]:
        """Score given translations (``targets``, one per text): one :class:`Translation` per text whose single
        hypothesis is its target, with per-token log-probabilities, score and (``attention``) alignment."""
        request = build_score_request(texts, targets, model=model, version=version, attention=attention,
                                      length_penalty=length_penalty, target_language=target_language)
        response = self._call(self.stub.Score, request, timeout, request_id)
        return translations_from_pb(response, scores=True)

    def list_models(self, *, timeout: float | None = None, request_id: str | None = None) -> list[ModelInfo]:
        """Every loaded model version."""
        response = self._call(self.stub.ListModels, pb2.ListModelsRequest(), timeout, request_id)
        return [model_info_from_pb(m) for m in response.models]

    def list_languages(self, *, timeout: float | None = None,
                       request_id: str | None = None) -> list[tuple[str, str, str]]:
        """The served language pairs: ``(source, target, the model a request naming the pair gets)``."""
        response = self._call(self.stub.ListLanguages, pb2.ListLanguagesRequest(), timeout, request_id)
        return [(p.source_language, p.target_language, p.model) for p in response.pairs]

    def create_glossary(self, glossary_id: str, source_language: str, target_language: str, entries: Glossary, *,
                        case_insensitive: bool = False, name: str = "", timeout: float | None = None,
                        request_id: str | None = None) -> GlossaryInfo:
        """Store a glossary on the server (``--glossary-dir``) for requests to name in ``glossary_id``
        (``name``: a display name, one line)."""
        request = pb2.CreateGlossaryRequest(glossary=pb2.Glossary(
            glossary_id=glossary_id, source_language=source_language, target_language=target_language,
            entries=glossary_entries_pb(entries), case_insensitive=case_insensitive, name=name))
        return glossary_from_pb(self._call(self.stub.CreateGlossary, request, timeout, request_id))

    def list_glossaries(self, *, timeout: float | None = None, request_id: str | None = None) -> list[GlossaryInfo]:
        response = self._call(self.stub.ListGlossaries, pb2.ListGlossariesRequest(), timeout, request_id)
        return [glossary_from_pb(g) for g in response.glossaries]

    def get_glossary(self, glossary_id: str, *, timeout: float | None = None,
                     request_id: str | None = None) -> GlossaryInfo:
        request = pb2.GetGlossaryRequest(glossary_id=glossary_id)
        return glossary_from_pb(self._call(self.stub.GetGlossary, request, timeout, request_id))

    def delete_glossary(self, glossary_id: str, *, timeout: float | None = None,
                        request_id: str | None = None) -> None:
        self._call(self.stub.DeleteGlossary, pb2.DeleteGlossaryRequest(glossary_id=glossary_id), timeout, request_id)

    def health(self, model: str = "", *, timeout: float | None = None) -> str:
        """``grpc.health.v1`` status of the server (``model=""``), of a model name or of a service name:
        ``"SERVING"``, ``"NOT_SERVING"``...; an unknown name raises :class:`TranslationError` NOT_FOUND."""
        deadline = self._deadline(timeout)
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=model),
                                       timeout=self._remaining(deadline, "", 0), metadata=self._metadata())
        except grpc.RpcError as error:
            raise error_from_rpc(error, None) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def _call(self, method: Any, request: Any, timeout: float | None, request_id: str | None) -> Any:
        deadline = self._deadline(timeout)
        request_id = self._request_id(request_id)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=self._remaining(deadline, request_id, attempt - 1),
                              metadata=self._metadata(request_id))
            except grpc.RpcError as error:
                time.sleep(self._next_sleep(error, attempt, deadline, request_id))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TranslatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the asyncio client -----------------------------------------------------------------------------------------


class AsyncTranslatorClient(_ClientBase):
    """The ``grpc.aio`` twin of :class:`TranslatorClient` (same arguments, same results, awaitable).

    The channel is opened on first use, in the running event loop::

        async with AsyncTranslatorClient("127.0.0.1:50051") as client:
            results = await client.translate(["one two", "three"])
    """

    def _setup(self) -> None:
        self.channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._health: Any = None

    def _open(self) -> Any:
        if self.channel is None:
            if self._credentials is None:
                self.channel = grpc.aio.insecure_channel(self.target, options=self._options,
                                                         interceptors=self._interceptors or None)
            else:
                self.channel = grpc.aio.secure_channel(self.target, self._credentials, options=self._options,
                                                       interceptors=self._interceptors or None)
            self._stub = pb2_grpc.TranslatorStub(self.channel)
            self._health = health_pb2_grpc.HealthStub(self.channel)
        return self._stub

    @property
    def stub(self) -> Any:
        return self._open()

    async def translate(self, texts: str | list[str], *, model: str = "", version: str = "", beam_size: int = 0,
                        num_hypotheses: int = 0, max_length: int = 0, length_penalty: float = 0.0,
                        attention: bool = False, scores: bool = False, target_language: str = "",
                        target_prefixes: Sequence[str] = (), alternatives: bool = False,
                        text_format: str = "", splitting: str = "", source_language: str = "",
                        timeout: float | None = None, request_id: str | None = None) -> list[Translation]:
        """See :meth:`TranslatorClient.translate`."""
        request = build_request(texts, model=model, version=version, beam_size=beam_size,
                                num_hypotheses=num_hypotheses, max_length=max_length,
                                length_penalty=length_penalty, attention=attention, scores=scores,
                                target_language=target_language, target_prefixes=target_prefixes,
                                alternatives=alternatives, text_format=text_format, splitting=splitting,
                                source_language=source_language)
        response = await self._call(self._open().Translate, request, timeout, request_id)
        return translations_from_pb(response, scores=scores)

    async def score(self, texts: str | list[str], targets: str | list[str], *, model: str = "",
                    version: str = "", attention: bool = False, length_penalty: float = 0.0,
                    target_language: str = "", timeout: float | None = None,
                    request_id: str | None = None) -> list[Translation]:
        """See :meth:`TranslatorClient.score`."""
        request = build_score_request(texts, targets, model=model, version=version, attention=attention,
                                      length_penalty=length_penalty, target_language=target_language)
        response = await self._call(self._open().Score, request, timeout, request_id)
        return translations_from_pb(response, scores=True)

    async def list_models(self, *, timeout: float | None = None, request_id: str | None = None) -> list[ModelInfo]:
        """Every loaded model version."""
        response = await self._call(self._open().ListModels, pb2.ListModelsRequest(), timeout, request_id)
        return [model_info_from_pb(m) for m in response.models]

    async def health(self, model: str = "", *, timeout: float | None = None) -> str:
        """See :meth:`TranslatorClient.health`."""
        self._open()
        deadline = self._deadline(timeout)
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=model),
                                             timeout=self._remaining(deadline, "", 0), metadata=self._metadata())
        except grpc.RpcError as error:
            raise error_from_rpc(error, None) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def _call(self, method: Any, request: Any, timeout: float | None, request_id: str | None) -> Any:
        deadline = self._deadline(timeout)
        request_id = self._request_id(request_id)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(request, timeout=self._remaining(deadline, request_id, attempt - 1),
                                    metadata=self._metadata(request_id))
            except grpc.RpcError as error:
                await asyncio.sleep(self._next_sleep(error, attempt, deadline, request_id))

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def __aenter__(self) -> AsyncTranslatorClient:
        self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
